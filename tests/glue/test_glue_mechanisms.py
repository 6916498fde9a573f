"""Every GLUE mechanism preset runs a pretraining step through ``scripts/train.py`` and
gives a finite MLM loss near log(vocab) at initialisation (slow: one compile per
mechanism)."""

from __future__ import annotations

import json
import math
import os

import pytest

from configs.glue.common import MECHANISMS
from tests.glue.conftest import ROOT
from tests.glue.test_glue_end_to_end import run_train


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_one_pretraining_step(mechanism, corpus_glob, tmp_path):
    status, _, stderr = run_train(
        f"--config={os.path.join(ROOT, 'configs', 'glue', 'pretrain.py')}:{mechanism},smoke",
        "--config.model.num_layers=1",
        "--config.train.num_steps=1",
        f"--config.data.corpus={corpus_glob}",
        f"--output_dir={tmp_path}",
    )
    assert status == 0, stderr[-3000:]
    with open(tmp_path / "summary.json", encoding="utf-8") as f:
        summary = json.load(f)
    assert abs(summary["first_mlm_loss"] - math.log(summary["vocab_size"])) < 1.0
    assert math.isfinite(summary["eval"]["loss"])
