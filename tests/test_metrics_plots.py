"""sbm_jax/training/plots.py's moving average and metrics.csv reading, as the synthetic
scripts (synthetic_table.py, plot_synthetic_ceiling.py) use them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sbm_jax.training.plots import (
    MetricsFileError,
    load_metrics_csv,
    moving_average,
    read_metrics_csv,
)
from tests.scripts_testing import load_script


def naive_moving_average(values, width):
    """Trailing window of ``width`` values (fewer at the start), NaNs left out."""
    out = []
    for i in range(len(values)):
        window = np.asarray(values[max(0, i - width + 1) : i + 1], dtype=float)
        out.append(float(np.nanmean(window)) if not np.isnan(window).all() else math.nan)
    return out


@pytest.mark.parametrize("width", [1, 2, 3, 5, 20])
def test_moving_average_leaves_nan_records_out_of_their_windows(width):
    rng = np.random.default_rng(width)
    values = list(rng.uniform(0, 1, 60))
    for i in (0, 7, 8, 9, 30, 59):  # a NaN first, a run of NaNs, a NaN last
        values[i] = math.nan
    got = moving_average(values, width)
    want = naive_moving_average(values, width)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if math.isnan(w):
            assert math.isnan(g), (i, g)
        else:
            assert g == pytest.approx(w, abs=1e-12), i


def test_one_nan_record_does_not_poison_the_rest():
    # (audit repro nan_moving_average.py) a running sum made every later mean NaN.
    values = [0.5] * 5 + [math.nan] + [1.0] * 50
    ma = moving_average(values, 5)
    assert ma[-1] == 1.0 and max(ma) == 1.0
    assert moving_average([math.nan, math.nan, 1.0], 2)[:2] == pytest.approx(
        [math.nan, math.nan], nan_ok=True
    )
    with pytest.raises(ValueError, match="width"):
        moving_average([1.0], 0)


def _run_with_a_nan_row(root, name="run"):
    run = root / name
    run.mkdir()
    (run / "config.json").write_text(
        json.dumps({"seed": 0, "model": {"attention": "sbm", "attention_options": {}}})
    )
    rows = ["step,loss,accuracy,density"]
    for step in range(1, 101):
        if step == 10:
            rows.append("10,nan,nan,nan")
        elif step == 11:
            rows.append("11,,,")  # an empty record: nan too
        else:
            rows.append(f"{step},{1 - step / 100},{0.5 + step / 200},{0.2 + step / 200}")
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    return run


def test_synthetic_table_reports_a_run_with_a_nan_row(tmp_path):
    table = load_script("synthetic_table")
    run = _run_with_a_nan_row(tmp_path)
    # (thresholds off the logged values: no float ties)
    row = table.run_row(str(run), leave=0.701, solved=0.991, smooth=1)
    assert row["accuracy"] == pytest.approx(1.0) and row["density"] == pytest.approx(0.7)
    assert row["max_density"] == pytest.approx(0.7)
    assert row["leaves_baseline"] == 41 and row["solved"] == 99
    row = table.run_row(str(run), leave=0.701, solved=0.991, smooth=5)
    # the mean of the last five records, 0.98 .. 1.0 and 0.68 .. 0.70
    assert row["accuracy"] == pytest.approx(0.99) and row["max_density"] == pytest.approx(0.69)
    assert row["leaves_baseline"] == 43 and row["solved"] is None
    line = "| 0.9900 (stopped at 100, train MA) | 0.69 | 0.69 | 43 | never |"
    assert line in table.markdown([row])


def test_metrics_csv_reading_names_the_file_and_what_is_wrong(tmp_path):
    header = tmp_path / "header.csv"
    header.write_text("step,loss,accuracy,density\n")
    assert read_metrics_csv(str(header)) == {
        "step": [],
        "loss": [],
        "accuracy": [],
        "density": [],
    }
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    nodens = tmp_path / "nodens.csv"
    nodens.write_text("step,accuracy\n1,0.5\n")
    text = tmp_path / "text.csv"
    text.write_text("step,accuracy\n1,high\n")
    cases = [
        (header, "no rows"),
        (empty, "empty"),
        (nodens, "no density column"),
        (text, "not a metrics.csv"),
        (tmp_path, "cannot read"),
        (tmp_path / "missing.csv", "cannot read"),
    ]
    for path, message in cases:
        with pytest.raises(MetricsFileError, match=message) as info:
            load_metrics_csv(str(path), ("step", "density"))
        assert str(path) in str(info.value)
    assert load_metrics_csv(str(nodens), ("step",)) == {"step": [1.0], "accuracy": [0.5]}


def test_synthetic_table_shows_an_unlogged_density_as_unknown(tmp_path):
    # full attention logs no density (the trainer writes empty cells), and an old file
    # may lack the column: the table must not claim a density of 1 or "never"
    table = load_script("synthetic_table")
    for name, header, cells in (
        ("empty", "step,loss,accuracy,density", ","),
        ("none", "step,loss,accuracy", ""),
    ):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"seed": 0, "model": {"attention": "full"}}))
        rows = [header] + [f"{s},0.5,{0.6 + s / 100}{cells}" for s in range(1, 21)]
        (run / "metrics.csv").write_text("\n".join(rows) + "\n")
        row = table.run_row(str(run), leave=0.65, solved=0.99, smooth=1)
        assert row["max_density"] is None
        assert row["accuracy"] == pytest.approx(0.8)
        line = "| 0.8000 (stopped at 20, train MA) | - | - | 5 | never |"
        assert line in table.markdown([row]), table.markdown([row])
