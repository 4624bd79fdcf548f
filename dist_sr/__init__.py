"""dist-sr: keyed stochastic rounding of FP32 shadow weights to BF16 for distributed training."""

from .numerics import MODES, normalize_param_name, round_jobs, stochastic_round, stream_key

__version__ = "0.1.0"

__all__ = ["MODES", "normalize_param_name", "round_jobs", "stochastic_round", "stream_key", "__version__"]
