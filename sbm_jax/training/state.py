"""Train state, optimizer and learning-rate schedule."""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import optax
from flax import struct
from flax.training import train_state

from sbm_jax.config_defaults import DEFAULTS
from sbm_jax.training.sharding import ParamAxes, logical_axes, unbox
from sbm_jax.training.task import Batch, Task

Array = jax.Array


class TrainState(train_state.TrainState):
    """Flax ``TrainState`` plus the base PRNG key and the parameters' logical axes.

    The key for step ``s`` is ``fold_in(rng, s)``, so the state alone determines every
    later step: a loop restarted from a saved state reproduces an uninterrupted run.

    ``param_axes`` (static metadata, not saved in checkpoints): the logical axis names
    the model declared on its parameters (``sbm_jax.training.sharding.logical_axes``),
    which ``state_sharding`` maps to the mesh; empty: every parameter is replicated.
    """

    rng: Array
    param_axes: ParamAxes = struct.field(pytree_node=False, default=())


class ScheduleArgs(NamedTuple):
    """The numbers of a learning-rate schedule (``config.train``'s fields of these names)."""

    learning_rate: float  # peak rate
    warmup_steps: int
    num_steps: int
    end_learning_rate_factor: float  # final rate / peak

    @classmethod
    def of(cls, train: Any) -> ScheduleArgs:
        """The schedule of a ``train`` config section."""
        return cls(
            float(train.learning_rate),
            int(train.warmup_steps),
            int(train.num_steps),
            float(train.end_learning_rate_factor),
        )


def learning_rate_schedule(
    learning_rate: float, warmup_steps: int, num_steps: int, end_learning_rate_factor: float
) -> optax.Schedule:
    """Linear warm-up from 0 to ``learning_rate`` over ``warmup_steps``, then linear decay
    to ``learning_rate * end_learning_rate_factor`` at ``num_steps``
    (``learning_rate_schedule(*ScheduleArgs.of(config.train))``)."""
    peak = float(learning_rate)
    warmup = int(warmup_steps)
    end = peak * float(end_learning_rate_factor)
    warm = optax.linear_schedule(0.0, peak, max(warmup, 1))
    decay = optax.linear_schedule(peak, end, max(int(num_steps) - warmup, 1))
    if warmup == 0:
        return decay
    return optax.join_schedules([warm, decay], [warmup])


#: ``train.weight_decay_mask`` values: which parameters AdamW's decoupled decay shrinks.
WEIGHT_DECAY_MASKS = ("all", "matrices")


def weight_decay_mask(kind: str) -> Any:
    """The ``mask`` argument of ``optax.adamw`` for ``train.weight_decay_mask``.

    ``"all"``: every parameter decays (``None``, optax's default). ``"matrices"``: only
    parameters of two or more dimensions (kernels, embedding tables, the SBM clusters);
    biases and normalisation scales, all one-dimensional, do not, as in BERT's optimizer
    (which excludes ``bias`` and ``LayerNorm``).
    """
    if kind == "all":
        return None
    if kind == "matrices":
        return lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    raise ValueError(f"train.weight_decay_mask={kind!r} must be one of {WEIGHT_DECAY_MASKS}")


def make_optimizer(train: Any) -> optax.GradientTransformation:
    """AdamW with the schedule above and optional global-norm clipping.

    ``train.eps`` (optional, default optax's 1e-8) is Adam's epsilon;
    ``train.weight_decay_mask`` (optional, default ``"all"``) which parameters decay
    (:func:`weight_decay_mask`)."""
    adamw = optax.adamw(
        learning_rate_schedule(*ScheduleArgs.of(train)),
        b1=float(train.b1),
        b2=float(train.b2),
        eps=float(train.get("eps", DEFAULTS["train.eps"])),
        weight_decay=float(train.weight_decay),
        mask=weight_decay_mask(
            str(train.get("weight_decay_mask", DEFAULTS["train.weight_decay_mask"]))
        ),
    )
    if float(train.grad_clip_norm) > 0:
        return optax.chain(optax.clip_by_global_norm(float(train.grad_clip_norm)), adamw)
    return adamw


def init_params_and_axes(
    model: nn.Module, task: Task, batch: Batch, rng: Array
) -> tuple[Any, ParamAxes]:
    """Model parameters from one example batch (only the ``params`` collection, plain
    arrays) and their logical axis names (``sharding.logical_axes``).

    The model is traced on the batch's first row only: the parameters' shapes and
    values do not depend on the batch size, and the whole global batch on one device
    (before any sharding or micro-batching) could exceed what a step holds, e.g. the
    SBM layer's path budgets, which are set for the micro-batch."""
    batch = jax.tree.map(lambda x: x[:1], batch)
    params_rng, sample_rng, dropout_rng = jax.random.split(rng, 3)
    variables = jax.jit(
        lambda b: model.init(
            {"params": params_rng, "sample": sample_rng, "dropout": dropout_rng},
            **task.model_inputs(b),
            deterministic=True,
        )
    )(batch)
    boxed = variables["params"]
    return unbox(boxed), logical_axes(boxed)


def init_params(model: nn.Module, task: Task, batch: Batch, rng: Array) -> Any:
    """Model parameters (plain arrays) from one example batch (``params`` collection)."""
    return init_params_and_axes(model, task, batch, rng)[0]


def create_train_state(config: Any, model: nn.Module, task: Task, batch: Batch) -> TrainState:
    """A fresh ``TrainState`` from ``config.seed``, initialised on ``batch``."""
    init_rng, step_rng = jax.random.split(jax.random.PRNGKey(int(config.seed)))
    params, axes = init_params_and_axes(model, task, batch, init_rng)
    return TrainState.create(
        apply_fn=model.apply,
        params=params,
        tx=make_optimizer(config.train),
        rng=step_rng,
        param_axes=axes,
    )
