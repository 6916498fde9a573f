"""notebooks/quickstart.ipynb runs headless on CPU from top to bottom (nbclient), as on
Colab: from a directory outside the checkout, in a Python without sbm-jax, whose first
cell installs it (here from this checkout, through SBM_JAX_REPO)."""

from __future__ import annotations

import json
import os

import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="nbformat not installed (pip install -e '.[test]' adds it)"
)
nbclient = pytest.importorskip(
    "nbclient", reason="nbclient not installed (pip install -e '.[test]' adds it)"
)
pytest.importorskip("ipykernel", reason="ipykernel not installed (the notebook's kernel)")

from tests.notebook_testing import NOTEBOOK, execute_quickstart, outputs_text  # noqa: E402


def _nnx_steps(text: str) -> list[int]:
    """The steps of the NNX cell's progress lines, each with a finite loss and a density
    per head."""
    steps = []
    for line in text.splitlines():
        if line.startswith("NNX step "):
            step, rest = line.removeprefix("NNX step ").split(": ", 1)
            loss = float(rest.split("loss ")[1].split(",")[0])
            assert loss == loss and "sampled density per head [" in rest, line
            steps.append(int(step))
    return steps


def _images(nb) -> int:
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def test_notebook_opens_in_colab_and_ships_outputs():
    """The badge, the one repository variable, the runtime-matched install, saved outputs."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown"
    assert "colab.research.google.com/assets/colab-badge.svg" in first.source
    assert "colab.research.google.com/github/" in first.source
    install = nb.cells[1].source
    assert (
        install.count("REPO_URL = ") == 1 and 'os.environ.get("SBM_JAX_REPO", REPO_URL)' in install
    )
    assert '{"cpu": "train", "gpu": "train,gpu", "tpu": "train,tpu"}[runtime]' in install
    assert "pip" in install and "{repo_dir}[{extras}]" in install
    # NNX first: a model of its own with the NNX SBM layer, trained with nnx.Optimizer.
    nnx_cell = next(c for c in nb.cells if "sbm_nnx.SBMAttention(" in c.source)
    trainer_cell = next(c for c in nb.cells if "train_and_evaluate(" in c.source)
    assert nb.cells.index(nnx_cell) < nb.cells.index(trainer_cell)
    assert "from sbm_jax import nnx as sbm_nnx" in nnx_cell.source
    assert "nnx.Optimizer(model, " in nnx_cell.source and "wrt=nnx.Param" in nnx_cell.source
    assert "optimizer.update(model, grads)" in nnx_cell.source
    assert '.stats["density"]' in nnx_cell.source
    # Saved with its outputs: the NNX steps, the training summary, three figures.
    text = outputs_text(nb)
    assert _nnx_steps(text) == [50, 100, 150]
    assert "synthetic (sbm, seed 0): " in text and "| 40 steps in " in text
    assert _images(nb) == 3
    assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")


@pytest.mark.slow  # ~1-3 min on a shared 2-core CPU: a venv, the install, JAX, 40 steps
def test_quickstart_notebook_executes_like_colab(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = execute_quickstart(str(tmp_path))  # raises CellExecutionError naming the cell
    text = outputs_text(nb)
    assert "runtime: cpu; installing " + os.path.dirname(os.path.dirname(NOTEBOOK)) in text
    assert "[train]" in text
    # sbm_jax came from the checkout the install cell was pointed at.
    assert (
        "sbm_jax from " + os.path.join(os.path.dirname(os.path.dirname(NOTEBOOK)), "sbm_jax")
        in text
    )
    assert _nnx_steps(text) == [50, 100, 150]  # the NNX model trained
    assert "synthetic (sbm, seed 0): " in text and "| 40 steps in " in text  # summary line
    assert "density per head at the last step" in text
    assert "overflow False" in text
    assert _images(nb) == 3  # metrics, density per head, the sampled graph
    # The per-head densities printed are the ones the run logged.
    output_dir = text.split("-> ")[1].split()[0]
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        last = [r for r in map(json.loads, f) if r.get("split") == "train"][-1]
    (per_head,) = last["density_per_head"].values()
    assert len(per_head) == 2
    assert "density per head at the last step: " + ", ".join(f"{d:.3f}" for d in per_head) in text
