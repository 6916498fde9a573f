"""The command line of the trainer (``scripts/train.py``): flags, config, checks, run.

  python scripts/train.py --config=configs/synthetic.py:quick
  python scripts/train.py --config=configs/lra/listops.py:sbm,smoke --config.seed=1
  python scripts/train.py --config=configs/synthetic.py:sbm --print_config

Order of work: parse the flags and the config (an unknown ``--config.<field>`` is named
with its closest match); start the other processes of a multi-process job; check the
whole config (every section, every attention option, the task's fields, ``init_from``,
the mesh against the devices); with ``--print_config`` print it and stop; find the run
directory and, when it holds a run, check that this config may resume it; with
``--dry_run`` stop there; then build the task (data is read or generated only now) and
train. Every user error is one line on stderr, ``error: ...``, and exit status 2, with
nothing written (``--print_config`` with a bad value prints the error alone).

Exit statuses: 0: the run finished; 2: a user error; 3: a non-finite loss or gradient
halted it (the message names the step and the saved replay state); 74: the disk (or
quota) holding the run's folder is full (one line naming the folder; the records end at
the last whole line and no temporary checkpoint is left; free space and run again to
resume); 75 (EX_TEMPFAIL, "try again"): SIGTERM / Ctrl-C / SIGHUP stopped it after
saving its latest checkpoint (the printed line says "stopped at step N (SIGTERM)"; no
summary.json is written; the same command with ``--output_dir`` set to that directory
resumes it), so that ``train && next`` stops and a scheduler can requeue it; 130:
Ctrl-C before training started. A second signal ends the process at once without
saving (the shell shows 128 + the signal: 143 for SIGTERM). ``metrics.jsonl`` is strict
JSON, one record per line: a NaN or infinite value is written as ``null``.

``--workdir=DIR`` is ``--output_dir=DIR``; ``--list_presets`` lists the presets the
``--config`` file accepts.

``ml_collections.config_flags`` parses ``--config`` (``DEFINE_config_file``: the file,
the preset after the colon, the ``--config.<field>`` overrides). What is ours is around
it: a preset found by name in the ``configs`` package (``--config=synthetic:quick``, as
an installed package runs it), one-line errors, the mechanism's options added before the
overrides apply, ``--print_config``, ``--dry_run``, ``--list_presets`` and
``--workdir``. The config and the run directory are each checked once, here, before the
task is built; the trainer is handed the checked folder (``run_dir.RunFolder``).

Any option of the configured attention mechanism may be set with
``--config.model.attention_options.<option>=...`` even when the preset does not list
it (it then starts from the mechanism's default), e.g.
``--config.model.attention_options.capacity_buckets='(0.01, 0.05, 0.25)'``.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

import ml_collections
from absl import flags
from ml_collections import config_flags

from sbm_jax.script_usage import USAGE_EXIT
from sbm_jax.tasks.registry import DEFAULT_TASK_MODULES, import_task_modules
from sbm_jax.training import step_size
from sbm_jax.training.config_checks import (
    ConfigError,
    closest_field,
    config_errors,
    one_line,
    without_repeats,
)
from sbm_jax.training.run_dir import RunFolder, check_run_folder

NONFINITE_EXIT = 3
#: A run stopped by SIGTERM, Ctrl-C or SIGHUP after saving its latest checkpoint:
#: sysexits' EX_TEMPFAIL ("try again later"), so that ``train && next`` stops and a
#: scheduler requeues it; distinct from 143 / 130, what the shell shows when a signal
#: (a second one) ended the process without saving.
STOPPED_EXIT = 75
#: The disk (or quota) under the run's folder is full: nothing half-written is left.
NO_SPACE_EXIT = 74
INTERRUPTED_EXIT = 130

HELP = """\
Train a model on the task its config names, through the one trainer.

  {prog} --config=CONFIG.py[:PRESET] [--config.FIELD=VALUE ...] [--output_dir=DIR]

  --config=configs/synthetic.py:quick        a config file and its preset
  --config=synthetic:quick                   the same preset by name (installed package)
  --config.train.num_steps=500               override any field of it
  --print_config                             print the resolved config, check it, exit
  --dry_run                                  also say where it would train, then exit
  --list_presets                             list the presets the config file accepts
  --output_dir=DIR                           the run's directory; an existing run there
                                             is resumed if its config matches (default:
                                             config.output_dir or runs/<name>-<time>);
                                             --workdir=DIR is the same flag

