"""Start-up checks of a training config; every message names the offending field.

``config_errors`` lists every problem of the sections the trainer reads (``model`` with
every attention option, ``train``, ``checkpoint``, ``mesh``), without building a model,
touching data or creating a directory; ``validate_config`` raises them as one
``ConfigError`` on one line, each message starting with the field as it is written on
the command line (``config.model.attention_options.delta must lie in [0, 1] (a
probability), got -1``).
``closest_field`` names the nearest existing field for an unknown one.

Decisions:
* ``model.num_heads * model.head_dim`` must equal ``model.emb_dim``. Every mechanism
  projects its heads back to ``emb_dim`` itself, so another width would run, but the
  paper's settings (and every preset here) use heads x head_dim = width and a mismatch
  is far more often a typo than a choice.
* ``train.batch_size`` must be a multiple of the devices of the mesh's ``data`` axis
  (the batch axis is split evenly over it).
* Attention options are checked by the mechanism itself where it has a ``validate()``
  (SBM: ``delta``, ``edge_law``, ``impl``, ``capacity_buckets`` ...), and otherwise by
  type against the option's default; a check that needs the run's batch sizes hangs on
  the mechanism's registry entry (``config_check``; SBM's in
  ``sbm_jax/attention/sbm_checks.py``).
"""

from __future__ import annotations

import difflib
import inspect
import math
from collections.abc import Iterable, Mapping
from typing import Any

from sbm_jax.attention import get_attention
from sbm_jax.attention.registry import get_mechanism
from sbm_jax.config_defaults import DEFAULTS, field
from sbm_jax.models import HEAD_KINDS, POOLING_MODES, model_dtype
from sbm_jax.models.build import ENCODER_DEFAULTS
from sbm_jax.models.encoder import POSITION_EMBEDDINGS, QUERY_KEY_INITS
from sbm_jax.training.errors import ConfigError
from sbm_jax.training.state import WEIGHT_DECAY_MASKS


def with_config_prefix(message: str, config: Any = None) -> str:
    """``"model.x=1 ..."`` -> ``"config.model.x=1 ..."`` when the message starts with a
    config field (a top-level key of ``config``, or a usual section name)."""
    if message.startswith("config."):
        return message
    keys = set(config.keys()) if config is not None and hasattr(config, "keys") else set()
    keys |= {"model", "train", "task", "checkpoint", "mesh", "data", "init_from", "output_dir"}
    head = message.split(" ", 1)[0]
    for key in keys:
        if head == key or head.startswith((f"{key}.", f"{key}=")):
            return "config." + message
    return message


def one_line(errors: Iterable[str], config: Any = None) -> str:
    """Messages joined into one line, each field prefixed with ``config.``."""
    return "; ".join(with_config_prefix(" ".join(str(e).split()), config) for e in errors)


def _positive_int(errors: list[str], section: Any, prefix: str, name: str) -> None:
    value = section.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        errors.append(f"{prefix}.{name}={value!r} must be a positive integer")


def _rate(errors: list[str], section: Any, prefix: str, name: str) -> None:
    value = section.get(name)
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        errors.append(f"{prefix}.{name}={value!r} must be a rate in [0, 1)")


def _flag(errors: list[str], section: Any, prefix: str, name: str, default: bool) -> None:
    if not isinstance(section.get(name, default), bool):
        errors.append(f"{prefix}.{name}={section.get(name)!r} must be True or False")


def _type_matches(value: Any, default: Any) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, tuple):
        return isinstance(value, (tuple, list))
    return True


def _longest_attention_input(model: Any) -> int | None:
    """The longest sequence the attention layers see: ``model.max_len`` (the longest
    input the encoder takes), plus the CLS slot with ``pooling="cls"``; None when
    ``model.max_len`` is not a positive int (reported by check_model)."""
    max_len = model.get("max_len")
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        return None
    return max_len + (1 if model.get("pooling") == "cls" else 0)


