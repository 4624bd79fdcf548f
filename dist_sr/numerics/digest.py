"""The layout-free digest of weights: equal however a tensor is split across ranks or buckets.

The digest of a tensor is the 64-bit sum over its elements of a keyed mix of (global index,
bits), so each rank digests the pieces it holds and the sums add up to the digest of the full
tensor, whatever the sharding. A wrong byte, a misplaced piece or a missing piece changes it.
``combine`` folds per-tensor sums (with names, dtypes and shapes) into one hex digest.
"""

from __future__ import annotations

import hashlib

import torch

from .backends import cpu
from .key import GAMMA, MASK64, MIX1, MIX2, signed64
from .reference import logical_shr

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CHUNK = 1 << 18  # int64 temporaries of 2 MiB stay in cache
_GAMMA, _MIX1, _MIX2 = signed64(GAMMA), signed64(MIX1), signed64(MIX2)


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"cannot send {dtype}: weights travel as {', '.join(DTYPES)}")
    return name


def piece_sum(values: torch.Tensor, start: int) -> int:
    """Layout-free digest contribution of flat ``values`` holding elements ``start..`` of a tensor:
    the sum mod 2^64 of ``mix(index * GAMMA + bits * MIX2)`` (one multiply-xorshift round)."""
    return piece_sums([(values, start)])[0]


def piece_sums(pieces: list[tuple[torch.Tensor, int]]) -> list[int]:
    """``piece_sum`` of each ``(values, start)``: host pieces one pass each (the C++ kernel, the
    same sum ~10x faster than the definition), device pieces summed where they live and read
    back together, one synchronisation for all of them (a bucket's worth) instead of one per piece."""
    out: list[int | None] = [None] * len(pieces)
    pending: list[tuple[int, list[torch.Tensor]]] = []
    kernel = cpu.loaded()
    for i, (values, start) in enumerate(pieces):
        flat = values.reshape(-1)
        if flat.device.type == "cpu" and kernel is not None:
            out[i] = kernel.piece_sum(flat.contiguous(), start) & MASK64
        else:
            pending.append((i, _halves(flat, start)))
    by_device: dict[torch.device, list[tuple[int, list[torch.Tensor]]]] = {}
    for i, halves in pending:
        by_device.setdefault(halves[0].device, []).append((i, halves))
    for group in by_device.values():
        read = torch.stack([h for _, halves in group for h in halves]).tolist()  # the one read-back
        at = 0
        for i, halves in group:
            out[i] = _fold(read[at : at + len(halves)])
            at += len(halves)
    return out  # type: ignore[return-value]


def piece_sum_reference(flat: torch.Tensor, start: int) -> int:
    """The definition in torch (any device). The 64-bit terms are summed as two 32-bit halves in
    int64 on the device (exact: no overflow below 2^31 terms per window), read back once per
    piece."""
    return _fold(torch.stack(_halves(flat, start)).tolist())


def _halves(flat: torch.Tensor, start: int) -> list[torch.Tensor]:
    """``[lo, hi]`` int64 device scalars per window of 2^30 elements of ``flat`` (elements
    ``start..``): the low and high 32-bit halves of its terms, summed; nothing is read back."""
    width = flat.element_size()
    words = flat.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])
    chunk = _CHUNK if words.device.type == "cpu" else _CHUNK * 16
    index_mix = torch.arange(chunk, dtype=torch.int64, device=words.device) * _GAMMA  # j * GAMMA, wrapping
    out = []
    lo = hi = torch.zeros((), dtype=torch.int64, device=words.device)
    for s in range(0, words.numel(), chunk):
        v = words[s : s + chunk].to(torch.int64)
        z = index_mix[: v.numel()] + signed64(((start + s) * GAMMA) & MASK64) + v * _MIX2
        z = (z ^ logical_shr(z, 29)) * _MIX1
        z = z ^ logical_shr(z, 32)
        lo = lo + (z & 0xFFFFFFFF).sum()
        hi = hi + logical_shr(z, 32).sum()
        if (s // chunk + 1) % ((1 << 30) // chunk) == 0:  # a new window before the halves could overflow
            out.append(torch.stack([lo, hi]))
            lo = hi = torch.zeros_like(lo)
    out.append(torch.stack([lo, hi]))
    return out


def _fold(halves: list[list[int]]) -> int:
    return sum(lo + (hi << 32) for lo, hi in halves) & MASK64


def combine(entries: dict[str, tuple[str, tuple[int, ...], int]]) -> str:
    """One digest over ``{name: (dtype, shape, sum)}``, independent of order."""
    h = hashlib.sha256()
    for name in sorted(entries):
        dtype, shape, s = entries[name]
        h.update(f"{name}|{dtype}|{list(shape)}|{s & MASK64:016x}\n".encode())
    return h.hexdigest()


def tensor_sums(named: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Digest entries of whole tensors."""
    return {n: (dtype_name(t.dtype), tuple(t.shape), piece_sum(t.detach().contiguous(), 0)) for n, t in named.items()}
