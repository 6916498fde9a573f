"""The trainer every task goes through, and its pieces: task, state, steps, data layout,
checkpoints, preemption, non-finite halts, run records, metrics, plots, summaries."""

from sbm_jax.training.config_checks import ConfigError, config_errors, validate_config
from sbm_jax.training.metrics import MetricsWriter, ProgressBar
from sbm_jax.training.plots import plot_metrics, read_metrics_csv
from sbm_jax.training.run_dir import prepare_output_dir, resolve_output_dir
from sbm_jax.training.sharding import make_mesh
from sbm_jax.training.state import (
    TrainState,
    create_train_state,
    learning_rate_schedule,
    make_optimizer,
)
from sbm_jax.training.stats import collect_attention_stats
from sbm_jax.training.steps import (
    data_sharding,
    make_eval_step,
    make_train_step,
    replicated,
    shard_batch,
)
from sbm_jax.training.summary import format_summary
from sbm_jax.training.task import (
    Task,
    classification_loss,
    default_model_inputs,
    dual_encoder_model_inputs,
)
from sbm_jax.training.trainer import NonFiniteError, train_and_evaluate

__all__ = [
    "ConfigError",
    "MetricsWriter",
    "NonFiniteError",
    "ProgressBar",
    "Task",
    "TrainState",
    "classification_loss",
    "collect_attention_stats",
    "config_errors",
    "create_train_state",
    "data_sharding",
    "default_model_inputs",
    "dual_encoder_model_inputs",
    "format_summary",
    "learning_rate_schedule",
    "make_eval_step",
    "make_mesh",
    "make_optimizer",
    "make_train_step",
    "plot_metrics",
    "prepare_output_dir",
    "read_metrics_csv",
    "replicated",
    "resolve_output_dir",
    "shard_batch",
    "train_and_evaluate",
    "validate_config",
]
