"""Numerics: the rounding-key contract and the FP32 -> BF16 rounding backends.

The bottom layer: it imports nothing else of dist_sr. ``key`` is the contract, ``reference`` its
plain-torch definition, ``adamw`` the fused step's arithmetic, ``backends`` where it runs,
``rounding`` and ``fused`` the public calls over many pieces, ``digest`` the layout-free weight
digest, ``shards`` where a shard's elements live in the full parameter.
"""

from .key import MODES, normalize_param_name, stream_key, stream_keys
from .rounding import BACKENDS, RoundingBatch, RoundingJob, round_jobs, stochastic_round

__all__ = [
    "BACKENDS",
    "MODES",
    "RoundingBatch",
    "RoundingJob",
    "normalize_param_name",
    "round_jobs",
    "stochastic_round",
    "stream_key",
    "stream_keys",
]
