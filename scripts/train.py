"""Train a model on a task named by its config.

  python scripts/train.py --config=configs/synthetic.py:quick
  python scripts/train.py --config=configs/synthetic.py:full --config.train.num_steps=500 \
      --output_dir=runs/full500

Writes metrics.jsonl, metrics.csv (step, loss, accuracy, density), metrics.png,
config.json and summary.json into the output directory (default
runs/<config.name>-<timestamp>) and prints a one-line summary.

Exit status (configs with a ``checkpoint`` section, i.e. the full trainer): 0 when the
run finished, or when SIGTERM / SIGINT stopped it after saving the latest checkpoint
(the printed line says "stopped at step N (SIGTERM)"; the same command resumes it);
3 when a non-finite loss or gradient halted it (the message names the step and the
saved state, batch and info for ``replay_nonfinite``).
"""

from __future__ import annotations

import os
import sys

# Run from a checkout without installing: make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

# Task packages outside the library register their tasks when imported; LRA and GLUE
# add one import line each here.
import lra.train_task  # noqa: E402, F401  (registers lra_listops, lra_text, ... lra_pathfinder)
import sbm_jax.tasks as tasks  # noqa: E402  (registers the built-in "synthetic" task)
from sbm_jax.training import format_summary, run_training  # noqa: E402
from sbm_jax.training.distributed import maybe_initialize_distributed  # noqa: E402
from sbm_jax.training.trainer import (  # noqa: E402
    NonFiniteError,
    format_run_summary,
    train_and_evaluate,
)

NONFINITE_EXIT_CODE = 3

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (path.py:preset).", lock_config=True
)
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", None, "Output directory (default: config.output_dir or runs/<name>-<time>)."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-process: host:port of process 0 (or SBM_COORDINATOR)."
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Multi-process: number of processes (or SBM_NUM_PROCESSES)."
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "Multi-process: this process's id (or SBM_PROCESS_ID)."
)


def run(config: ml_collections.ConfigDict, output_dir: str | None = None) -> dict:
    """Build the task named by ``config.task.name``, train, print and return the summary."""
    task = tasks.build_task(config)
    if "checkpoint" in config:
        # Configs with a checkpoint section (LRA, GLUE) get the full trainer: dev evals,
        # best/latest checkpoints, resume, test at the best checkpoint.
        summary = train_and_evaluate(config, task, output_dir=output_dir)
        print(format_run_summary(summary), flush=True)
        return summary
    summary = run_training(config, task, output_dir=output_dir)
    print(format_summary(summary), flush=True)
    return summary


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if _CONFIG.value is None:
        raise app.UsageError("--config is required, e.g. --config=configs/synthetic.py:quick")
    # No-op for one process; automatic on multi-host TPU slices and Slurm.
    maybe_initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    try:
        run(_CONFIG.value, _OUTPUT_DIR.value)
    except NonFiniteError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(NONFINITE_EXIT_CODE)


if __name__ == "__main__":
    app.run(main)
