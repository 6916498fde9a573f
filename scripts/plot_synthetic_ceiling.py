"""Accuracy against sampled density for synthetic-task runs, over the task's ceiling.

  python scripts/plot_synthetic_ceiling.py runs/synthetic_sbm_quick-* --seq_len=64 \\
      --out=docs/synthetic_ceiling.png

Each run's logged (density, accuracy) pairs are drawn as a trajectory (smoothed over
``--smooth`` logged steps, so the training noise of single batches does not hide the
path), over :func:`sbm_jax.tasks.synthetic.accuracy_ceiling`: the best accuracy any
model can reach when it sees each other token with probability ``density``. No run can
sit above the curve for long; a run below ``density ~ 0.3`` cannot beat the all-ones
guess, whatever its attention learns.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from sbm_jax import script_usage  # noqa: E402
from sbm_jax.script_usage import UsageError  # noqa: E402
from sbm_jax.tasks.synthetic import accuracy_ceiling  # noqa: E402
from sbm_jax.training.plots import (  # noqa: E402
    MetricsFileError,
    load_metrics_csv,
    moving_average,
)

_OUT = flags.DEFINE_string(
    "out",
    "synthetic_ceiling.png",
    "Image file to write (.png added when it has no extension); its folder must exist.",
)
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len", 64, "N of the runs (the ceiling depends on it).", lower_bound=2
)
_SMOOTH = flags.DEFINE_integer(
    "smooth", 20, "Moving average over this many logged steps.", lower_bound=1
)
_TITLE = flags.DEFINE_string("title", None, "Figure title.")


def main(argv: list[str]) -> None:
    runs = argv[1:]
    if not runs:
        raise UsageError("give one or more run directories or metrics.csv files")
    out = script_usage.image_file("out", _OUT.value)
    curves = []  # every file read and checked before anything is drawn
    for run in runs:
        path = os.path.join(run, "metrics.csv") if os.path.isdir(run) else run
        if not os.path.exists(path):
            raise UsageError(f"{path} does not exist")
        try:
            curves.append((path, load_metrics_csv(path, ("density", "accuracy"))))
        except MetricsFileError as err:
            raise UsageError(str(err)) from None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    grid = [i / 200 for i in range(201)]
    ceiling = [accuracy_ceiling(_SEQ_LEN.value, r) for r in grid]
    ax.plot(grid, ceiling, color="black", linewidth=2, label=f"ceiling (N={_SEQ_LEN.value})")
    for path, data in curves:
        density = moving_average(data["density"], _SMOOTH.value)
        accuracy = moving_average(data["accuracy"], _SMOOTH.value)
        label = os.path.basename(os.path.normpath(os.path.dirname(path)))
        (line,) = ax.plot(density, accuracy, linewidth=1.0, alpha=0.8, label=label)
        ax.plot(density[-1:], accuracy[-1:], "o", color=line.get_color())
    ax.set_xlabel("sampled density (train, exploration included)")
    ax.set_ylabel("token accuracy (train batch)")
    ax.set_xlim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    if _TITLE.value:
        ax.set_title(_TITLE.value)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    script_usage.run(main)
