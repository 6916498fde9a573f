"""Config presets and start-up validation: every message names its field."""

from __future__ import annotations

import os

import jax
import pytest

from configs import synthetic as synthetic_config
from sbm_jax.attention import available
from sbm_jax.training import ConfigError, prepare_output_dir, validate_config


def base():
    return synthetic_config.get_config("full,smoke")


def test_presets_parse_and_validate():
    for arg in ("full", "full,quick", "smoke,full", "full,paper"):
        config = synthetic_config.get_config(arg)
        validate_config(config, head="token", device_count=1)
    if "sbm" in available():
        for arg in ("sbm", "sbm_poisson", "quick", "smoke", "sbm,quick", "sbm_poisson,smoke"):
            config = synthetic_config.get_config(arg)
            validate_config(config, head="token", device_count=1)
            assert config.model.attention == "sbm"
        assert (
            synthetic_config.get_config("sbm_poisson").model.attention_options.edge_law == "poisson"
        )
        assert synthetic_config.get_config("sbm").model.attention_options.edge_law == "bernoulli"
    with pytest.raises(ValueError, match="unknown preset 'bogus'"):
        synthetic_config.get_config("full,bogus")


def test_paper_preset_matches_the_paper():
    config = synthetic_config.get_config("sbm")
    assert config.task.seq_len == 256 and config.model.vocab_size == 257
    assert (config.model.num_layers, config.model.num_heads, config.model.emb_dim) == (1, 1, 32)
    assert config.model.attention_options.num_clusters == 128
    assert (config.train.batch_size, config.train.num_steps) == (256, 2000)
    assert config.train.learning_rate == 1e-3 and config.model.dropout == 0.0


def test_seq_len_override_carries_to_vocab_and_positions():
    config = base()
    config.task.seq_len = 40
    assert config.model.vocab_size == 41 and config.model.max_len == 40


def expect_error(config, field, **kwargs):
    kwargs.setdefault("device_count", 1)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate_config(config, head="token", **kwargs)


def test_unknown_mechanism_names_model_attention():
    config = base()
    config.model.attention = "softmaxx"
    expect_error(config, "model.attention='softmaxx'")


def test_unknown_attention_option_names_it():
    config = base()
    config.model.attention_options = {"num_clusters": 3}
    expect_error(config, "model.attention_options.num_clusters")


def test_heads_times_head_dim_must_equal_width():
    config = base()
    config.model.head_dim = 5
    expect_error(config, "model.head_dim=5")


def test_batch_not_multiple_of_devices_names_train_batch_size():
    config = base()
    config.train.batch_size = 10
    expect_error(
        config,
        "train.batch_size=10 is not a multiple of 4, the devices on the mesh's data axis",
        device_count=4,
    )
    validate_config(config, head="token", device_count=2)  # 10 = 5 x 2 is fine


def test_float16_full_attention_is_refused_on_cpu_only():
    import jax

    config = base()
    config.model.dtype = "float16"
    if jax.default_backend() == "cpu":
        expect_error(
            config, "model.dtype='float16' with model.attention='full' does not run on CPU"
        )
    else:
        validate_config(config, head="token", device_count=1)


def test_encoder_aids_are_fields_of_every_encoder_config():
    """docs/mechanisms.md offers model.remat and model.scaled_residual_init for every
    mechanism: every config with an encoder has them (off), so the command line sets
    them; the TSA classifier has no encoder blocks and no such fields."""
    from configs import tsa_text
    from configs.glue import finetune, pretrain
    from configs.lra import image, listops, pathfinder, retrieval, text

    for module in (
        listops,
        text,
        retrieval,
        image,
        pathfinder,
        finetune,
        pretrain,
        synthetic_config,
    ):
        config = module.get_config("sbm,smoke")
        assert config.model.remat is False and config.model.scaled_residual_init is False
    assert "remat" not in tsa_text.get_config("smoke").model


