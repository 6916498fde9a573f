"""The TSA text classifier as a model config: it builds from config and trains."""

import flax.linen as nn
import jax
import numpy as np
import pytest

from configs.tsa_text import get_config
from sbm_jax.models.build import build_model
from sbm_jax.models.tsa_classifier import TSAClassifier
from sbm_jax.tasks import build_task


def test_config_builds_the_tsa_classifier_and_trains():
    import lra.train_task  # noqa: F401  (registers the LRA tasks)

    config = get_config("smoke")
    task = build_task(config)
    model = build_model(config.model, task.head)
    assert isinstance(model, TSAClassifier)
    assert model.hidden_dim == 20 and model.num_heads == 2
    batch = next(task.train_batches(0))
    rngs = {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}
    inputs = task.model_inputs(batch)
    # one compiled program each, not op-by-op compiles
    init = jax.jit(lambda rngs, inputs: model.init(rngs, **inputs, deterministic=True))
    params = nn.unbox(init(rngs, inputs))["params"]
    apply = jax.jit(lambda params, inputs: model.apply(params, **inputs, deterministic=True))
    logits = apply({"params": params}, inputs)
    assert logits.shape == (batch["inputs"].shape[0], config.model.num_classes)
    assert np.isfinite(np.asarray(logits)).all()


def test_tsa_classifier_needs_a_classification_task_and_tsa():
    config = get_config("smoke")
    with pytest.raises(ValueError, match="token"):
        build_model(config.model, "token")
    with config.unlocked():
        config.model.attention = "full"
    with pytest.raises(ValueError, match="model.attention"):
        build_model(config.model, "classification")
    with config.unlocked():
        config.model.architecture = "mlp"
    with pytest.raises(ValueError, match="model.architecture"):
        build_model(config.model, "classification")


def test_encoder_fields_the_classifier_ignores_are_refused():
    # the classifier has one TSA layer, average pooling and no MLP blocks: encoder fields
    # set on it would be ignored silently (and num_layers would multiply its FLOPs)
    from sbm_jax.training.config_checks import check_model

    config = get_config("smoke")
    errors: list[str] = []
    check_model(config.model, errors)
    assert errors == []
    for name, value, expected in (
        ("num_layers", 6, "model.num_layers=6: model.architecture='tsa_classifier' has one"),
        ("mlp_dim", 999, "model.mlp_dim is not read by model.architecture='tsa_classifier'"),
        ("pooling", "cls", "model.pooling is not read by"),
    ):
        config = get_config("smoke")
        with config.unlocked():
            config.model[name] = value
        errors = []
        check_model(config.model, errors)
        assert len(errors) == 1 and errors[0].startswith(expected), errors
