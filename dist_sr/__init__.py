"""dist-sr: keyed stochastic rounding of FP32 shadow weights to BF16 for distributed training."""

from .numerics import MODES, RoundingJob, normalize_param_name, round_jobs, stochastic_round, stream_key
from .optim import AdamWSR, DynamicLossScaler, ShadowAdamW, ShadowOptimizer, StickingMeter
from .precision import PRECISIONS, PrecisionConfig, PrecisionConfigError, TrainingPrecision, apply_precision
from .replica import ReplicaChecker, ReplicaDivergenceError, check_replicas, weight_digests
from .weightsync.trainer.export import export_bf16, rollout_shards, rollout_weights

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "PRECISIONS",
    "AdamWSR",
    "DynamicLossScaler",
    "PrecisionConfig",
    "PrecisionConfigError",
    "ReplicaChecker",
    "ReplicaDivergenceError",
    "RoundingJob",
    "ShadowAdamW",
    "ShadowOptimizer",
    "StickingMeter",
    "TrainingPrecision",
    "apply_precision",
    "check_replicas",
    "export_bf16",
    "normalize_param_name",
    "rollout_shards",
    "rollout_weights",
    "round_jobs",
    "stochastic_round",
    "stream_key",
    "weight_digests",
    "__version__",
]