To list a preset's fields (every one can be overridden):
  {prog} --config=configs/lra/listops.py:sbm,smoke --print_config
"""


def resolve_config_path(path: str) -> str | None:
    """The config file ``path`` names: the file itself when it exists, else a preset of
    the ``configs`` package by name (``synthetic``, ``lra/listops``, ``configs/synthetic.py``),
    which is how an installed package (``sbm-train``, outside a checkout) finds them.
    None when neither exists."""
    if os.path.isfile(path):
        return path
    name = path[: -len(".py")] if path.endswith(".py") else path
    name = name.replace(os.sep, "/").removeprefix("./").removeprefix("configs/")
    try:
        import configs  # the presets: the checkout's, or the wheel's
    except ImportError:
        return None
    for root in getattr(configs, "__path__", []):
        candidate = os.path.join(root, *name.split("/")) + ".py"
        if os.path.isfile(candidate):
            return candidate
    return None


class _SpecError(Exception):
    """A ``--config`` value that names no config, or whose ``get_config`` fails, as one
    line. Not a ValueError: absl would wrap one in its own message."""


class _PresetFileParser(flags.ArgumentParser):
    """config_flags' parser of ``--config=<file>[:<preset>]`` (``inner``), with what is
    ours around it: the file found by name in the ``configs`` package when it is not a
    path (``resolve_config_path``), one-line errors, and the configured mechanism's
    options that the command line sets but the preset leaves out, added at their
    defaults before config_flags applies the overrides (it can override only fields
    that exist). config_flags has no hook between loading and overriding, hence this
    wrapper on its flag's parser."""

    def __init__(self, inner: Any, argv: Sequence[str]) -> None:
        self._inner = inner
        self._argv = list(argv)
        self.loaded: Any = None  # the config before the overrides, for error messages

    def flag_type(self) -> str:
        return str(self._inner.flag_type())

    def parse(self, spec: str) -> Any:
        given, colon, preset = str(spec).partition(":")
        path = resolve_config_path(given)
        if path is None:
            raise _SpecError(
                f"--config={spec}: no such file {given!r}, and no preset of that name in the "
                "configs package (e.g. synthetic, lra/listops, glue/pretrain)"
            )
        try:
            config = self._inner.parse(path + colon + preset)
        except (ValueError, TypeError, KeyError) as e:
            # config_flags re-raises get_config's ValueError / TypeError with the
            # traceback as its message; the user's line is the original one.
            original = e.__context__ if "Error whilst parsing" in str(e) else e
            raise _SpecError(f"--config={spec}: {original}") from None
        except AttributeError as e:
            if "get_config" not in str(e):
                raise _SpecError(f"--config={spec}: AttributeError: {_last_line(str(e))}") from None
            raise _SpecError(f"--config={spec}: {path!r} has no get_config()") from None
        except Exception as e:
            if type(e).__name__ == "PresetListing":  # --list_presets: the caller's answer
                raise
            raise _SpecError(f"--config={spec}: {type(e).__name__}: {_last_line(str(e))}") from None
        if not isinstance(config, ml_collections.ConfigDict):
            raise _SpecError(
                f"--config={spec}: get_config() returned {type(config).__name__}, not a ConfigDict"
            )
        _add_attention_options(config, self._argv)
        self.loaded = config
        return config


