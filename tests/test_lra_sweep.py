"""scripts/lra_sweep.py resolves everything against --root, wherever it starts from."""

from __future__ import annotations

import os

from absl import flags


def test_sweep_paths_live_under_root_from_any_directory(tmp_path, monkeypatch, capsys):
    from scripts import lra_sweep

    calls = []

    def fake_call(cmd, stdout, stderr, **kwargs):
        out = next(a for a in cmd if a.startswith("--output_dir=")).split("=", 1)[1]
        calls.append((cmd, kwargs.get("cwd"), stdout.name, out))
        with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
            f.write("{}")
        return 0

    monkeypatch.setattr(lra_sweep.subprocess, "call", fake_call)
    start = tmp_path / "elsewhere"
    start.mkdir()
    monkeypatch.chdir(start)
    argv = ["lra_sweep", "--tasks=listops", "--mechanisms=full", "--root=sweep", "--scale=smoke"]
    flags.FLAGS(argv)
    try:
        lra_sweep.main(["lra_sweep"])
        run = start / "sweep" / "listops" / "full_lambda0_seed0"
        ((cmd, cwd, log, out),) = calls
        assert out == str(run) and os.path.isabs(out)
        assert log == str(run / "train.log")
        assert cwd is None  # the run starts where the sweep did, like its paths
        assert any(a.startswith("--config=/") for a in cmd)  # the config by absolute path
        # From another directory, the same (absolute) root is seen as done: skipped.
        monkeypatch.chdir(tmp_path)
        flags.FLAGS.unparse_flags()
        flags.FLAGS([*argv[:-2], f"--root={start / 'sweep'}", "--scale=smoke"])
        lra_sweep.main(["lra_sweep"])
        assert len(calls) == 1
        # A dry run lists what a real run would do: the finished run as skipped, a new
        # seed's command printed, and nothing started.
        flags.FLAGS.unparse_flags()
        flags.FLAGS([*argv[:-2], f"--root={start / 'sweep'}", "--scale=smoke", "--seeds=0,1"])
        flags.FLAGS.dry_run = True
        capsys.readouterr()
        lra_sweep.main(["lra_sweep"])
        printed = capsys.readouterr().out.splitlines()
        assert printed[0] == f"skip (done): {run}"
        assert len(printed) == 2 and "seed=1" in printed[1] and "full_lambda0_seed1" in printed[1]
        assert len(calls) == 1
    finally:
        flags.FLAGS.unparse_flags()
        _forget_script_flags("scripts.lra_sweep")


def _forget_script_flags(module: str) -> None:
    """Remove the absl flags ``module`` defined (and the module), so that another script
    imported later in the same test process may define flags of the same names (both
    lra_sweep and lra_report take --root)."""
    import sys

    for flag in flags.FLAGS.get_flags_for_module(module):
        if flag.name in flags.FLAGS:
            delattr(flags.FLAGS, flag.name)
    sys.modules.pop(module, None)