def test_other_bad_fields_are_named():
    cases = [
        ("model", "dropout", 1.5, "model.dropout"),
        ("model", "pooling", "max", "model.pooling"),
        ("model", "query_key_init", "shared", "model.query_key_init"),
        ("model", "position_embedding", "rotary", "model.position_embedding"),
        ("model", "dtype", "float8", "model.dtype"),
        ("model", "num_layers", 0, "model.num_layers"),
        ("train", "learning_rate", -1.0, "train.learning_rate"),
        ("train", "warmup_steps", 10_000, "train.warmup_steps"),
        ("train", "density_lambda", float("nan"), "train.density_lambda"),
        ("train", "num_steps", 0, "train.num_steps"),
        ("train", "weight_decay_mask", "biases", "train.weight_decay_mask"),
        ("checkpoint", "best_metric", "loss", "checkpoint.best_metric='loss' with"),
    ]
    for section, name, value, field in cases:
        config = base()
        config[section][name] = value
        expect_error(config, field)
    config = base()
    config.task.name = "synthetik"
    from sbm_jax.tasks import task_config_errors

    (message,) = task_config_errors(config)
    assert "task.name='synthetik' is not a known task (did you mean 'synthetic'?)" in message


def test_all_errors_are_reported_together():
    config = base()
    config.model.attention = "nope"
    config.train.learning_rate = 0.0
    with pytest.raises(ConfigError) as info:
        validate_config(config, device_count=1)
    assert "model.attention" in str(info.value) and "train.learning_rate" in str(info.value)


def test_output_dir_that_cannot_be_created_names_output_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="output_dir="):
        prepare_output_dir(str(blocker / "run"))
    made = prepare_output_dir(str(tmp_path / "a" / "b"))
    assert os.path.isdir(made)


@pytest.mark.parametrize("part", ["checkpoints", "checkpoints/best", "tensorboard"])
def test_a_run_folder_whose_parts_cannot_be_written_is_refused_before_training(part, tmp_path):
    """A file where the run keeps a directory used to fail at the first checkpoint save
    (or first metrics write) with a traceback, after the training it could not save."""
    run = tmp_path / "run"
    (run / part).parent.mkdir(parents=True, exist_ok=True)
    (run / part).write_text("in the way")
    with pytest.raises(ConfigError, match=f"output_dir=.*: {part} is not a directory"):
        prepare_output_dir(str(run))
    (run / part).unlink()
    (run / "metrics.jsonl").mkdir()
    with pytest.raises(ConfigError, match="metrics.jsonl is a directory"):
        prepare_output_dir(str(run))


