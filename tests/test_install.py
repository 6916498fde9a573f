"""The wheel, installed without -e into a fresh venv: the library core alone imports and
runs the README's API snippet, and brings the number of packages the README states.

Needs the package index (or pip's cache): it installs the core at the versions in
constraints.txt, as a user would.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.notebook_testing import REPO, copy_checkout


def _readme() -> str:
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        return f.read()


def readme_api_snippet() -> str:
    """The python blocks under README's "The API in a few lines" (NNX, then Linen), as one
    script."""
    section = re.search(r"## The API in a few lines\n(.*?)(?:\n## |\Z)", _readme(), re.S)
    assert section, "README.md lost its API section"
    blocks = re.findall(r"```python\n(.*?)```", section.group(1), re.S)
    assert blocks, "README.md lost its API snippet"
    return "\n".join(blocks)


CHECK = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import sbm_jax
    import sbm_jax.training  # the training loop and checkpoints are core too
    snippet = open(sys.argv[1]).read()
    scope = {}
    exec(snippet, scope)
    density = np.asarray(scope["stats"]["attention_stats"]["density"][0])
    print(json.dumps({
        "file": sbm_jax.__file__,
        "y": list(scope["y"].shape),
        "y_finite": bool(np.isfinite(np.asarray(scope["y"])).all()),
        "out": list(scope["out"].shape),
        "out_finite": bool(np.isfinite(np.asarray(scope["out"])).all()),
        "density": density.tolist(),
        "heavy": [m for m in ("matplotlib", "tensorboardX", "tensorflow_datasets", "grain",
                               "tokenizers", "tensorflow") if m in sys.modules],
    }))
    """
)


def _clean_env() -> dict[str, str]:
    """This environment without PYTHONPATH (a checkout on it, with its egg-info, would
    count as sbm-jax installed and hide the wheel), JAX on the CPU."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _install_wheel(tmp_path, extras: str = ""):
    """Build the wheel from a copy of the checkout, install it without -e (``[extras]``
    when given) into a fresh venv at the versions in constraints.txt; the venv's path."""
    source = copy_checkout(str(tmp_path / "src"))  # build outside the checkout
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), source],
        check=True,
    )
    (wheel,) = glob.glob(str(dist / "sbm_jax-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = os.path.join(REPO, "constraints.txt")
    requirement = f"{wheel}[{extras}]" if extras else wheel
    subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "-c",
            constraints,
            requirement,
        ],
        check=True,
        cwd=tmp_path,
        env=_clean_env(),
    )
    return venv


@pytest.mark.slow  # ~2-4 min: builds the wheel, installs ~30 packages, JAX compiles
def test_wheel_installs_and_runs_the_readme_api(tmp_path):
    import json

    venv = _install_wheel(tmp_path)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "check"], check=True)

    installed = subprocess.run(
        [python, "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True, text=True
    ).stdout.split()
    names = {line.split("==")[0].lower() for line in installed}
    brought = names - {"pip", "setuptools", "sbm-jax"}
    stated = re.search(r"the core brings (\d+) packages", _readme())
    assert stated, "README.md no longer states how many packages the core brings"
    assert len(brought) == int(stated.group(1)), sorted(brought)
    for heavy in ("tensorflow-datasets", "grain", "tokenizers", "tensorboardx", "matplotlib"):
        assert heavy not in names  # extras, not the core

    snippet = tmp_path / "snippet.py"
    snippet.write_text(readme_api_snippet())
    env = _clean_env()
    run = subprocess.run(
        [python, "-c", CHECK, str(snippet)],
        cwd=tmp_path,  # not the checkout: sbm_jax must come from the wheel
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(venv)), result["file"]
    assert result["y"] == [2, 128, 64] and result["y_finite"]
    assert result["out"] == [128, 32] and result["out_finite"]
    density = result["density"]  # [batch, heads], a fraction of the 128 x 128 pairs
    assert len(density) == 2 and all(len(row) == 2 for row in density)
    assert all(0.0 < d <= 1.0 for row in density for d in row)
    assert result["heavy"] == []


@pytest.mark.slow  # ~3-5 min: builds the wheel, installs the [train] extra, trains 40 steps
def test_installed_wheel_trains_through_the_console_command(tmp_path):
    import json

    venv = _install_wheel(tmp_path, "train")
    env = _clean_env()
    assert os.access(venv / "bin" / "sbm-lra-prepare", os.X_OK)
    work = tmp_path / "elsewhere"  # not the checkout: the presets come from the wheel
    work.mkdir()
    run = subprocess.run(
        [str(venv / "bin" / "sbm-train"), "--config=synthetic:full,smoke", "--output_dir=run"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((work / "run" / "summary.json").read_text())
    assert summary["step"] == 40 and summary["attention"] == "full"
    assert summary["config"]["model"]["attention"] == "full"
    help_run = subprocess.run(
        [str(venv / "bin" / "sbm-train"), "--help"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
    )
    assert help_run.returncode == 0 and "--print_config" in help_run.stdout
