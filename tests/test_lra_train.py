"""LRA training end to end on tiny prepared datasets: configs, train, dev eval,
checkpoint, resume, test at the best checkpoint, report."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from configs.lra import common, image, listops, pathfinder, retrieval, text
from lra import builders
from lra.builders import common as builder_common
from lra.builders import retrieval as retrieval_builder
from sbm_jax.attention import available
from sbm_jax.training import validate_config
from sbm_jax.training.trainer import train_and_evaluate
from tests.scripts_testing import forget_script


@pytest.fixture(scope="module", autouse=True)
def _forget_lra_report_flags():
    """The report tests import scripts.lra_report; its absl flags must not outlive them."""
    yield
    forget_script("scripts.lra_report")


CONFIGS = {
    "listops": listops,
    "text": text,
    "retrieval": retrieval,
    "image": image,
    "pathfinder": pathfinder,
}

# Appendix Table 7 of the paper, LRA columns (listops, text, retrieval, image, pathfinder).
TABLE7 = {
    "seq_len": (2048, 3072, 4096, 1024, 1024),
    "batch": (128, 128, 32, 1024, 1024),
    "lr": (5e-4, 5e-4, 1e-4, 5e-4, 5e-4),
    "steps": (5000, 20000, 30000, 35000, 62400),
    "classes": (10, 2, 2, 10, 2),
}
# The reference training schedule (SBM-Transformer repository, code/lra_config.py, the
# Nystromformer LRA configs): warm-up steps and evaluation frequency, same task order.
REFERENCE = {"warmup": (1000, 8000, 800, 175, 312), "eval_every": (50, 500, 300, 175, 312)}


def test_paper_presets_follow_table7():
    for i, (task, module) in enumerate(CONFIGS.items()):
        c = module.get_config("sbm")
        assert c.task.max_length == c.model.max_len == TABLE7["seq_len"][i]
        assert c.train.batch_size == TABLE7["batch"][i]
        assert c.train.learning_rate == TABLE7["lr"][i]
        assert c.train.num_steps == TABLE7["steps"][i]
        assert c.train.warmup_steps == REFERENCE["warmup"][i]
        assert c.train.eval_every == REFERENCE["eval_every"][i]
        assert c.model.num_classes == TABLE7["classes"][i]
        m = c.model
        assert (m.num_layers, m.num_heads, m.emb_dim, m.mlp_dim, m.head_dim) == (2, 2, 64, 128, 32)
        assert (m.dropout, m.attention_dropout, m.pooling) == (0.1, 0.1, "mean")
        assert (c.train.eps, c.train.weight_decay, c.train.end_learning_rate_factor) == (
            1e-6,
            0.0,
            0.0,
        )
        assert m.attention_options.num_clusters == 128
        assert c.task.name == f"lra_{task}"
        seq = TABLE7["seq_len"][i]
        assert module.get_config("linformer").model.attention_options.max_len == seq
        assert module.get_config("linformer").model.attention_options.proj_len == 256
        assert module.get_config("performer").model.attention_options.num_features == 256
        assert module.get_config("nystromformer").model.attention_options.num_landmarks == 256
        assert module.get_config("reformer").model.attention_options.num_hashes == 2


def test_every_mechanism_and_scale_validates():
    for module in CONFIGS.values():
        for mech in available():
            for scale in common.SCALES:
                c = module.get_config(f"{mech},{scale}")
                validate_config(c, device_count=1)
                assert c.model.attention == mech


def test_preset_parsing_and_errors():
    c = listops.get_config("sbm,lambda=1e-2,seed=3,smoke")
    assert c.train.density_lambda == 1e-2 and c.seed == 3
    assert c.name == "lra_listops_sbm_lambda0.01_smoke_seed3"
    with pytest.raises(ValueError, match="unknown preset 'fast'"):
        listops.get_config("sbm,fast")
    with pytest.raises(ValueError, match="lambda must be a number"):
        listops.get_config("sbm,lambda=x")


def _smoke(task: str, mech: str, data_dir: str, data_config: str | None, **train) -> object:
    c = CONFIGS[task].get_config(f"{mech},smoke")
    c.task.source = "tfds"
    c.task.data_dir = data_dir
    c.task.data_config = data_config or ""
    c.train.update(train)
    return c


def _train_records(path: str) -> list[dict]:
    with open(os.path.join(path, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def listops_data(tmp_path_factory):
    data_dir = str(tmp_path_factory.mktemp("lra_listops"))
    config = builders.make_config(
        "listops", num_train=64, num_validation=16, num_test=16, min_length=8, max_length=32
    )
    builders.make_builder("listops", config, data_dir=data_dir).download_and_prepare(
        file_format="array_record"
    )
    return data_dir, config.name


# suite time (~23 s): resume is also checked in the default run by test_resilience's
# SIGTERM test and LRA training by test_density_maps_are_what_the_model_sows.
@pytest.mark.slow
def test_listops_train_resume_report(listops_data, tmp_path):
    """12 steps straight == 6 steps, stop, resume to 12; loss falls; report tables."""
    import lra.train_task as lra_train
    from scripts import lra_report

    data_dir, name = listops_data
    config = _smoke(
        "listops", "full", data_dir, name, num_steps=12, eval_every=4, learning_rate=1e-2
    )
    config.checkpoint.every_steps = 4
    task = lra_train.build_lra_task("listops", config)

    straight = train_and_evaluate(config, task, str(tmp_path / "runs" / "a"))
    stopped = train_and_evaluate(config, task, str(tmp_path / "runs" / "b"), stop_after=6)
    assert stopped["stopped_at"] == 6
    assert not os.path.exists(tmp_path / "runs" / "b" / "summary.json")
    resumed = train_and_evaluate(config, task, str(tmp_path / "runs" / "b"))
    assert resumed["resumed_from"] == 6 and resumed["steps_this_session"] == 6
    assert straight["resumed_from"] is None and straight["steps"] == resumed["steps"] == 12

    a = [r for r in _train_records(tmp_path / "runs" / "a") if r["split"] == "train"]
    b = [r for r in _train_records(tmp_path / "runs" / "b") if r["split"] == "train"]
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 13))
    np.testing.assert_allclose([r["loss"] for r in a], [r["loss"] for r in b], rtol=1e-5)
    for key in ("test_accuracy", "test_loss", "best_dev", "best_dev_step", "test_step"):
        assert straight[key] == pytest.approx(resumed[key], rel=1e-5), key

    # Direction: the training loss falls (tiny model, large lr, 64 examples).
    losses = [r["loss"] for r in a]
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    # The best dev checkpoint is what the test evaluation used.
    dev = [r for r in _train_records(tmp_path / "runs" / "a") if r["split"] == "dev"]
    assert [r["step"] for r in dev] == [4, 8, 12]
    best = max(dev, key=lambda r: r["accuracy"])  # first of ties
    assert straight["best_dev_step"] == best["step"] == straight["test_step"]
    assert straight["best_dev"] == pytest.approx(best["accuracy"])
    assert straight["test_density"] == pytest.approx(1.0)  # full attention: every pair
    assert 0.0 <= straight["test_accuracy"] <= 1.0 and straight["test_examples"] == 16

    # Summaries -> report. a and b are the same seed of one config: not two seeds.
    with pytest.raises(lra_report.ReportError, match="seed 0: move one out of --root"):
        lra_report.make_report(str(tmp_path / "runs"), str(tmp_path / "report"), 0)
    shutil.copytree(tmp_path / "runs" / "a", tmp_path / "one" / "a")
    # Table 1 holds the one run's accuracy, std 0.
    report = lra_report.make_report(str(tmp_path / "one"), str(tmp_path / "report"), 0)
    acc = report["table1_accuracy"]["full"]["listops"]["accuracy"]
    assert acc[0] == pytest.approx(straight["test_accuracy"]) and acc[1] == pytest.approx(0.0)
    cost = report["table3_cost"]["full"]["listops"]
    assert cost["relative_flops"] == pytest.approx(1.0) and cost["peak_bytes"] > 0
    with open(tmp_path / "report" / "table1_accuracy.md", encoding="utf-8") as f:
        assert f"{100 * straight['test_accuracy']:.2f} ± 0.00" in f.read()


@pytest.mark.slow  # suite time: the density maps test stays
def test_sbm_listops_density_summary(listops_data, tmp_path):
    """SBM: per-layer/head test density mean and std in the summary, in (0, 1]."""
    from scripts import lra_report

    data_dir, name = listops_data
    config = _smoke("listops", "sbm", data_dir, name, num_steps=2, eval_every=2)
    summary = train_and_evaluate(config, _task("listops", config), str(tmp_path / "sbm"))
    per_head = summary["test_density_per_head"]
    assert len(per_head) == config.model.num_layers
    for values in per_head.values():
        assert len(values["mean"]) == len(values["std"]) == config.model.num_heads
        assert all(0.0 < m <= 1.0 for m in values["mean"])
        assert all(s >= 0.0 for s in values["std"])
    means = [np.mean(v["mean"]) for v in per_head.values()]
    assert summary["test_density"] == pytest.approx(np.mean(means))
    report = lra_report.make_report(str(tmp_path), str(tmp_path / "report"), 0)
    assert os.path.exists(tmp_path / "report" / "fig5_density_per_layer.png")
    sbm_cost = report["table3_cost"]["sbm"]["listops"]
    assert sbm_cost["flops"] > 0


def _task(task: str, config):
    import lra.train_task as lra_train

    return lra_train.build_lra_task(task, config)


def _resume_smoke(task: str, mech: str, data_dir: str, name: str | None, tmp_path) -> dict:
    config = _smoke(task, mech, data_dir, name, num_steps=4, eval_every=2)
    t = _task(task, config)
    out = str(tmp_path / f"{task}_{mech}")
    assert train_and_evaluate(config, t, out, stop_after=2)["stopped_at"] == 2
    summary = train_and_evaluate(config, t, out)
    assert summary["resumed_from"] == 2 and summary["steps"] == 4
    assert summary["best_dev_step"] in (2, 4) and summary["test_step"] == summary["best_dev_step"]
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        assert json.load(f)["test_accuracy"] == summary["test_accuracy"]
    return summary


@pytest.mark.slow  # suite time: builders tested in tests/lra, the trainer by listops
def test_text_end_to_end(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    fake = {
        split: [
            {
                "text": bytes(rng.integers(32, 127, size=rng.integers(5, 40)).tolist()),
                "label": i % 2,
            }
            for i in range(24)
        ]
        for split in ("train", "test")
    }
    monkeypatch.setattr(
        builder_common, "open_catalog_split", lambda n, split, data_dir: fake[split]
    )
    config = builders.make_config("text", max_length=32)
    builders.make_builder("text", config, data_dir=str(tmp_path)).download_and_prepare(
        file_format="array_record"
    )
    summary = _resume_smoke("text", "performer", str(tmp_path), config.name, tmp_path)
    assert summary["test_examples"] == 24


@pytest.mark.slow  # suite time: builders tested in tests/lra, the trainer by listops
def test_retrieval_end_to_end(tmp_path):
    from tensorflow_datasets.core.download import DownloadConfig

    manual = tmp_path / "manual"
    manual.mkdir()
    rng = np.random.default_rng(1)
    for split, fname in retrieval_builder.RELEASE_FILES.items():
        rows = []
        for i in range({"train": 24, "validation": 8, "test": 8}[split]):
            a = "".join(chr(c) for c in rng.integers(97, 123, size=20))
            b = "".join(chr(c) for c in rng.integers(97, 123, size=12))
            rows.append(f"{i % 2}\tA{i}\tB{i}\t{a}\t{b}")
        (manual / fname).write_text("\n".join(rows) + "\n", encoding="utf-8")
    config = builders.make_config("retrieval", max_length=32)
    builders.make_builder(
        "retrieval", config, data_dir=str(tmp_path / "data")
    ).download_and_prepare(
        file_format="array_record", download_config=DownloadConfig(manual_dir=str(manual))
    )
    summary = _resume_smoke("retrieval", "sbm", str(tmp_path / "data"), config.name, tmp_path)
    # dual encoder: each layer's density averages both documents' graphs
    assert summary["test_examples"] == 8 and len(summary["test_density_per_head"]) == 1


@pytest.mark.slow
def test_image_end_to_end_and_density_maps(tmp_path, monkeypatch):
    from scripts import lra_report

    rng = np.random.default_rng(2)
    fake = {
        split: [
            {"image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), "label": i % 10}
            for i in range(16)
        ]
        for split in ("train[:45000]", "train[45000:]", "test")
    }
    monkeypatch.setattr(
        builder_common, "open_catalog_split", lambda n, split, data_dir: fake[split]
    )
    builders.make_builder("image", None, data_dir=str(tmp_path / "data")).download_and_prepare(
        file_format="array_record"
    )
    _resume_smoke("image", "sbm", str(tmp_path / "data"), None, tmp_path / "runs")
    report = lra_report.make_report(str(tmp_path / "runs"), str(tmp_path / "report"), 2)
    assert str(tmp_path / "report" / "fig7_image_density.png") in report["files"]


@pytest.mark.slow
def test_pathfinder_end_to_end_and_density_maps(tmp_path):
    from scripts import lra_report

    config = builders.make_config(
        "pathfinder", difficulty="easy", num_train=16, num_validation=8, num_test=8
    )
    builders.make_builder(
        "pathfinder", config, data_dir=str(tmp_path / "data")
    ).download_and_prepare(file_format="array_record")
    _resume_smoke("pathfinder", "sbm", str(tmp_path / "data"), config.name, tmp_path / "runs")
    maps_in, maps = lra_report.token_density_maps(
        lra_report.load_summaries(str(tmp_path / "runs"))[0], 2
    )
    assert maps.shape == (2, 1, 1024) and np.all((maps >= 0) & (maps <= 1))
    report = lra_report.make_report(str(tmp_path / "runs"), str(tmp_path / "report"), 2)
    assert str(tmp_path / "report" / "fig8_pathfinder_density.png") in report["files"]


def test_report_figures_read_the_sown_densities(tmp_path):
    """Fig. 5 bars and the Table 2 trade-off come from summary.json's sown densities."""
    from scripts import lra_report

    def summary(lam: float, acc: float, layers: list[tuple[list[float], list[float]]]):
        per_head = {
            f"encoder/block_{i}/attention": {"mean": m, "std": s} for i, (m, s) in enumerate(layers)
        }
        dens = float(np.mean([np.mean(m) for m, _ in layers]))
        return {
            "task_short": "listops",
            "attention": "sbm",
            "density_lambda": lam,
            "test_accuracy": acc,
            "test_density": dens,
            "test_density_per_head": per_head,
        }

    runs = [
        summary(0.0, 0.36, [([0.2, 0.4], [0.01, 0.02]), ([0.1, 0.3], [0.03, 0.04])]),
        summary(1e-2, 0.35, [([0.05, 0.07], [0.0, 0.01]), ([0.02, 0.04], [0.0, 0.0])]),
    ]
    layers = lra_report.head_densities(runs[0])
    assert layers == [([0.2, 0.4], [0.01, 0.02]), ([0.1, 0.3], [0.03, 0.04])]
    fig5 = lra_report.figure5(runs, str(tmp_path / "fig5.png"))
    trade = lra_report.figure_tradeoff(runs, str(tmp_path / "trade.png"))
    assert fig5 and os.path.getsize(fig5) > 0 and trade and os.path.getsize(trade) > 0
    # one lambda only: no trade-off to draw
    assert lra_report.figure_tradeoff(runs[:1], str(tmp_path / "none.png")) is None


