"""Numerics: the rounding-key contract and the FP32 -> BF16 rounding backends.

The bottom layer: it imports nothing else of dist_sr. ``key`` is the contract, ``reference`` its
plain-torch definition, ``adamw`` the fused step's arithmetic, ``backends`` where it runs,
``rounding`` and ``fused`` the public calls over many pieces, ``digest`` the layout-free weight
digest, ``shards`` where a shard's elements live in the full parameter.
"""

from .key import MODES, normalize_param_name, stream_key, stream_keys
from .rounding import BACKENDS, RoundingBatch, RoundingJob, round_jobs, stochastic_round


def warm_up_kernels() -> list[str]:
    """Build (once per environment) or load the C++ kernels that digests and the delta codec take
    on CPU tensors; returns why each that cannot be had is missing (the torch paths, the same
    bits, stand in for it). Callers above ``numerics`` ask for the kernels, not for a backend."""
    from .backends import cpu

    return cpu.warm_up()


def warm_up_kernels_in_background() -> None:
    """``warm_up_kernels`` on a daemon thread: for a process that only needs the kernels for speed
    (a receiver computing digests), which must never wait for a first compile."""
    from .backends import cpu

    cpu.warm_up_in_background()


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
    "warm_up_kernels",
    "warm_up_kernels_in_background",
]
