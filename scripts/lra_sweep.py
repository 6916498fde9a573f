"""Run a grid of LRA trainings: tasks x mechanisms x lambdas x seeds, one run each.

  python scripts/lra_sweep.py --tasks=listops,image --mechanisms=sbm,full --seeds=0,1 \
      --scale=paper --root=runs/lra --dry_run
  python scripts/lra_sweep.py --tasks=listops --mechanisms=sbm --lambdas=0,1e-3,1e-2,1e-1

Each run is ``scripts/train.py --config=configs/lra/<task>.py:<mechanism>,<scale>,
lambda=<x>,seed=<s> --output_dir=<root>/<task>/<mechanism>_lambda<x>_seed<s>`` plus the
``--override`` flags, in a subprocess (one at a time; a failed run is reported and the
sweep goes on). Lambdas other than 0 apply to SBM only (other mechanisms sow no
differentiable density), so they run once per seed at lambda 0.

Every run's config is resolved first (the same parsing as ``train.py``), so a bad
mechanism, preset or override stops the sweep in one line before anything starts. A
run is skipped as done only when its directory holds summary.json *and* its
config.json equals the config this sweep asks for: a sweep at another ``--scale`` or
with other overrides on the same root starts the trainer, which extends the run where
the change is safe (``train.num_steps``, ...) and otherwise refuses in one line naming
the fields, so a finished run of one config is never reported as a run of another. An
interrupted run resumes from its checkpoint; a trainer stopped by a signal (exit 75,
no summary.json) counts as unfinished, not failed. SIGINT / SIGTERM / SIGHUP to
the sweep are passed to the running trainer (it saves its latest checkpoint), the sweep
waits for it and stops; rerunning the command resumes. ``--dry_run`` prints what it
would do instead. Summaries go to ``lra_report.py``.

Paths: ``--root`` is made absolute (relative to the directory the sweep is started
from) before anything else, and every run directory, log and "done" check lives under
it; runs start in that same directory, so the sweep behaves the same from anywhere.
User errors are one line ``error: ...`` and exit status 2.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from typing import Any

from absl import flags

from sbm_jax import script_usage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ("listops", "text", "retrieval", "image", "pathfinder")
#: The trainer's exit status for a run a signal stopped after saving
#: (``sbm_jax.training.cli.STOPPED_EXIT``; not imported, which would load JAX here).
STOPPED_EXIT = 75

_TASKS = flags.DEFINE_list("tasks", list(TASKS), "LRA tasks.")
_MECHANISMS = flags.DEFINE_list("mechanisms", ["sbm", "full"], "Attention mechanisms.")
_LAMBDAS = flags.DEFINE_list("lambdas", ["0"], "Density regulariser weights (SBM only).")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "Seeds.")
_SCALE = flags.DEFINE_enum("scale", "paper", ["paper", "reduced", "smoke"], "Config scale.")
_ROOT = flags.DEFINE_string("root", "runs/lra", "Parent directory of the run directories.")
_OVERRIDES = flags.DEFINE_multi_string(
    "override", [], "Extra flags for every run, e.g. --override=--config.train.num_steps=100."
)
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the commands, run nothing.")


UsageError = script_usage.UsageError


def run_dir(root: str, task: str, mechanism: str, lam: float, seed: int) -> str:
    """``<root>/<task>/<mechanism>_lambda<lam>_seed<seed>``, absolute."""
    root = os.path.abspath(os.path.expanduser(root))
    return os.path.join(root, task, f"{mechanism}_lambda{lam:g}_seed{seed}")


def commands(
    tasks: list[str],
    mechanisms: list[str],
    lambdas: list[float],
    seeds: list[int],
    scale: str,
    root: str,
    overrides: list[str],
) -> list[tuple[str, list[str]]]:
    """(run directory, argv) for every run of the grid."""
    for task in tasks:
        if task not in TASKS:
            raise UsageError(f"--tasks: unknown task {task!r}; choose from {', '.join(TASKS)}")
    out = []
    for task in tasks:
        for mechanism in mechanisms:
            for lam in lambdas if mechanism == "sbm" else [0.0]:
                for seed in seeds:
                    directory = run_dir(root, task, mechanism, lam, seed)
                    preset = f"{mechanism},{scale},lambda={lam:g},seed={seed}"
                    argv = [
                        sys.executable,
                        os.path.join(ROOT, "scripts", "train.py"),
                        f"--config={os.path.join(ROOT, 'configs', 'lra', task + '.py')}:{preset}",
                        f"--output_dir={directory}",
                        *overrides,
                    ]
                    out.append((directory, argv))
    return out


def requested_config(argv: list[str]) -> dict[str, Any]:
    """The config (as ``config.json`` stores it) that ``argv``, a run's ``train.py``
    command, asks for; a user error raises ``UsageError`` with train.py's message."""
    from sbm_jax.training.cli import parse_config
    from sbm_jax.training.config_checks import ConfigError
    from sbm_jax.training.run_dir import config_as_json

    try:
        return config_as_json(parse_config(["train.py", *argv[2:]]))
    except ConfigError as e:
        raise UsageError(" ".join(str(e).split())) from None


