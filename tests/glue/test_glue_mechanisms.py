"""Every GLUE mechanism preset runs a pretraining step and gives a finite MLM loss
near log(vocab) at initialisation (slow: one compile per mechanism)."""

from __future__ import annotations

import math

import pytest
from glue.pretrain_lib import run_pretraining

from glue.presets import MECHANISMS
from tests.glue.conftest import load_config


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_one_pretraining_step(mechanism, corpus_glob, tmp_path):
    config = load_config("pretrain", f"{mechanism},smoke")
    config.model.num_layers = 1
    config.train.num_steps = 1
    config.data.corpus = corpus_glob
    summary = run_pretraining(config, str(tmp_path))
    assert abs(summary["first_mlm_loss"] - math.log(summary["vocab_size"])) < 1.0
    assert math.isfinite(summary["eval"]["loss"])