def _given_options(model: Any) -> dict[str, Any]:
    """``model.attention_options`` as a plain dict, its values as the config gives them."""
    options = model.get("attention_options") or {}
    return options.to_dict() if hasattr(options, "to_dict") else dict(options)


def _as_fields(options: Mapping[str, Any]) -> dict[str, Any]:
    """Options as the module's fields hold them: lists (JSON, the command line) as tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def _compute_dtype(model: Any) -> dict[str, Any]:
    """``{"dtype": <model.dtype>}`` as the encoder passes it to the attention layer (a
    mechanism's validate() may depend on it: full attention's cuDNN implementation), or
    ``{}`` when ``model.dtype`` is bad (reported by check_model)."""
    try:
        return {"dtype": model_dtype(str(model.get("dtype", "float32")))}
    except ValueError:
        return {}


def check_attention_options(model: Any, errors: list[str]) -> None:
    """Append a message per bad ``model.attention`` / ``model.attention_options.*``."""
    try:
        cls = get_attention(str(model.get("attention")), field="model.attention")
    except ValueError as e:
        errors.append(str(e))
        return
    options = _given_options(model)
    defaults = get_mechanism(str(model.get("attention"))).option_defaults()
    known = set(defaults)
    unknown = [key for key in options if key not in known]
    if len(unknown) == 1:
        (key,) = unknown
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        errors.append(
            f"model.attention_options.{key} is not an option of attention "
            f"{model.attention!r}{hint}; its options are {sorted(known)}"
        )
    elif unknown:
        # Typically a preset's options left behind by --config.model.attention=<other>:
        # one message, not one per option.
        errors.append(
            f"model.attention_options {unknown} are not options of attention "
            f"{model.attention!r} (another mechanism's options, after changing "
            f"model.attention?); its options are {sorted(known)}"
        )
    bad = bool(unknown)
    for key, value in options.items():
        if key not in known:
            continue
        default = defaults[key]
        if not _type_matches(value, default):
            errors.append(
                f"model.attention_options.{key}={value!r} must be a "
                f"{type(default).__name__} like its default {default!r}"
            )
            bad = True
    if bad:
        return
    options = _as_fields(options)
    try:
        # Building the module runs the checks a mechanism makes at construction (the
        # sparse patterns' impl, stride and c); validate() those it keeps there, given
        # the longest input length where it takes one (Linformer's max_len, the fixed
        # pattern's c against the default stride).
        module = cls(
            num_heads=model.get("num_heads"),
            head_dim=model.get("head_dim"),
            out_dim=model.get("emb_dim"),  # as the encoder builds it
            attention_dropout=model.get("attention_dropout", 0.0),
            **_compute_dtype(model),
            **options,
        )
        validate = getattr(module, "validate", None)
        if validate is not None:
            if "seq_len" in inspect.signature(validate).parameters:
                validate(seq_len=_longest_attention_input(model))
            else:
                validate()
        if model.get("query_key_init") == "tied":
            _check_tied_projections(module, model, errors)
    except (TypeError, ValueError) as e:
        message = str(e)
        name = message.replace("=", " ").split(" ", 1)[0]
        if message.startswith("model."):  # the module named the field itself
            errors.append(message)
        elif name in options or name in known:
            errors.append(f"model.attention_options.{message}")
        elif name in ("num_heads", "head_dim", "out_dim", "attention_dropout"):
            # The same field's own check (check_model) has already said so: one message.
            field = "emb_dim" if name == "out_dim" else name
            if not any(e.startswith(f"model.{field}=") for e in errors):
                errors.append(f"model.{message}")
        else:
            errors.append(f"model.attention_options (attention {model.attention!r}): {message}")


def _check_tied_projections(module: Any, model: Any, errors: list[str]) -> None:
    """``query_key_init="tied"`` copies the query projection over the key projection:
    the mechanism needs both (Reformer shares one, TSA has no query), which its
    parameters, from an abstract init (no computation), tell. A mechanism that cannot be
    initialised on this small input is left to the model's own error."""
    import jax
    import jax.numpy as jnp

    length = max(1, min(16, int(model.get("max_len") or 16)))
    x = jax.ShapeDtypeStruct((1, length, int(model.get("emb_dim"))), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, length), jnp.bool_)
    try:
        shapes = jax.eval_shape(
            lambda x, mask: module.init(jax.random.PRNGKey(0), x, mask, deterministic=True),
            x,
            mask,
        )
    except Exception:  # noqa: BLE001 (checked again, with a message, when the model is built)
        return
    names = sorted(shapes.get("params", {}))
    if "query" not in names or "key" not in names:
        errors.append(
            f"model.query_key_init='tied' needs attention {model.get('attention')!r} to have "
            f"'query' and 'key' projections, and its parameters are {names}; use "
            "query_key_init='independent'"
        )