def _define_config(fv: Any, argv: Sequence[str], lock_config: bool = True) -> None:
    """``--config`` on ``fv``: ``config_flags.DEFINE_config_file`` with our parser."""
    config_flags.DEFINE_config_file(
        "config",
        None,
        "The config: path.py[:preset], or a preset's name (synthetic:quick).",
        flag_values=fv,
        lock_config=lock_config,
        sys_argv=list(argv),
    )
    fv["config"].parser = _PresetFileParser(fv["config"].parser, argv)


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``get_config(preset)`` of the config ``spec`` = ``path.py[:preset]`` (or a preset's
    name), through config_flags, unlocked.

    Raises:
      ConfigError naming ``--config`` for a missing file, a file without ``get_config``
      or a preset its ``get_config`` rejects.
    """
    fv = flags.FlagValues()
    argv = ["load_config_file", f"--config={spec}"]
    _define_config(fv, argv, lock_config=False)
    try:
        fv(argv)
    except _SpecError as e:
        raise ConfigError(str(e)) from None
    return fv["config"].value


def config_spec(argv: Sequence[str]) -> str | None:
    """The ``--config`` value of ``argv`` as given (absl, every other flag ignored)."""
    fv = flags.FlagValues()
    flags.DEFINE_string("config", None, "", flag_values=fv)
    try:
        fv(list(argv), known_only=True)
    except flags.Error:
        return None
    return fv.config


def list_presets(spec: str) -> str:
    """The presets the config file of ``spec`` accepts, as ``--list_presets`` prints
    them (read from its ``get_config``'s call of ``configs.presets.parse_preset``).

    Raises:
      ConfigError: naming ``--config`` for a missing file or one that does not parse
        its preset with ``parse_preset``.
    """
    given = spec.partition(":")[0]
    path = resolve_config_path(given)
    if path is None:
        raise ConfigError(f"--config={spec}: no such file {given!r}")
    from configs import presets

    try:
        with presets.listing():
            load_config_file(given)
    except presets.PresetListing as found:
        forms = {"lambda": "lambda=<float>", "seed": "seed=<int>", "task": "task=<name>"}
        lines = [
            f"presets of {given} (--config={given}:<part>,<part>...; parts in any order):",
            f"  mechanisms: {', '.join(found.mechanisms)} (default: {found.default_mechanism})",
            f"  scales:     {', '.join(found.scales)} (default: {found.scales[0]})",
        ]
        if found.keys:
            lines.append(f"  settings:   {', '.join(forms[k] for k in found.keys)}")
        example = f"{found.default_mechanism},{found.scales[-1]}"
        lines.append(f"e.g. --config={given}:{example} --print_config")
        return "\n".join(lines) + "\n"
    raise ConfigError(f"--config={spec}: {path!r} takes no preset (its get_config ignores it)")


def _overrides(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """``(field path, value)`` of every ``--config.<path>=<value>`` in ``argv``."""
    out = []
    for arg in argv:
        if arg.startswith(("--config.", "-config.")):
            body = arg.split("config.", 1)[1]
            path, sep, value = body.partition("=")
            out.append((path, value if sep else None))
    return out


def _add_attention_options(config: ml_collections.ConfigDict, argv: Sequence[str]) -> None:
    """Give ``model.attention_options`` every option the command line sets that the
    preset leaves out, at the mechanism's default (so its type is known; a None default
    becomes a placeholder of the annotated type)."""
    model = config.get("model")
    if model is None or "attention_options" not in model:
        return
    mechanism = model.get("attention")
    for path, value in _overrides(argv):
        if path == "model.attention":
            mechanism = value
    try:
        from sbm_jax.attention.registry import get_mechanism

        entry = get_mechanism(str(mechanism))
        defaults = entry.option_defaults()
    except ValueError:
        return
    options = model.attention_options
    for path, _ in _overrides(argv):
        prefix = "model.attention_options."
        if not path.startswith(prefix):
            continue
        name = path[len(prefix) :]
        if "." in name or name in options or name not in defaults:
            continue
        default = defaults[name]
        if default is None:
            # A None default (sparse_fixed's c, reformer's num_buckets, sbm's edge_cost)
            # would make a NoneType field, which ml_collections cannot override: a typed
            # placeholder (None until the flag sets it) can be.
            kind = entry.option_type(name)
            if kind is None:
                continue
            default = ml_collections.config_dict.placeholder(kind)
        elif not isinstance(default, (bool, int, float, str, tuple)):
            continue
        with options.unlocked():
            options[name] = default


def _missing_field(config: Any, path: str) -> str | None:
    """The first prefix of ``path`` that ``config`` lacks, or None if all exist."""
    node = config
    parts = path.split(".")
    for i, part in enumerate(parts):
        if not hasattr(node, "keys") or part not in node:
            return ".".join(parts[: i + 1])
        node = node[part]
    return None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else str(text)


def describe_flag_error(error: BaseException, argv: Sequence[str], config: Any, fv: Any) -> str:
    """One line for a failure to parse ``argv`` (an unknown field is named with its
    closest match, an unknown flag with the nearest flag)."""
    if isinstance(error, (AttributeError, KeyError)) and config is not None:
        for path, _ in _overrides(argv):
            missing = _missing_field(config, path)
            if missing is None:
                continue
            close = closest_field(config, missing)
            hint = f"; did you mean config.{close}?" if close else ""
            return (
                f"config.{missing} is not a field of this config{hint} (list the fields "
                "with --print_config)"
            )
    if isinstance(error, flags.UnrecognizedFlagError):
        name = (
            getattr(error, "flagname", "") or str(error).split("'")[1 if "'" in str(error) else 0]
        )
        close = difflib.get_close_matches(name, list(fv), n=1)  # type: ignore[assignment]
        hint = f"; did you mean --{close[0]}?" if close else ""
        return f"unknown flag --{name}{hint} (see --help)"
    return _last_line(str(error))


def _print_help(prog: str, aliases: Mapping[str, str], stream: TextIO) -> None:
    fv = flags.FlagValues()
    _define_flags(fv, [prog], aliases)
    stream.write(HELP.format(prog=prog) + "\nAll flags:\n")
    stream.write(fv.get_help(include_special_flags=False) + "\n")


def _define_flags(fv: Any, argv: Sequence[str], aliases: Mapping[str, str]) -> None:
    _define_config(fv, argv)
    flags.DEFINE_string(
        "output_dir",
        None,
        "Run directory (default: config.output_dir or runs/<name>-<time>); a run there is "
        "resumed when its config matches.",
        flag_values=fv,
    )
    # The flax examples' and big_vision's name for it.
    flags.DEFINE_alias("workdir", "output_dir", flag_values=fv)
    for name, what in (
        ("list_presets", "List the presets the --config file accepts, exit."),
        ("print_config", "Print the resolved config, check it, exit."),
        ("dry_run", "Check the config and the run directory, say what would run, exit."),
    ):
        flags.DEFINE_bool(name, False, what, flag_values=fv)
    for name, what in (
        ("coordinator_address", "Multi-process: host:port of process 0 (or SBM_COORDINATOR)."),
        ("num_processes", "Multi-process: number of processes (or SBM_NUM_PROCESSES)."),
        ("process_id", "Multi-process: this process's id (or SBM_PROCESS_ID)."),
    ):
        define = flags.DEFINE_string if name == "coordinator_address" else flags.DEFINE_integer
        define(name, None, what, flag_values=fv)  # type: ignore[operator]
    for flag, field in aliases.items():  # an alias command's own flags (glue.pretrain)
        flags.DEFINE_string(flag, None, f"Sets config.{field}.", flag_values=fv)


def console_main() -> None:
    """The ``sbm-train`` console command: ``scripts/train.py`` of an installed package."""
    run(task_modules=DEFAULT_TASK_MODULES)


def unavailable_task_note(config: Any, skipped: Mapping[str, str]) -> str | None:
    """For a ``config.task.name`` that no imported module registered while some task
    modules were skipped: one message naming them and what they lack."""
    from sbm_jax.tasks import available_tasks

    task = config.get("task") if hasattr(config, "get") else None
    name = task.get("name") if hasattr(task, "get") else None  # type: ignore[union-attr]
    if not skipped or name in available_tasks():
        return None
    reasons = ", ".join(f"{m} ({why})" for m, why in skipped.items())
    return (
        f"task.name={name!r} is not a known task; the task modules {reasons} could not "
        "be imported: install what they need to train their tasks"
    )


def check_config(config: Any) -> list[str]:
    """Every problem of ``config`` that can be found without data: the sections
    (``config_errors``), the task's fields, ``init_from`` and the mesh."""
    from sbm_jax.tasks import task_config_errors
    from sbm_jax.training.checkpoints import find_checkpoint
    from sbm_jax.training.sharding import mesh_from_config

    errors = config_errors(config)
    errors = without_repeats(errors, task_config_errors(config))
    if config.get("init_from"):
        try:
            find_checkpoint(str(config.init_from))
        except FileNotFoundError as e:
            errors.append(str(e))
    if not any(e.startswith(("mesh.", "config.mesh.")) for e in errors):
        try:
            mesh_from_config(config)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def parse_config(
    argv: Sequence[str], fv: Any | None = None, aliases: Mapping[str, str] | None = None
) -> ml_collections.ConfigDict:
    """The config ``argv`` (the trainer's command line, program name first) asks for:
    the ``--config`` file and preset with its ``--config.<field>`` overrides, parsed by
    config_flags into ``fv`` (fresh flag values by default), then the ``aliases``
    (``{flag: "section.field"}``) set. Task modules must be imported first for their
    fields' checks. Every user error raises ``ConfigError`` with the one line ``main``
    prints."""
    fv = flags.FlagValues() if fv is None else fv
    aliases = dict(aliases or {})
    if not config_spec(argv):
        raise ConfigError(
            "--config is required, e.g. --config=configs/synthetic.py:quick (see --help)"
        )
    try:
        _define_flags(fv, argv, aliases)
        rest = fv(list(argv))
    except _SpecError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:
        loaded = getattr(fv["config"].parser, "loaded", None) if "config" in fv else None
        raise ConfigError(describe_flag_error(e, argv, loaded, fv)) from None
    if len(rest) > 1:
        raise ConfigError(f"unexpected arguments {rest[1:]} (see --help)")
    config: Any = fv["config"].value
    for flag, field in aliases.items():
        if fv[flag].value is not None:
            try:
                config.update_from_flattened_dict({field: fv[flag].value})
            except (KeyError, AttributeError, TypeError, ValueError) as e:
                raise ConfigError(f"--{flag}: config.{field}: {_last_line(str(e))}") from None
    return config