def finished_differently(directory: str, wanted: dict[str, Any]) -> list[str] | None:
    """None if ``directory`` holds no finished run; else the fields in which the finished
    run's config differs from ``wanted`` ([] when it is this run)."""
    from sbm_jax.training.run_dir import config_differences, saved_config

    if not os.path.exists(os.path.join(directory, "summary.json")):
        return None
    saved = saved_config(directory)
    if saved is None:
        return ["config.json (missing)"]
    return config_differences(saved, wanted, safe=())


def _unique(values: list[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


class _Forward:
    """While a trainer runs: SIGINT, SIGTERM and SIGHUP to the sweep go to the trainer
    (its own process group, so a Ctrl-C reaches it once, through here), and the sweep
    remembers to stop after it."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")

    def __init__(self) -> None:
        self.child: subprocess.Popen | None = None
        self.received: str | None = None
        for name in self.SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = self.received or signal.Signals(signum).name
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)  # a second one stops the trainer at once


def _last_error(log_path: str) -> str | None:
    """The last ``error: ...`` line of a run's log (train.py's one-line reason)."""
    try:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.startswith("error: ")]
    except OSError:
        return None
    return lines[-1] if lines else None


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments: {argv[1:]}")
    try:
        lambdas = [float(x) for x in _LAMBDAS.value]
        seeds = [int(x) for x in _SEEDS.value]
    except ValueError as e:
        raise UsageError(f"--lambdas / --seeds: {e}") from None
    if not _TASKS.value or not _MECHANISMS.value or not seeds or not lambdas:
        raise UsageError("--tasks, --mechanisms, --seeds and --lambdas must each name one or more")
    runs = commands(
        _unique(_TASKS.value),
        _unique(_MECHANISMS.value),
        sorted(set(lambdas)),
        _unique(seeds),
        _SCALE.value,
        os.path.abspath(os.path.expanduser(_ROOT.value)),
        _OVERRIDES.value,
    )
    # Every run's config first: a bad mechanism or override stops here, not mid-sweep.
    wanted = {directory: requested_config(cmd) for directory, cmd in runs}
    forward = None if _DRY_RUN.value else _Forward()
    failed, unfinished = [], []
    for directory, cmd in runs:
        line = shlex.join(cmd)
        # Checked before --dry_run, so that a dry run lists exactly what a real one runs.
        differs = finished_differently(directory, wanted[directory])
        if differs == []:
            print(f"skip (done): {directory}", flush=True)
            continue
        if differs:
            shown = "; ".join(differs[:3]) + ("; ..." if len(differs) > 3 else "")
            print(f"finished with another config ({shown}): the trainer decides", flush=True)
        if _DRY_RUN.value:
            print(line)
            continue
        print(f"run: {line}", flush=True)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "train.log"), "a", encoding="utf-8") as log:
            forward.child = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            code = forward.child.wait()
            forward.child = None
        done = os.path.exists(os.path.join(directory, "summary.json"))
        # The trainer exits 75 when a signal stopped it after saving (0 before it did).
        if code in (0, STOPPED_EXIT) and not done:
            print(f"  stopped before the end -> {directory}", flush=True)
            unfinished.append(directory)
        else:
            print(f"  exit {code} -> {directory}", flush=True)
        if code and code != STOPPED_EXIT:
            failed.append(directory)
            reason = _last_error(os.path.join(directory, "train.log"))
            if reason:
                print(f"  {reason}", flush=True)
        if forward.received:
            print(
                f"sweep stopped by {forward.received}; the same command resumes it",
                file=sys.stderr,
                flush=True,
            )
            sys.exit(128 + getattr(signal, forward.received))
    if unfinished:
        print(f"{len(unfinished)} run(s) unfinished: {unfinished}", file=sys.stderr)
    if failed:
        print(f"{len(failed)} run(s) failed (see their train.log): {failed}", file=sys.stderr)
    if failed or unfinished:
        sys.exit(1)


if __name__ == "__main__":
    script_usage.run(main)