def _tiny_sbm_classifier(length: int):
    """A one-layer SBM classifier (dense path), its parameters and two inputs."""
    import jax
    import jax.numpy as jnp
    import ml_collections

    from sbm_jax.models import build_model

    model_cfg = ml_collections.ConfigDict(
        dict(
            vocab_size=256,
            max_len=length,
            emb_dim=16,
            num_layers=1,
            num_heads=2,
            head_dim=8,
            mlp_dim=16,
            attention="sbm",
            attention_options=dict(num_clusters=8, impl="dense"),
            dropout=0.0,
            attention_dropout=0.0,
            pooling="mean",
            classifier_dim=16,
            num_classes=10,
            dtype="float32",
        )
    )
    model = build_model(model_cfg, "classification")
    ids = jax.random.randint(jax.random.PRNGKey(3), (2, length), 0, 256)
    batch = {
        "inputs": np.asarray(ids),
        "mask": np.ones((2, length), bool),
        "targets": np.array([3, 7], np.int32),
    }
    inputs = {"inputs": jnp.asarray(batch["inputs"]), "mask": jnp.asarray(batch["mask"])}
    rngs = {"params": jax.random.PRNGKey(0), "sample": jax.random.PRNGKey(1)}
    init = jax.jit(lambda rngs, inputs: model.init(rngs, **inputs, deterministic=True))
    params = init(rngs, inputs)["params"]
    return model, params, batch, inputs


