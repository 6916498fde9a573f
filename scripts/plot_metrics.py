"""Plot loss, accuracy and density vs step for one or more runs into one PNG.

  python scripts/plot_metrics.py runs/synthetic_sbm_quick-* runs/synthetic_full_quick-* \
      --out=synthetic.png

Each argument is a run directory (holding metrics.csv) or a metrics.csv file.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from sbm_jax import script_usage  # noqa: E402
from sbm_jax.script_usage import UsageError  # noqa: E402
from sbm_jax.training.plots import MetricsFileError, load_metrics_csv, plot_metrics  # noqa: E402

_OUT = flags.DEFINE_string(
    "out",
    "metrics.png",
    "Image file to write (.png added when it has no extension); its folder must exist.",
)
_TITLE = flags.DEFINE_string("title", None, "Figure title.")


def main(argv: list[str]) -> None:
    runs = argv[1:]
    if not runs:
        raise UsageError("give one or more run directories or metrics.csv files")
    out = script_usage.image_file("out", _OUT.value)
    paths, labels = [], []
    for run in runs:
        path = os.path.join(run, "metrics.csv") if os.path.isdir(run) else run
        if not os.path.exists(path):
            raise UsageError(f"{path} does not exist")
        try:
            load_metrics_csv(path, ("step",))
        except MetricsFileError as err:
            raise UsageError(str(err)) from None
        paths.append(path)
        labels.append(
            os.path.basename(os.path.normpath(run if os.path.isdir(run) else os.path.dirname(run)))
        )
    print(plot_metrics(paths, out, labels=labels, title=_TITLE.value))


if __name__ == "__main__":
    script_usage.run(main)
