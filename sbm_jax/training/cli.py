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

Any option of the configured attention mechanism may be set with
``--config.model.attention_options.<option>=...`` even when the preset does not list
it (it then starts from the mechanism's default), e.g.
``--config.model.attention_options.capacity_buckets='(0.01, 0.05, 0.25)'``.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import ml_collections
from absl import flags
from ml_collections import config_flags

from sbm_jax.tasks.registry import DEFAULT_TASK_MODULES, import_task_modules
from sbm_jax.training.config_checks import (
    ConfigError,
    closest_field,
    config_errors,
    one_line,
    without_repeats,
)

USAGE_EXIT = 2
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


def _split_spec(spec: str) -> tuple[str, str | None]:
    """``"configs/x.py:sbm,smoke"`` -> ("configs/x.py", "sbm,smoke"); a preset named
    without ``.py`` splits at its first colon: ``"lra/listops:sbm"`` -> ("lra/listops",
    "sbm")."""
    index = spec.find(".py:")
    if index >= 0:
        return spec[: index + 3], spec[index + 4 :]
    if not spec.endswith(".py") and ":" in spec:
        path, arg = spec.split(":", 1)
        return path, arg
    return spec, None


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


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """``get_config(preset)`` of the config file ``spec`` = ``path.py[:preset]``.

    Raises:
      ConfigError naming ``--config`` for a missing file, a file without ``get_config``
      or a preset its ``get_config`` rejects.
    """
    given, arg = _split_spec(spec)
    path = resolve_config_path(given)
    if path is None:
        raise ConfigError(
            f"--config={spec}: no such file {given!r}, and no preset of that name in the "
            "configs package (e.g. synthetic, lra/listops, glue/pretrain)"
        )
    name = "sbm_config_" + os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"--config={spec}: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    get_config = getattr(module, "get_config", None)
    if get_config is None:
        raise ConfigError(f"--config={spec}: {path!r} has no get_config()")
    try:
        return get_config(arg) if arg is not None else get_config()
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"--config={spec}: {e}") from None


def list_presets(spec: str) -> str:
    """The presets the config file of ``spec`` accepts, as ``--list_presets`` prints
    them (read from its ``get_config``'s call of ``configs.presets.parse_preset``).

    Raises:
      ConfigError: naming ``--config`` for a missing file or one that does not parse
        its preset with ``parse_preset``.
    """
    given, _ = _split_spec(spec)
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
    """One line for a failure to parse ``argv``."""
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


def _print_help(prog: str, fv: Any, stream: TextIO) -> None:
    stream.write(HELP.format(prog=prog) + "\nAll flags:\n")
    stream.write(fv.get_help(include_special_flags=False) + "\n")


def _define_flags(fv: Any, config: Any, argv: Sequence[str]) -> None:
    if config is not None:
        config_flags.DEFINE_config_dict(
            "config",
            config,
            "The config (--config=path.py:preset).",
            flag_values=fv,
            lock_config=True,
            sys_argv=list(argv),
        )
    else:
        flags.DEFINE_string("config", None, "Config file (path.py:preset).", flag_values=fv)
    flags.DEFINE_string(
        "output_dir",
        None,
        "Run directory (default: config.output_dir or runs/<name>-<time>); a run there is "
        "resumed when its config matches.",
        flag_values=fv,
    )
    # The flax examples' and big_vision's name for it.
    flags.DEFINE_alias("workdir", "output_dir", flag_values=fv)
    flags.DEFINE_bool(
        "list_presets", False, "List the presets the --config file accepts, exit.", flag_values=fv
    )
    flags.DEFINE_bool(
        "print_config", False, "Print the resolved config, check it, exit.", flag_values=fv
    )
    flags.DEFINE_bool(
        "dry_run",
        False,
        "Check the config and the run directory, say what would run, exit.",
        flag_values=fv,
    )
    flags.DEFINE_string(
        "coordinator_address",
        None,
        "Multi-process: host:port of process 0 (or SBM_COORDINATOR).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "num_processes",
        None,
        "Multi-process: number of processes (or SBM_NUM_PROCESSES).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "process_id", None, "Multi-process: this process's id (or SBM_PROCESS_ID).", flag_values=fv
    )


