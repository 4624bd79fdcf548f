"""The rounding-key contract: where every stochastic-rounding bit comes from.

This module is the only place that derives rounding keys. Every backend (the pure-torch
reference, the C++ CPU kernel, GPU kernels, DeepSpeed/FSDP hooks, weight sync) receives the
64-bit *stream key* computed here and the global element index, nothing else.

    stream key   K = first 8 bytes (little-endian) of BLAKE2b-64(tag || seed || step || name)
    block hash   h_q = splitmix64_mix(K + (q + 1) * GAMMA)      (mod 2^64), q = i >> 2
    random bits  r_i = (h_q >> (16 * (i & 3))) & 0xFFFF         (16 bits per element)
    SR(x_i)      = upper half of (bits(x_i) + r_i)              (NaN -> 0x7FC0)

``h_q`` is the (q+1)-th output of a SplitMix64 generator seeded with ``K``, so one 64-bit
hash feeds four consecutive elements. ``docs/rounding-key.md`` is the human-readable form of
this contract, with test vectors in ``docs/rounding-key-vectors.json``.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Sequence

import numpy as np

MODES = ("nearest", "stochastic", "dither")

GAMMA = 0x9E3779B97F4A7C15
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1

# Components that wrappers insert into state-dict names. They are removed wherever they appear.
_WRAPPER_COMPONENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
# DDP, DeepSpeedEngine and DataParallel prepend ``module.``; only leading ones are removed, so a
# real submodule called ``module`` deeper in the model keeps its name.
_LEADING_WRAPPER = "module"

_TAG_STOCHASTIC = b"dist-sr/sr/v1\x00"
_TAG_DITHER = b"dist-sr/dither/v1\x00"
# A stochastic key message is tag || seed || step || name: the step's 8 little-endian bytes start
# here (device code that fills the step in from a device counter relies on it).
STEP_BYTE = len(_TAG_STOCHASTIC) + 8


def normalize_param_name(name: str) -> str:
    """The parameter's fully-qualified name with wrapper prefixes removed.

    ``module.model.layers.0._checkpoint_wrapped_module.mlp._orig_mod.weight`` becomes
    ``model.layers.0.mlp.weight``: the same weight gets the same key under any wrapper.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"parameter name must be a non-empty string, got {name!r}")
    parts = [p for p in name.split(".") if p not in _WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] == _LEADING_WRAPPER:
        parts.pop(0)
    if not parts or any(p == "" for p in parts):
        raise ValueError(f"parameter name {name!r} is not a dotted state-dict name")
    return ".".join(parts)


def stream_key(*, seed: int, step: int, param: str, mode: str = "stochastic") -> int:
    """The 64-bit stream key (an int in [0, 2^64)) for one parameter at one optimizer step.

    ``mode="dither"`` ignores ``step`` (one frozen threshold per element); ``"nearest"`` has no
    key and is rejected here.
    """
    msg = key_message(param, seed=seed, step=step, mode=mode)
    return int.from_bytes(hashlib.blake2b(msg, digest_size=8).digest(), "little")


def key_message(param: str, *, seed: int, step: int, mode: str = "stochastic") -> bytes:
    """The bytes BLAKE2b-64 hashes into the stream key (``step`` ignored by ``dither``)."""
    check_seed_step(seed, step)
    return _key_prefix(seed, step, mode) + _name_bytes(param)


def _key_prefix(seed: int, step: int, mode: str) -> bytes:
    if mode == "stochastic":
        return _TAG_STOCHASTIC + struct.pack("<QQ", seed, step)
    if mode == "dither":
        return _TAG_DITHER + struct.pack("<Q", seed)
    raise ValueError(f"mode {mode!r} has no stream key; keyed modes are 'stochastic' and 'dither'")


def stream_keys(params: Sequence[str], *, seed: int, step: int, mode: str = "stochastic") -> np.ndarray:
    """``stream_key`` of many parameters at one (seed, step, mode), as an int64 array (the keys'
    bits read as signed: what kernels take). One pass of BLAKE2b per name, names normalised once
    per process: the host cost of a step's keys is about 0.4 us per parameter."""
    check_seed_step(seed, step)
    prefix = _key_prefix(seed, step, mode)
    digests = b"".join(hashlib.blake2b(prefix + _name_bytes(p), digest_size=8).digest() for p in params)
    return np.frombuffer(digests, dtype="<i8").astype(np.int64)


@functools.lru_cache(maxsize=1 << 16)
def _name_bytes(param: str) -> bytes:
    return normalize_param_name(param).encode("utf-8")


def signed64(key: int) -> int:
    """A 64-bit key as the signed int with the same bits (kernels and int64 tensors take these)."""
    return key - (1 << 64) if key >= 1 << 63 else key


def check_seed_step(seed: int, step: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MASK64:
        raise ValueError(f"seed must be an int in [0, 2^64), got {seed!r}")
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MASK64:
        raise ValueError(f"step must be an int in [0, 2^64), got {step!r}")


def check_key_state(saved, *, seed: int, mode: str) -> None:
    """Refuse to resume from a checkpoint whose rounding key (seed, mode) is not this run's: the
    re-derived working weights would differ from the ones that were trained."""
    for field, mine in (("seed", seed), ("mode", mode)):
        if saved[field] != mine:
            raise ValueError(
                f"checkpoint was written with {field}={saved[field]!r} but this run has {field}={mine!r}; "
                f"use {field}={saved[field]!r} to resume it"
            )


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (the rounding mode); choose one of {', '.join(MODES)}")
    return mode


# --- Plain-Python definition of the bits, for documentation and as a test oracle. -------------


def splitmix64_mix(z: int) -> int:
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def random_bits(key: int, index: int) -> int:
    """The 16 random bits of global element ``index`` under stream key ``key``."""
    h = splitmix64_mix(key + ((index >> 2) + 1) * GAMMA)
    return (h >> (16 * (index & 3))) & 0xFFFF


def round_bits(x_bits: int, r: int | None) -> int:
    """BF16 bits of FP32 bits ``x_bits`` rounded with random bits ``r`` (``None``: nearest-even)."""
    if (x_bits & 0x7F800000) == 0x7F800000 and (x_bits & 0x007FFFFF):
        return 0x7FC0  # every NaN payload becomes the canonical quiet NaN
    if r is None:
        r = 0x7FFF + ((x_bits >> 16) & 1)
    return ((x_bits + r) >> 16) & 0xFFFF