def _start_processes(fv: Any) -> None:
    """Connect the processes of a multi-process job (``distributed.py``)."""
    from sbm_jax.training.distributed import DistributedConfigError, maybe_initialize_distributed

    try:
        maybe_initialize_distributed(fv.coordinator_address, fv.num_processes, fv.process_id)
    except DistributedConfigError as e:
        raise ConfigError(str(e)) from None


def _check_step_size(config: Any, dry_run: bool) -> dict[str, float] | str:
    """The compiled step's size, always with ``--dry_run`` and before a large run does
    any work: one that cannot fit the device is refused here, not after minutes of
    compile. Returns the estimate, or why there is none."""
    if not dry_run and step_size.attention_pairs(config) <= step_size.LARGE_STEP_PAIRS:
        return "not asked"
    too_big = step_size.host_batch_error(config, step_size.host_memory())
    if too_big is not None:
        raise ConfigError(too_big)
    estimate = step_size.step_estimate(config)
    if not isinstance(estimate, str):
        too_big = step_size.size_error(config, estimate)
        if too_big is not None:
            raise ConfigError(too_big)
    return estimate


def _say_step_size(
    config: Any, estimate: dict[str, float] | str, dry_run: bool, out: TextIO
) -> None:
    if dry_run and isinstance(estimate, str):
        out.write(f"compiled train step: no estimate ({estimate})\n")
    elif not isinstance(estimate, str):
        out.write(
            f"{'compiled train step' if dry_run else 'note: one train step'}: "
            f"{step_size.describe_estimate(estimate)}; attention scores "
            f"{step_size.attention_pairs(config):.3g} query-key pairs per step (batch x heads "
            "x layers x length^2)\n"
        )
    out.flush()