#: Encoder fields that the TSA paper's classifier (``model.architecture="tsa_classifier"``,
#: one TSA layer, average pooling, its own dense layer) does not read: set, they would be
#: silently ignored.
TSA_CLASSIFIER_UNUSED = (
    "mlp_dim",
    "pooling",
    "remat",
    "scaled_residual_init",
    "final_norm",
    "query_key_init",
    "position_embedding",
)


def check_model(model: Any, errors: list[str]) -> None:
    """Append a message per bad ``model.*`` field to ``errors``."""
    tsa_classifier = model.get("architecture", "encoder") == "tsa_classifier"
    for name in (
        "vocab_size",
        "max_len",
        "emb_dim",
        "num_layers",
        "num_heads",
        "head_dim",
        "num_classes",
    ) + (() if tsa_classifier else ("mlp_dim",)):
        _positive_int(errors, model, "model", name)
    if tsa_classifier:
        if model.get("num_layers") != 1:
            errors.append(
                f"model.num_layers={model.get('num_layers')!r}: "
                "model.architecture='tsa_classifier' has one TSA layer; set it to 1"
            )
        for name in TSA_CLASSIFIER_UNUSED:
            if name in model:
                errors.append(
                    f"model.{name} is not read by model.architecture='tsa_classifier' "
                    "(one TSA layer, average pooling, then model.classifier_dim units); "
                    "remove it"
                )
    if "classifier_dim" in model:
        _positive_int(errors, model, "model", "classifier_dim")
    _rate(errors, model, "model", "dropout")
    _rate(errors, model, "model", "attention_dropout")
    heads, head_dim, emb_dim = model.get("num_heads"), model.get("head_dim"), model.get("emb_dim")
    if all(isinstance(v, int) and v > 0 for v in (heads, head_dim, emb_dim)):
        if heads * head_dim != emb_dim:
            errors.append(
                f"model.head_dim={head_dim} times model.num_heads={heads} is {heads * head_dim}, "
                f"but must equal model.emb_dim={emb_dim}"
            )
    for name in ("remat", "scaled_residual_init", "final_norm"):  # optional flags
        _flag(errors, model, "model", name, ENCODER_DEFAULTS[name])
    for name, choices in (
        ("query_key_init", QUERY_KEY_INITS),
        ("position_embedding", POSITION_EMBEDDINGS),
    ):
        if model.get(name, ENCODER_DEFAULTS[name]) not in choices:
            errors.append(f"model.{name}={model.get(name)!r} must be one of {choices}")
    if not tsa_classifier and model.get("pooling") not in POOLING_MODES:
        errors.append(f"model.pooling={model.get('pooling')!r} must be one of {POOLING_MODES}")
    try:
        model_dtype(str(model.get("dtype", "float32")))
    except ValueError as e:
        errors.append(str(e))
    if model.get("dtype") == "float16" and model.get("attention") == "full":
        import jax

        if jax.default_backend() == "cpu":
            # jax.nn.dot_product_attention asks XLA for a float16 x float16 -> float32
            # product, which XLA's CPU backend does not have (GPUs run it).
            errors.append(
                "model.dtype='float16' with model.attention='full' does not run on CPU "
                "(XLA's CPU dot has no float16 inputs with float32 accumulation); use "
                "bfloat16 or float32"
            )
    check_attention_options(model, errors)


