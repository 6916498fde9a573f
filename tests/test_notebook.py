"""notebooks/quickstart.ipynb runs headless on CPU from top to bottom (nbclient)."""

from __future__ import annotations

import os

import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="nbformat not installed (pip install -e '.[test]' adds it)"
)
nbclient = pytest.importorskip(
    "nbclient", reason="nbclient not installed (pip install -e '.[test]' adds it)"
)
pytest.importorskip("ipykernel", reason="ipykernel not installed (the notebook's kernel)")

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")


def _outputs_text(nb) -> str:
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


@pytest.mark.slow  # ~30-70 s on a shared 2-core CPU: kernel start, JAX import, 40 steps
def test_quickstart_notebook_executes(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(os.path.join(NOTEBOOKS, "quickstart.ipynb"), as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": NOTEBOOKS}}
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    text = _outputs_text(nb)
    assert "final step 40 (sbm)" in text
    assert "overflow False" in text
    images = [
        o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})
    ]
    assert len(images) == 2  # loss/density plot and the sampled graph