def main(
    argv: Sequence[str],
    task_modules: Sequence[str] = (),
    aliases: Mapping[str, str] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run the trainer's command line; returns the exit status.

    Args:
      argv: the command line, program name first.
      task_modules: modules to import so that their tasks register (e.g. "lra.train_task");
        one that needs a package that is not installed is skipped, and only its tasks
        are unavailable (``import_task_modules``).
      aliases: ``{flag: "section.field"}``, flags of an alias command that set a config
        field (``glue.pretrain``'s ``--corpus``: ``data.corpus``).
      stdout, stderr: where the summary line and errors go (default sys's).
    """
    out, err = stdout or sys.stdout, stderr or sys.stderr
    argv, aliases = list(argv), dict(aliases or {})
    fail = functools.partial(_fail, err)
    if any(a in ("--help", "-h", "--helpfull", "-help") for a in argv[1:]):
        _print_help(os.path.basename(argv[0]) if argv else "train.py", aliases, out)
        return 0
    skipped = import_task_modules(task_modules)
    fv = flags.FlagValues()
    try:
        if "--list_presets" in argv[1:]:
            spec = config_spec(argv)
            if not spec:
                raise ConfigError(
                    "--list_presets needs --config=CONFIG.py (e.g. configs/synthetic.py)"
                )
            out.write(list_presets(spec))
            return 0
        config = parse_config(argv, fv, aliases)
        _start_processes(fv)
        errors = check_config(config)
        note = unavailable_task_note(config, skipped)
        if note is not None:
            errors = [note] + [e for e in errors if not e.startswith("task.name=")]
        if errors:  # alone: after a screen of config, the line would scroll out of sight
            raise ConfigError(one_line(errors, config))
    except ConfigError as e:
        return fail(str(e))
    import jax

    primary = jax.process_index() == 0
    if fv.print_config:
        if primary:
            out.write(str(config))
            out.flush()
        return 0
    try:
        folder = check_run_folder(config, fv.output_dir)
        estimate = _check_step_size(config, fv.dry_run)
    except ConfigError as e:
        return fail(_folder_error(e, config, fv.output_dir))
    if fv.dry_run and primary:  # after every check: an error comes alone
        out.write(str(config))
    if primary:
        _say_step_size(config, estimate, fv.dry_run, out)
    if fv.dry_run:
        what = "resume the run in" if folder.resuming else "train a new run in"
        out.write(f"config OK; would {what} {folder.path}\n")
        return 0
    return _train(config, folder, fv.output_dir, out, err, redirect=stdout is not None)


def _fail(err: TextIO, message: str, status: int = USAGE_EXIT) -> int:
    err.write(f"error: {' '.join(str(message).split())}\n")
    err.flush()
    return status


def _folder_error(e: ConfigError, config: Any, output_dir_flag: str | None) -> str:
    # Messages about the run folder start "output_dir=": name what the user set.
    if output_dir_flag and str(e).startswith("output_dir="):
        return "--" + " ".join(str(e).split())
    return one_line([str(e)], config)


def _train(
    config: Any,
    folder: RunFolder,
    output_dir_flag: str | None,
    out: TextIO,
    err: TextIO,
    redirect: bool,
) -> int:
    """Build the task (data is read or generated only now) and train into ``folder``;
    every way a run ends as its exit status (see the module docstring)."""
    from sbm_jax.tasks import build_task
    from sbm_jax.training import trainer
    from sbm_jax.training.checkpoints import CheckpointError
    from sbm_jax.training.errors import NoSpaceError, is_no_space
    from sbm_jax.training.nonfinite import NonFiniteError
    from sbm_jax.training.summary import format_summary

    given = copy.deepcopy(config)
    # The run's own lines (the tasks' notes, "resuming from step N", warnings) go to
    # ``stdout`` like the summary line.
    quiet = contextlib.redirect_stdout(out) if redirect else contextlib.nullcontext()
    try:
        with quiet:
            try:
                task = build_task(config, output_dir=folder.path)
            except (ValueError, FileNotFoundError) as e:
                return _fail(err, one_line([str(e)], config))
            summary = trainer.train_and_evaluate(config, task, output_dir=folder, run_config=given)
    except ConfigError as e:
        return _fail(err, _folder_error(e, config, output_dir_flag))
    except CheckpointError as e:
        return _fail(err, str(e))
    except NonFiniteError as e:
        return _fail(err, str(e), NONFINITE_EXIT)
    except KeyboardInterrupt:
        err.write("interrupted\n")
        return INTERRUPTED_EXIT
    except Exception as e:
        if isinstance(e, NoSpaceError):
            return _fail(err, f"{e}; free space and run the same command to resume", NO_SPACE_EXIT)
        if is_no_space(e):
            return _fail(
                err,
                f"no space left on the device holding {folder.path} (writing the run's "
                "records; they end at the last whole line); free space and run the same "
                "command to resume",
                NO_SPACE_EXIT,
            )
        raise
    import jax

    if jax.process_index() == 0:
        out.write(format_summary(summary) + "\n")
        out.flush()
    return STOPPED_EXIT if "stopped_at" in summary else 0


def run(argv: Sequence[str] | None = None, **kwargs: Any) -> None:
    """``sys.exit(main(argv or sys.argv))`` (tracebacks only for bugs, not user errors)."""
    try:
        status = main(list(sys.argv if argv is None else argv), **kwargs)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        status = 1
    if status == NO_SPACE_EXIT:
        # The one line is out; what a failed write's background threads (orbax,
        # TensorStore, asyncio) print at exit would bury it.
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    sys.exit(status)