#: The largest step count: ``TrainState.step`` and the schedules' step are int32.
MAX_STEP = 2**31 - 1


def check_train(train: Any, device_count: int, errors: list[str]) -> None:
    """Append a message per bad ``train.*`` field to ``errors``."""
    for name in ("batch_size", "num_steps", "log_every"):
        _positive_int(errors, train, "train", name)
    for name in ("num_steps", "warmup_steps", "log_every", "eval_every"):
        value = train.get(name, 0)
        if isinstance(value, int) and value > MAX_STEP:
            errors.append(f"train.{name}={value} exceeds {MAX_STEP} (the step counter is an int32)")
    batch = train.get("batch_size")
    if isinstance(batch, int) and batch > 0 and batch % device_count:
        errors.append(
            f"train.batch_size={batch} is not a multiple of {device_count}, the devices on "
            "the mesh's data axis (mesh.data; the batch is split evenly over them)"
        )
    lr = train.get("learning_rate")
    if not isinstance(lr, (int, float)) or lr <= 0:
        errors.append(f"train.learning_rate={lr!r} must be a positive number")
    eps = train.get("eps", DEFAULTS["train.eps"])  # 0 divides by zero at a flat start
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        errors.append(f"train.eps={eps!r} must be a positive number")
    warmup, steps = train.get("warmup_steps"), train.get("num_steps")
    if not isinstance(warmup, int) or warmup < 0:
        errors.append(f"train.warmup_steps={warmup!r} must be a non-negative integer")
    elif isinstance(steps, int) and warmup > steps:
        errors.append(
            f"train.warmup_steps={warmup} exceeds train.num_steps={steps} (a run cut "
            "short needs its warm-up cut too: --config.train.warmup_steps)"
        )
    factor = train.get("end_learning_rate_factor")
    if not isinstance(factor, (int, float)) or not 0.0 <= factor <= 1.0:
        errors.append(f"train.end_learning_rate_factor={factor!r} must lie in [0, 1]")
    for name in ("weight_decay", "grad_clip_norm"):
        value = train.get(name)
        if not isinstance(value, (int, float)) or value < 0:
            errors.append(f"train.{name}={value!r} must be a non-negative number")
    mask = train.get("weight_decay_mask", DEFAULTS["train.weight_decay_mask"])
    if mask not in WEIGHT_DECAY_MASKS:
        errors.append(
            f"train.weight_decay_mask={mask!r} must be one of {WEIGHT_DECAY_MASKS} "
            "('matrices': only parameters of two or more dimensions decay)"
        )
    # The paper's regulariser (lambda > 0) penalises density; a negative weight rewards
    # it, pushing the graph toward full attention (docs/synthetic.md uses it as an
    # ablation). Any finite number is accepted.
    lam = train.get("density_lambda")
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam):
        errors.append(f"train.density_lambda={lam!r} must be a finite number")
    for name in ("b1", "b2"):
        _rate(errors, train, "train", name)
    for name in ("eval_every", "max_per_device_batch"):
        value = train.get(name, DEFAULTS[f"train.{name}"])
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            errors.append(f"train.{name}={value!r} must be a non-negative integer")
    _flag(errors, train, "train", "halt_on_nonfinite", DEFAULTS["train.halt_on_nonfinite"])
    if "num_epochs" in train:
        epochs = train.get("num_epochs")
        if not isinstance(epochs, (int, float)) or isinstance(epochs, bool) or epochs < 0:
            errors.append(f"train.num_epochs={epochs!r} must be a non-negative number")
    if "warmup_fraction" in train:
        _rate(errors, train, "train", "warmup_fraction")


