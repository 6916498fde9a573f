"""The training loop shared by every task: state, steps, metrics, checks, plots."""

from sbm_jax.training.config_checks import ConfigError, prepare_output_dir, validate_config
from sbm_jax.training.loop import (
    TrainResult,
    default_output_dir,
    format_summary,
    run_training,
    train,
)
from sbm_jax.training.metrics import MetricsWriter, ProgressBar
from sbm_jax.training.plots import plot_metrics, read_metrics_csv
from sbm_jax.training.state import (
    TrainState,
    create_train_state,
    learning_rate_schedule,
    make_optimizer,
)
from sbm_jax.training.stats import collect_attention_stats
from sbm_jax.training.steps import (
    data_sharding,
    evaluate,
    make_eval_step,
    make_mesh,
    make_train_step,
    replicated,
    shard_batch,
)
from sbm_jax.training.task import (
    Task,
    classification_loss,
    default_model_inputs,
    dual_encoder_model_inputs,
)

__all__ = [
    "ConfigError",
    "MetricsWriter",
    "ProgressBar",
    "Task",
    "TrainResult",
    "TrainState",
    "classification_loss",
    "collect_attention_stats",
    "create_train_state",
    "data_sharding",
    "default_model_inputs",
    "default_output_dir",
    "dual_encoder_model_inputs",
    "evaluate",
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
    "run_training",
    "shard_batch",
    "train",
    "validate_config",
]
