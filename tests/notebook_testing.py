"""Run notebooks/quickstart.ipynb as Colab would: from a directory outside the checkout,
in a Python that has the usual stack but not sbm-jax, whose first cell installs it.

The kernel runs in a throwaway virtual environment that sees this interpreter's packages
(jax, flax, matplotlib, ipykernel, ...) through links, minus any sbm-jax: like a Colab
runtime, where the notebook's install cell has to bring sbm-jax itself. That cell
installs the checkout named by ``SBM_JAX_REPO`` (here: this checkout) into the throwaway
environment; nothing is installed into this interpreter's environment.

``python tests/notebook_testing.py --save`` executes the notebook this way on CPU and
writes it back with its outputs (what the repository ships).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")
KERNEL_NAME = "sbm-quickstart-test"


def _is_sbm_jax(entry: str) -> bool:
    name = entry.lower().replace("-", "_")
    return name.startswith(("sbm_jax", "__editable__.sbm_jax", "__editable___sbm_jax"))


def make_colab_like_python(root: str) -> str:
    """A venv under ``root`` that sees this interpreter's packages except sbm-jax.

    Returns its python executable.
    """
    venv = os.path.join(root, "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    # Link every entry of this interpreter's site-packages, except sbm-jax's, into one dir.
    view = os.path.join(root, "preinstalled")
    os.makedirs(view)
    parents = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    for parent in sorted(parents):
        for entry in os.listdir(parent):
            if _is_sbm_jax(entry) or entry.endswith(".pth") or entry in ("pip", "setuptools"):
                continue
            link = os.path.join(view, entry)
            if not os.path.lexists(link):
                os.symlink(os.path.join(parent, entry), link)
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    with open(os.path.join(site, "preinstalled.pth"), "w", encoding="utf-8") as f:
        f.write(view + "\n")  # appended after the venv's own site-packages
    return python


def copy_checkout(dest: str) -> str:
    """Copy this checkout's tracked and untracked, not ignored, files to ``dest``."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        src = os.path.join(REPO, name)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, name)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, name))
    return dest


def execute_quickstart(workdir: str, repo: str = REPO, timeout: int = 600):
    """Execute the notebook with cwd ``workdir/content``, installing from ``repo``.

    Returns the executed notebook.

    Raises nbclient's CellExecutionError (naming the cell) if a cell fails.
    """
    import nbclient
    import nbformat

    python = make_colab_like_python(workdir)
    kernel_dir = os.path.join(workdir, "jupyter", "kernels", KERNEL_NAME)
    os.makedirs(kernel_dir)
    spec = {
        "argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3",
        "language": "python",
    }
    with open(os.path.join(kernel_dir, "kernel.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f)
    content = os.path.join(workdir, "content")  # Colab's working directory is /content
    os.makedirs(content, exist_ok=True)

    saved = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "SBM_JAX_REPO", "PYTHONPATH")}
    os.environ["JUPYTER_PATH"] = os.path.join(workdir, "jupyter")
    os.environ["SBM_JAX_REPO"] = repo
    os.environ.pop("PYTHONPATH", None)  # the kernel must find sbm_jax through the install
    try:
        nb = nbformat.read(NOTEBOOK, as_version=4)
        client = nbclient.NotebookClient(
            nb,
            timeout=timeout,
            kernel_name=KERNEL_NAME,
            resources={"metadata": {"path": content}},
            record_timing=False,
        )
        client.execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    return nb


def outputs_text(nb) -> str:
    """Every stream and text/plain output of ``nb``, joined."""
    parts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            parts.append(output.get("text", ""))
            parts.append(output.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", action="store_true", help="write the outputs back")
    args = parser.parse_args()
    import nbformat

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with tempfile.TemporaryDirectory(prefix="sbm_colab_") as workdir:
        # Saved outputs show a Colab-like path: the checkout copied to content/sbm-jax.
        repo = copy_checkout(os.path.join(workdir, "content", "sbm-jax")) if args.save else REPO
        nb = execute_quickstart(workdir, repo)
    print(outputs_text(nb))
    if args.save:
        nbformat.write(nb, NOTEBOOK)
        print(f"wrote {NOTEBOOK}")


if __name__ == "__main__":
    main()