def check_checkpoint(checkpoint: Any, errors: list[str]) -> None:
    """Append a message per bad ``checkpoint.*`` field (all optional) to ``errors``."""
    for name in ("every_steps", "max_to_keep"):
        value = checkpoint.get(name, DEFAULTS[f"checkpoint.{name}"])
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            errors.append(f"checkpoint.{name}={value!r} must be an integer >= 1")
    mode = checkpoint.get("best_mode", DEFAULTS["checkpoint.best_mode"])
    if mode not in ("max", "min"):
        errors.append(f"checkpoint.best_mode={mode!r} must be 'max' or 'min'")
    metric = checkpoint.get("best_metric", DEFAULTS["checkpoint.best_metric"])
    if not isinstance(metric, str) or not metric:
        errors.append(f"checkpoint.best_metric={metric!r} must name a dev metric")
    elif metric.endswith("loss") and mode == "max":
        # the best checkpoint would be the one with the highest loss
        errors.append(
            f"checkpoint.best_metric={metric!r} with checkpoint.best_mode='max' keeps the "
            "checkpoint of highest loss; set --config.checkpoint.best_mode=min"
        )


def check_mesh(mesh: Any, model: Any, errors: list[str]) -> None:
    """Append a message per bad ``mesh.*`` field (devices are checked at start-up)."""
    data, heads = mesh.get("data", DEFAULTS["mesh.data"]), mesh.get("heads", DEFAULTS["mesh.heads"])
    for name, value in (("data", data), ("heads", heads)):
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"mesh.{name}={value!r} must be an integer")
            return
    if heads < 1:
        errors.append(f"mesh.heads={heads} must be >= 1")
    if data != -1 and data < 1:
        errors.append(f"mesh.data={data} must be -1 or >= 1")
    num_heads = model.get("num_heads")
    if heads > 1 and isinstance(num_heads, int) and num_heads % heads:
        errors.append(
            f"mesh.heads={heads} must divide model.num_heads={num_heads} (each device holds "
            "the same number of heads)"
        )


