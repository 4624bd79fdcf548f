"""Numerics: the rounding-key contract and the FP32 -> BF16 rounding backends."""

from .key import MODES, normalize_param_name, stream_key, stream_keys
from .rounding import BACKENDS, RoundingBatch, RoundingJob, round_jobs, stochastic_round

__all__ = ["BACKENDS", "MODES", "RoundingBatch", "RoundingJob", "normalize_param_name", "round_jobs",
           "stochastic_round", "stream_key", "stream_keys"]