def test_a_read_only_checkpoints_folder_is_refused_before_training(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    if os.geteuid() != 0:
        (run / "checkpoints").mkdir()
        (run / "checkpoints").chmod(0o500)
    else:
        # Root writes through a chmod (CI runs the tests as root), and os.access says yes
        # to root; a procfs directory refuses new files to everyone.
        if not os.path.isdir("/proc/self"):
            pytest.skip("no procfs: no directory root cannot write into")
        (run / "checkpoints").symlink_to("/proc/self")
    try:
        with pytest.raises(ConfigError, match="checkpoints/ is not writable"):
            prepare_output_dir(str(run))
    finally:
        if not (run / "checkpoints").is_symlink():
            (run / "checkpoints").chmod(0o700)


SNAPSHOT = os.path.join(os.path.dirname(__file__), "fixtures", "config_presets.json")


def _flatten(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; an empty section stays ``{}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return out


def _snapshot_configs(module_entries: dict) -> dict:
    """Each preset's flat config: the fixture stores one base per module (key "") and,
    per preset, the changes from the entry named in "from" ("-": keys removed)."""
    flat = {"": module_entries[""]}
    for arg, entry in module_entries.items():
        if arg:
            changes = {k: v for k, v in entry.items() if k not in ("from", "-")}
            ref = flat[entry["from"]]
            flat[arg] = {k: v for k, v in ref.items() if k not in entry.get("-", ())} | changes
    return flat


def test_every_preset_resolves_as_before_the_shared_table():
    """get_config(arg).to_dict() of every config module, for every mechanism x scale and
    some lambda / seed / task cases, equals the snapshot taken from main at 70cb55a,
    before the three preset parsers and option tables became configs/presets.py."""
    import importlib
    import json

    with open(SNAPSHOT, encoding="utf-8") as f:
        snapshot = json.load(f)
    assert len(snapshot) == 9
    for module_name, entries in snapshot.items():
        module = importlib.import_module(module_name)
        for arg, expected in _snapshot_configs(entries).items():
            got = _flatten(module.get_config(arg or None).to_dict())
            # json.dumps per value: 0 and 0.0, 1 and True stay different.
            assert {k: json.dumps(v) for k, v in got.items()} == {
                k: json.dumps(v) for k, v in expected.items()
            }, f"{module_name}:{arg}"


def test_preset_errors_name_the_bad_part_and_the_choices():
    from configs import presets
    from configs.glue import finetune, pretrain
    from configs.lra import listops
    from configs.tsa_text import get_config as tsa_config

    with pytest.raises(ValueError, match=r"unknown preset 'bogus' in 'full,bogus'; .*'quick'"):
        synthetic_config.get_config("full,bogus")
    with pytest.raises(ValueError, match="unknown preset 'seed=1'"):
        synthetic_config.get_config("seed=1")  # the synthetic presets take no seed
    with pytest.raises(ValueError, match=r"'task=sst2'.*scales \('paper', 'smoke'\)$"):
        pretrain.get_config("sbm,task=sst2")
    assert finetune.get_config("full,smoke,task=qnli").task.name == "glue_qnli"
    with pytest.raises(ValueError, match=r"unknown preset 'reduced'.*task=<name>"):
        finetune.get_config("reduced")
    with pytest.raises(ValueError, match="seed must be an integer"):
        listops.get_config("seed=1.5")
    with pytest.raises(ValueError, match="lambda must be >= 0"):
        listops.get_config("lambda=-1")
    # Two parts of one kind: an error, not the last one silently winning.
    with pytest.raises(
        ValueError, match=r"presets 'sbm' and 'full' in 'sbm,full,smoke' both set the mechanism"
    ):
        listops.get_config("sbm,full,smoke")
    with pytest.raises(ValueError, match="presets 'smoke' and 'paper' .* both set the scale"):
        listops.get_config("full,smoke,paper")
    with pytest.raises(ValueError, match="presets 'seed=1' and 'seed=2' .* both set the seed"):
        listops.get_config("seed=1,seed=2")
    with pytest.raises(ValueError, match="both set the scale"):
        synthetic_config.get_config("quick,smoke")
    with pytest.raises(ValueError, match=r"unknown preset 'full'.*mechanisms \('tsa',\)"):
        tsa_config("full,smoke")
    with pytest.raises(ValueError, match="unknown scale 'quick'"):
        presets.attention_options("sbm", "quick", 64)
    with pytest.raises(ValueError, match=r"no options \['window'\]"):
        presets.attention_options("performer", "paper", 64, fields=("window",))
    with pytest.raises(ValueError, match=r"overrides \['window'\]"):
        presets.attention_options("sbm", "paper", 64, window=3)  # window is not shown


def test_option_table_scales_inherit_and_follow_the_length():
    from configs import presets

    sbm = presets.OPTIONS["sbm"]
    assert [sbm["num_clusters"].at(s, 100) for s in presets.SCALES] == [128, 128, 8, 4]
    assert [sbm["dense_below"].at(s, 100) for s in presets.SCALES] == [0, 100 * 100, 0, 0]
    assert presets.attention_options("linformer", "smoke", 48).to_dict() == {
        "proj_len": 8,
        "max_len": 48,
    }
    poisson = presets.attention_options("sbm_poisson", "paper", 64, edge_law="bernoulli")
    assert poisson.edge_law == "bernoulli"  # an explicit override beats the variant's value
    assert presets.attention_options("sbm_poisson", "paper", 64).edge_law == "poisson"
    assert presets.registry_name("sbm_nowindow") == "sbm"
    assert presets.attention_options("linear", "smoke", 8).to_dict() == {}
    # Full attention's query block is the layer's automatic one (0): 2^19 scores per
    # (example, head) per block, in [16, 512] queries.
    from sbm_jax.attention.full import default_query_chunk

    full = [presets.attention_options("full", "paper", n).to_dict() for n in (8, 4096, 16384)]
    assert [f["query_chunk"] for f in full] == [0, 0, 0]
    assert [default_query_chunk(n) for n in (8, 1024, 4096, 16384, 2**20)] == [
        512,
        512,
        128,
        32,
        16,
    ]
    assert {f["implementation"] for f in full} == {"auto"}


def _diff(flat: dict, ref: dict) -> dict:
    """The fixture's form of ``flat`` relative to ``ref`` (see ``_snapshot_configs``)."""
    changes = {k: v for k, v in flat.items() if k not in ref or ref[k] != v}
    removed = sorted(k for k in ref if k not in flat)
    return changes | ({"-": removed} if removed else {})


def write_snapshot(path: str = SNAPSHOT) -> None:
    """Rewrite the fixture from the configs as they are now, for the presets it lists
    (after a deliberate config change: ``python -m tests.test_config``). Each preset is
    stored as its changes from whichever earlier entry it differs least from."""
    import importlib
    import json

    with open(path, encoding="utf-8") as f:
        listed = {module: [a for a in entries if a] for module, entries in json.load(f).items()}
    blocks = []
    for module_name, args in listed.items():
        module = importlib.import_module(module_name)
        done = {"": _flatten(module.get_config().to_dict())}
        lines = [f'  "": {json.dumps(done[""], sort_keys=True)}']
        for arg in args:
            flat = _flatten(module.get_config(arg).to_dict())
            ref = min(done, key=lambda r: len(json.dumps(_diff(flat, done[r]))))
            entry = _diff(flat, done[ref]) | {"from": ref}
            lines.append(f"  {json.dumps(arg)}: {json.dumps(entry, sort_keys=True)}")
            done[arg] = flat
        blocks.append(f" {json.dumps(module_name)}: {{\n" + ",\n".join(lines) + "\n }")
    with open(path, "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(blocks) + "\n}\n")


if __name__ == "__main__":
    write_snapshot()


def test_tied_query_key_init_is_refused_for_mechanisms_without_both_projections():
    """query_key_init='tied' copies the query projection over the key projection:
    Reformer (one shared projection) and TSA (no query) used to fail with a traceback at
    the first model init, after the data was built; the config check now says so."""
    from configs import synthetic
    from sbm_jax.attention import available
    from sbm_jax.training.config_checks import config_errors

    refused = []
    for name in available():
        config = synthetic.get_config(f"{name},smoke")
        config.model.query_key_init = "tied"
        errors = [e for e in config_errors(config) if "query_key_init='tied'" in e]
        if errors:
            assert "to have 'query' and 'key' projections" in errors[0], errors
            refused.append(name)
    assert refused == ["reformer", "tsa"]


# Bad attention options of the baselines, each refused by the start-up check (and so by
# --dry_run) on one line naming the field, instead of a traceback at model init. The
# smoke preset has seq_len 16 = model.max_len (default stride 4).
BAD_BASELINE_OPTIONS = [
    ("linformer", "proj_len", 0, "proj_len must be an int >= 1, got 0"),
    ("linformer", "max_len", 8, "max_len=8 is shorter than the input length 16"),
    ("nystromformer", "num_landmarks", 0, "num_landmarks must be an int >= 1, got 0"),
    ("nystromformer", "pinv_iterations", -1, "pinv_iterations must be an int >= 0, got -1"),
    ("nystromformer", "conv_kernel_size", -3, "conv_kernel_size must be an int >= 0, got -3"),
    ("reformer", "num_buckets", 3, "num_buckets must be 1 or an even number >= 2, got 3"),
    ("reformer", "num_buckets", 0, "num_buckets must be an int >= 1, got 0"),
    ("reformer", "num_buckets", 4.0, "num_buckets must be an int >= 1, got 4.0"),
    ("reformer", "num_hashes", 0, "num_hashes must be an int >= 1, got 0"),
    ("reformer", "chunk_len", 0, "chunk_len must be an int >= 1, got 0"),
    ("local", "window", -1, "window must be an int >= 0, got -1"),
    ("linear", "eps", -1.0, "eps must be a number >= 0.0, got -1.0"),
    ("sparse_fixed", "c", 100, "c must be in [1, stride=4, the default for length 16], got 100"),
    ("sparse_fixed", "c", 2.0, "c must be an int >= 1, got 2.0"),
    ("sparse_strided", "stride", 3.0, "stride must be an int >= 1, got 3.0"),
    ("performer", "num_features", 0, "num_features must be an int >= 1, got 0"),
]


@pytest.mark.parametrize("name, option, value, message", BAD_BASELINE_OPTIONS)
def test_bad_baseline_options_are_refused_on_one_line(name, option, value, message):
    from sbm_jax.training.config_checks import config_errors

    config = synthetic_config.get_config(f"{name},smoke")
    config.model.attention_options[option] = value
    errors = [e for e in config_errors(config) if "attention" in e]
    assert errors == [errors[0]] and "\n" not in errors[0], errors
    assert errors[0].startswith(f"model.attention_options.{option}"), errors
    assert message in errors[0], errors


def test_baseline_option_check_uses_the_cls_slot():
    """With pooling='cls' the attention sees model.max_len + 1 positions."""
    from sbm_jax.training.config_checks import config_errors

    config = synthetic_config.get_config("linformer,smoke")
    assert not [e for e in config_errors(config) if "attention" in e]
    config.model.pooling = "cls"
    (error,) = [e for e in config_errors(config) if "attention" in e]
    assert "max_len=16 is shorter than the input length 17" in error


def test_sbm_options_no_path_fits_are_refused_before_anything_is_built():
    # The budgets are checked against every batch the run traces: the training
    # (micro-)batch and the evaluation batch, whose size may differ.
    from configs.lra import listops
    from sbm_jax.training.config_checks import config_errors

    config = synthetic_config.get_config("sbm,smoke")  # 16 x 16, 1 head: 4096 pairs
    with config.unlocked():
        config.model.attention_options.max_dense_elements = 1
        config.model.attention_options.max_edge_slots = 1
    (message,) = config_errors(config, head="token", device_count=1)
    assert message.startswith("model.attention_options for the training batch of 16 x 16")
    assert "max_dense_elements >= batch*heads*n*m = 4096" in message
    # micro-batches of 4: 1024 pairs fit a budget the whole batch exceeds
    with config.unlocked():
        config.model.attention_options.max_dense_elements = 1024
        config.train.max_per_device_batch = 4
    assert config_errors(config, head="token", device_count=1) == []
    config = listops.get_config("sbm,smoke")
    length = config.model.max_len + (config.model.pooling == "cls")
    with config.unlocked():
        config.task.eval_batch_size = 2 * config.train.batch_size
        config.model.attention_options.impl = "dense"
        config.model.attention_options.max_dense_elements = config.train.batch_size * 2 * length**2
    (message,) = config_errors(config, head="classification", device_count=1)
    assert "for the evaluation batch (task.eval_batch_size)" in message


def test_parameters_are_initialised_on_one_row_whatever_the_batch():
    # the SBM budgets are set for the micro-batch; tracing init on the whole global
    # batch failed with them, and the parameters do not depend on the batch
    import numpy as np

    from sbm_jax.models import build_model
    from sbm_jax.tasks import build_task
    from sbm_jax.training import create_train_state

    config = synthetic_config.get_config("sbm,smoke")
    with config.unlocked():
        config.model.attention_options.impl = "dense"
        config.model.attention_options.max_dense_elements = 2 * 16 * 16  # one sequence
    task = build_task(config)
    batch = next(task.train_batches(0))
    model = build_model(config.model, task.head)
    state = create_train_state(config, model, task, batch)
    one = create_train_state(config, model, task, {k: v[:1] for k, v in batch.items()})
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(one.params), strict=True):
        np.testing.assert_array_equal(a, b)