def _config_spec(argv: Sequence[str]) -> str | None:
    for i, arg in enumerate(argv):
        for prefix in ("--config=", "-config="):
            if arg.startswith(prefix):
                return arg[len(prefix) :]
        if arg in ("--config", "-config") and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _without_config_spec(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.startswith(("--config=", "-config=")):
            continue
        if arg in ("--config", "-config"):
            skip = True
            continue
        out.append(arg)
    return out


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


#: Query-key pairs per step (batch x heads x layers x length^2) above which a run has
#: its train step compiled on abstract state before any work, to refuse one that cannot
#: fit in memory (``--dry_run`` always does it): far above any test or CPU preset.
LARGE_STEP_PAIRS = 2**34


def _length(config: Any) -> tuple[str, int]:
    """The field that sets the sequence length, and the longest input length."""
    task, model = config.get("task") or {}, config.model
    for name in ("seq_len", "max_length", "max_seq_length"):
        value = task.get(name) if hasattr(task, "get") else None
        if isinstance(value, int) and not isinstance(value, bool):
            return f"task.{name}", int(model.get("max_len") or value)
    return "model.max_len", int(model.get("max_len") or 0)


def attention_pairs(config: Any) -> int:
    """Query-key pairs one training step scores: batch x heads x layers x length^2."""
    model = config.model
    _, length = _length(config)
    return (
        int(config.train.batch_size)
        * int(model.get("num_heads") or 1)
        * int(model.get("num_layers") or 1)
        * length
        * length
    )


def step_estimate(config: Any) -> dict[str, float] | str:
    """XLA's memory / FLOPs estimate of the compiled train step, or why there is none
    (the data is not prepared yet, the task cannot be built without writing)."""
    from sbm_jax.tasks import build_task
    from sbm_jax.training.task import may_prepare_data
    from sbm_jax.training.trainer import compiled_step_estimate

    token = may_prepare_data.set(False)
    try:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            task = build_task(copy.deepcopy(config))
            return compiled_step_estimate(copy.deepcopy(config), task)
    except (FileNotFoundError, ValueError, ImportError, OSError) as e:
        return f"the task cannot be built without preparing its data: {_last_line(str(e))}"
    finally:
        may_prepare_data.reset(token)


def host_memory() -> float:
    """This host's physical memory in bytes; 0 when unknown."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def describe_estimate(estimate: Mapping[str, float]) -> str:
    """``"0.1 GiB per device (of 24 GiB), 3.2 GFLOPs per step (XLA's estimates)"``."""
    device = estimate.get("device_bytes") or 0
    of = f" (of {_gib(device)})" if device else ""
    flops = estimate.get("flops") or 0
    work = f", {flops / 1e9:.3g} GFLOPs per step" if flops else ""
    # XLA counts a loop's body once: the streamed attention's FLOPs are a lower bound.
    return (
        f"{_gib(estimate['memory_bytes'])} per device{of}{work} (XLA's estimates; FLOPs "
        "inside loops counted once)"
    )


#: Bytes per token of a host batch, at least: int32 ids and a bool mask.
HOST_BYTES_PER_TOKEN = 5


def host_batch_error(config: Any, host_bytes: float) -> str | None:
    """One line when a single host batch (ids and mask alone) cannot fit in the host's
    memory: the step estimate builds one such batch, so it is checked first."""
    field, length = _length(config)
    need = int(config.train.batch_size) * length * HOST_BYTES_PER_TOKEN
    if not host_bytes or need <= host_bytes:
        return None
    return (
        f"config.train.batch_size={config.train.batch_size} with config.{field}={length}: one "
        f"host batch needs at least {_gib(need)} (ids and mask), more than this host's "
        f"{_gib(host_bytes)}; lower the batch"
    )


def size_error(config: Any, estimate: Mapping[str, float]) -> str | None:
    """One line when the compiled step needs more memory than the device has."""
    need, have = estimate["memory_bytes"], estimate.get("device_bytes") or 0
    if not have or need <= have:
        return None
    field, length = _length(config)
    return (
        f"config.{field}={length} with config.train.batch_size={config.train.batch_size}: one "
        f"training step needs about {_gib(need)} per device (XLA's estimate of the compiled "
        f"step), more than the {_gib(have)} this machine's device has; shorten the sequence, "
        "lower the batch (or set train.max_per_device_batch), or use model.remat=True"
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
    argv: Sequence[str],
    fv: Any | None = None,
    define_extra: Callable[[Any], None] | None = None,
) -> ml_collections.ConfigDict:
    """The config ``argv`` (the trainer's command line, program name first) asks for:
    the ``--config`` file and preset with its ``--config.<field>`` overrides, parsed into
    ``fv`` (fresh flag values by default). Task modules must be imported first for
    their fields' checks. Every user error raises ``ConfigError`` with the one line
    ``main`` prints."""
    fv = flags.FlagValues() if fv is None else fv
    spec = _config_spec(argv)
    if not spec:
        raise ConfigError(
            "--config is required, e.g. --config=configs/synthetic.py:quick (see --help)"
        )
    try:
        config = load_config_file(spec)
    except ConfigError:
        raise
    except Exception as e:  # the config file itself raised
        raise ConfigError(f"--config={spec}: {type(e).__name__}: {_last_line(str(e))}") from None
    if not isinstance(config, ml_collections.ConfigDict):
        raise ConfigError(
            f"--config={spec}: get_config() returned {type(config).__name__}, not a ConfigDict"
        )
    _add_attention_options(config, argv)
    parse_argv = _without_config_spec(argv)
    try:
        # Defining the config flag already applies the --config.<field> overrides.
        _define_flags(fv, config, parse_argv)
        if define_extra is not None:
            define_extra(fv)
        rest = fv(parse_argv)
    except Exception as e:
        raise ConfigError(describe_flag_error(e, parse_argv, config, fv)) from None
    if len(rest) > 1:
        raise ConfigError(f"unexpected arguments {rest[1:]} (see --help)")
    return fv["config"].value


def main(
    argv: Sequence[str],
    task_modules: Sequence[str] = (),
    adjust: Callable[[Any, Any], None] | None = None,
    define_extra: Callable[[Any], None] | None = None,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run the trainer's command line; returns the exit status.

    Args:
      argv: the command line, program name first.
      task_modules: modules to import so that their tasks register (e.g. "lra.train_task");
        one that needs a package that is not installed is skipped, and only its tasks
        are unavailable (``import_task_modules``).
      adjust: ``(config, flag values) -> None`` applied after parsing (for aliases that
        map their own flags onto config fields).
      define_extra: ``flag values -> None`` defining those aliases' extra flags.
      stdout, stderr: where the summary line and errors go (default sys's).
    """
    out = stdout or sys.stdout
    err = stderr or sys.stderr
    prog = os.path.basename(argv[0]) if argv else "train.py"

    def fail(message: str, status: int = USAGE_EXIT) -> int:
        err.write(f"error: {' '.join(str(message).split())}\n")
        err.flush()
        return status

    argv = list(argv)
    fv = flags.FlagValues()
    if any(a in ("--help", "-h", "--helpfull", "-help") for a in argv[1:]):
        _define_flags(fv, None, argv)
        if define_extra is not None:
            define_extra(fv)
        _print_help(prog, fv, out)
        return 0
    skipped = import_task_modules(task_modules)
    if "--list_presets" in argv[1:]:
        spec = _config_spec(argv)
        if not spec:
            return fail("--list_presets needs --config=CONFIG.py (e.g. configs/synthetic.py)")
        try:
            out.write(list_presets(spec))
        except ConfigError as e:
            return fail(str(e))
        return 0
    try:
        config = parse_config(argv, fv, define_extra)
    except ConfigError as e:
        return fail(str(e))
    if adjust is not None:
        try:
            adjust(config, fv)
        except (ConfigError, ValueError) as e:
            return fail(str(e))

    from sbm_jax.training.distributed import DistributedConfigError, maybe_initialize_distributed

    try:
        maybe_initialize_distributed(fv.coordinator_address, fv.num_processes, fv.process_id)
    except DistributedConfigError as e:
        return fail(str(e))
    import jax

    primary = jax.process_index() == 0
    errors = check_config(config)
    note = unavailable_task_note(config, skipped)
    if note is not None:
        errors = [note] + [e for e in errors if not e.startswith("task.name=")]
    if errors:  # alone: after a screen of config, the line would scroll out of sight
        return fail(one_line(errors, config))
    if fv.print_config and primary:
        out.write(str(config))
        out.flush()
    if fv.print_config:
        return 0

    from sbm_jax.tasks import build_task
    from sbm_jax.training.checkpoints import CheckpointError
    from sbm_jax.training.nonfinite import NonFiniteError
    from sbm_jax.training.run_dir import check_resume, resolve_output_dir
    from sbm_jax.training.summary import format_summary
    from sbm_jax.training.trainer import train_and_evaluate

    def config_error(e: ConfigError) -> str:
        # Messages about the run folder start "output_dir=": name what the user set.
        if fv.output_dir and str(e).startswith("output_dir="):
            return "--" + " ".join(str(e).split())
        return one_line([str(e)], config)

    try:
        output_dir = resolve_output_dir(config, fv.output_dir)
        resuming = check_resume(output_dir, config)
    except ConfigError as e:
        return fail(config_error(e))
    # The compiled step's size: always with --dry_run, and before a large run does any
    # work (one that cannot fit the device is refused here, not after minutes of compile).
    large = attention_pairs(config) > LARGE_STEP_PAIRS
    estimate: dict[str, float] | str = "not asked"
    if fv.dry_run or large:
        too_big = host_batch_error(config, host_memory())
        if too_big is not None:
            return fail(too_big)
        estimate = step_estimate(config)
        if not isinstance(estimate, str):
            too_big = size_error(config, estimate)
            if too_big is not None:
                return fail(too_big)
    if fv.dry_run and primary:  # after every check: an error comes alone
        out.write(str(config))
        if isinstance(estimate, str):
            out.write(f"compiled train step: no estimate ({estimate})\n")
    if (fv.dry_run or large) and primary and not isinstance(estimate, str):
        out.write(
            f"{'compiled train step' if fv.dry_run else 'note: one train step'}: "
            f"{describe_estimate(estimate)}; attention scores {attention_pairs(config):.3g} "
            "query-key pairs per step (batch x heads x layers x length^2)\n"
        )
        out.flush()
    if fv.dry_run:
        what = "resume the run in" if resuming else "train a new run in"
        out.write(f"config OK; would {what} {output_dir}\n")
        return 0
    given = copy.deepcopy(config)
    # The run's own lines (the tasks' notes, "resuming from step N", warnings) go to
    # ``stdout`` like the summary line.
    redirect = contextlib.redirect_stdout(out) if stdout is not None else contextlib.nullcontext()
    try:
        with redirect:
            try:
                task = build_task(config, output_dir=output_dir)
            except (ValueError, FileNotFoundError) as e:
                return fail(one_line([str(e)], config))
            summary = train_and_evaluate(config, task, output_dir=output_dir, run_config=given)
    except ConfigError as e:
        return fail(config_error(e))
    except CheckpointError as e:
        return fail(str(e))
    except NonFiniteError as e:
        return fail(str(e), NONFINITE_EXIT)
    except KeyboardInterrupt:
        err.write("interrupted\n")
        return INTERRUPTED_EXIT
    except Exception as e:
        from sbm_jax.training.errors import NoSpaceError, is_no_space

        if isinstance(e, NoSpaceError):
            return fail(f"{e}; free space and run the same command to resume", NO_SPACE_EXIT)
        if is_no_space(e):
            return fail(
                f"no space left on the device holding {output_dir} (writing the run's "
                "records; they end at the last whole line); free space and run the same "
                "command to resume",
                NO_SPACE_EXIT,
            )
        raise
    if primary:
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