def test_density_maps_are_what_the_model_sows(tmp_path, monkeypatch):
    """The report's token-density maps and figs. 7-8 numbers are the values the SBM layers
    sow (read by running the model), not a re-derivation: they equal the sown values of
    a direct apply, and follow the layer when its sown densities change."""
    import jax

    import sbm_jax.attention.sbm as sbm_module
    from sbm_jax.attention import STATS_COLLECTION
    from scripts import lra_report

    length = 16
    model, params, batch, inputs = _tiny_sbm_classifier(length)
    monkeypatch.setattr(
        lra_report, "load_test_examples", lambda summary, num: (model, params, batch, inputs)
    )
    apply = jax.jit(
        lambda params, inputs: model.apply(
            {"params": params},
            **inputs,
            deterministic=True,
            rngs={"sample": jax.random.PRNGKey(0)},
            mutable=[STATS_COLLECTION],
        )[1]
    )
    sown = apply(params, inputs)
    layers = [sown[STATS_COLLECTION]["encoder"]["block_0"]["attention"]]

    got_in, query = lra_report.token_density_maps({}, 2)
    np.testing.assert_array_equal(got_in, batch["inputs"])
    assert query.shape == (2, 1, length)
    drawn = lra_report.density_map_figure({}, str(tmp_path / "fig7.png"), 2)
    assert os.path.getsize(drawn["path"]) > 0
    assert drawn["key_density"].shape == (2, 1, 2, length)
    for i, layer in enumerate(layers):
        np.testing.assert_allclose(query[:, i], np.mean(layer["query_density"][0], 1), rtol=1e-6)
        np.testing.assert_allclose(drawn["key_density"][:, i], layer["key_density"][0], rtol=1e-6)
        np.testing.assert_allclose(drawn["density"][:, i], layer["density"][0], rtol=1e-6)

    # Change what the layer sows: the report follows (it recomputes nothing itself).
    def marked(q_memb, block, k_memb, mask):
        b, h, n = q_memb.shape[:3]
        ramp = jax.numpy.broadcast_to(jax.numpy.arange(n) / n, (b, h, n))
        return ramp, 1.0 - ramp

    monkeypatch.setattr(sbm_module, "expected_token_densities", marked)
    drawn = lra_report.density_map_figure({}, str(tmp_path / "marked.png"), 2)
    ramp = np.arange(length) / length
    np.testing.assert_allclose(drawn["key_density"], np.broadcast_to(1.0 - ramp, (2, 1, 2, length)))
    # Layers come in depth order, block_10 after block_2.
    names = ["encoder/block_10/attention", "encoder/block_2/attention"]
    assert sorted(names, key=lra_report._natural) == names[::-1]