def _traced_batches(config: Any, device_count: int) -> list[tuple[str, int]]:
    """``(what, rows)`` of every batch the attention layers are traced with: the
    training micro-batch (``train.batch_size`` over its accumulation passes) and the
    evaluation batch where the config names one (``task.eval_batch_size`` /
    ``train.eval_batch_size``, 0: the training batch). Under ``jit`` a layer sees the
    global batch."""
    from sbm_jax.training.host_data import accumulation_steps

    train, task = config.train, config.get("task") or {}
    batch = train.get("batch_size")
    if not isinstance(batch, int) or batch < 1 or batch % device_count:
        return []  # reported by check_train
    maximum = train.get("max_per_device_batch", DEFAULTS["train.max_per_device_batch"])
    accum = accumulation_steps(batch, device_count, maximum if isinstance(maximum, int) else 0)
    batches = [("the training micro-batch" if accum > 1 else "the training batch", batch // accum)]
    for section, name in ((task, "task"), (train, "train")):
        size = section.get("eval_batch_size", 0) if hasattr(section, "get") else 0
        if isinstance(size, int) and size > 0:
            batches.append((f"the evaluation batch ({name}.eval_batch_size)", size))
    return batches


def check_mechanism(config: Any, device_count: int, errors: list[str]) -> None:
    """The configured mechanism's own check of the run (its registry entry's
    ``config_check``, e.g. SBM's: a path must fit every batch the run traces), on the
    attention module as the encoder builds it. Only for the encoder architecture."""
    model = config.model
    if model.get("architecture", "encoder") != "encoder":
        return
    entry = get_mechanism(str(model.get("attention")))
    if entry.config_check is None:
        return
    module = entry.module(
        num_heads=model.num_heads,
        head_dim=model.head_dim,
        out_dim=model.get("emb_dim"),
        attention_dropout=model.get("attention_dropout", 0.0),
        **_compute_dtype(model),
        **_as_fields(_given_options(model)),
    )
    length = _longest_attention_input(model)
    if length is None:
        return  # reported by check_model
    errors.extend(entry.config_check(module, _traced_batches(config, device_count), length))


def nonfinite_fields(config: Any, prefix: str = "") -> list[str]:
    """``"<field>=nan must be a finite number"`` for every float field of ``config``
    (any section, attention options included) that holds NaN or an infinity: no field
    of these configs means anything at a non-finite value, and a NaN learning rate or
    weight decay would otherwise train until the non-finite guard halts the run."""
    out = []
    items = config.items() if hasattr(config, "items") else ()
    for key, value in items:
        if hasattr(value, "items"):
            out += nonfinite_fields(value, f"{prefix}{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            out.append(f"{prefix}{key}={value!r} must be a finite number")
    return out


def without_repeats(first: list[str], others: Iterable[str]) -> list[str]:
    """``first`` then those of ``others`` about a field no message of ``first`` names
    (a NaN is reported once, as non-finite, not again by the field's own range check)."""
    fields = [m.split("=", 1)[0] for m in first]

    def named(message: str) -> bool:
        bare = message.removeprefix("config.")
        return any(bare.startswith((f"{f}=", f"{f} ")) for f in fields)

    return first + [m for m in others if not named(m)]


def config_errors(
    config: Any, *, head: str | None = None, device_count: int | None = None
) -> list[str]:
    """Every problem of ``config``'s ``model``, ``train``, ``checkpoint`` and ``mesh``
    sections (``task`` is checked by the task registry), as messages naming the field.

    Args:
      config: the full training config.
      head: the head the task asks for; checked against the known head kinds.
      device_count: devices the batch is split over (default: the mesh's ``data`` axis
        as configured, or ``jax.device_count()``).
    """
    errors: list[str] = []
    for section in ("task", "model", "train"):
        if section not in config:
            errors.append(f"config has no {section!r} section")
    if errors:
        return errors
    if head is not None and head not in HEAD_KINDS:
        errors.append(f"task head {head!r} is not one of {HEAD_KINDS}")
    if device_count is None:
        import jax

        data, heads = field(config, "mesh.data"), field(config, "mesh.heads")
        if isinstance(data, int) and data >= 1:
            device_count = data
        elif isinstance(heads, int) and heads >= 1 and jax.device_count() % heads == 0:
            device_count = jax.device_count() // heads
        else:
            device_count = jax.device_count()
    check_model(config.model, errors)
    check_train(config.train, device_count, errors)
    check_checkpoint(config.get("checkpoint") or {}, errors)
    check_mesh(config.get("mesh") or {}, config.model, errors)
    nonfinite = nonfinite_fields(config)
    if not errors and not nonfinite:  # the sizes below assume the fields checked above
        check_mechanism(config, device_count, errors)
    for name in ("output_dir", "init_from"):
        value = field(config, name) if name == "init_from" else config.get(name, "")
        if not isinstance(value, str):
            errors.append(f"{name}={value!r} must be a path (a string)")
    return without_repeats(nonfinite, errors)


def validate_config(
    config: Any, *, head: str | None = None, device_count: int | None = None
) -> None:
    """Raise ``ConfigError`` naming every bad field of ``config`` (``config_errors``),
    in one line."""
    errors = config_errors(config, head=head, device_count=device_count)
    if errors:
        raise ConfigError(one_line(errors, config))


def _leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    out = []
    if isinstance(tree, Mapping) or hasattr(tree, "items"):
        for key, value in tree.items():
            out.append(f"{prefix}{key}")
            out.extend(_leaf_paths(value, f"{prefix}{key}."))
    return out


def closest_field(config: Any, path: str) -> str | None:
    """The existing field of ``config`` nearest to the dotted ``path`` (first its
    siblings, then every field), or None."""
    fields = _leaf_paths(config)
    parent, _, name = path.rpartition(".")
    siblings = [f for f in fields if f.rpartition(".")[0] == parent]
    for pool, target in ((siblings, path), (fields, path)):
        match = difflib.get_close_matches(target, pool, n=1, cutoff=0.6)
        if match:
            return match[0]
    match = difflib.get_close_matches(name, [f.rpartition(".")[2] for f in fields], n=1)
    if match:
        return next(f for f in fields if f.rpartition(".")[2] == match[0])
    return None
