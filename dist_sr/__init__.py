"""dist-sr: keyed stochastic rounding of FP32 shadow weights to BF16 for distributed training.

The public names are imported when first used (PEP 562), so importing ``dist_sr`` itself (as the
start-up hook does in every Python process of an environment where dist-sr is installed) loads
neither torch nor anything else heavy."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_WHERE = {  # public name -> the module that defines it
    **dict.fromkeys(
        ("MODES", "RoundingJob", "normalize_param_name", "round_jobs", "stochastic_round", "stream_key"), ".numerics"
    ),
    **dict.fromkeys(("AdamWSR", "DynamicLossScaler", "ShadowAdamW", "ShadowOptimizer", "StickingMeter"), ".optim"),
    **dict.fromkeys(
        ("PRECISIONS", "PrecisionConfig", "PrecisionConfigError", "TrainingPrecision", "apply_precision"), ".precision"
    ),
    **dict.fromkeys(("ReplicaChecker", "ReplicaDivergenceError", "check_replicas", "weight_digests"), ".replica"),
    **dict.fromkeys(("export_bf16", "rollout_shards", "rollout_weights"), ".weightsync.trainer.export"),
}

__all__ = [*sorted(_WHERE), "__version__"]


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'dist_sr' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
