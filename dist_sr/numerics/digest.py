"""The layout-free digest of weights: equal however a tensor is split across ranks or buckets.

The digest of a tensor is the 64-bit sum over its elements of a keyed mix of (global index,
bits), so each rank digests the pieces it holds and the sums add up to the digest of the full
tensor, whatever the sharding. A wrong byte, a misplaced piece or a missing piece changes it.
``combine`` folds per-tensor sums (with names, dtypes and shapes) into one hex digest.

Where it runs: host pieces in the C library the wheel ships built (``csrc/digest.c``, no torch
headers, no compiler needed where it runs: memory speed from a process's first call); device
pieces, and host pieces where that library was not built, in torch (``_torch_sum``: int64 in
chunks of at most ``CHUNK`` elements, so its temporaries are a few MiB whatever the tensor).
``backend()`` says which one this process digests host tensors with.
"""

from __future__ import annotations

import hashlib
from typing import Sequence, Union

import torch

from .key import GAMMA, MASK64, MIX1, MIX2, signed64

try:  # built into the wheel by setup.py; absent only where no C compiler was at hand at install
    from . import digest_c as _native  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - every CI install builds it
    _native = None

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
CHUNK = 1 << 18  # elements per torch step on the host: two int64 buffers of 2 MiB stay in cache
_DEVICE_CHUNK = 1 << 22
CAST_CHUNK = 1 << 24  # elements cast at a time by cast_piece_sum (64 MiB of FP32)
_GAMMA, _MIX1, _MIX2 = signed64(GAMMA), signed64(MIX1), signed64(MIX2)
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# A piece: flat values holding elements ``start..`` of a tensor, or ``(rows, start, row_step)``:
# a 2-D view whose rows are contiguous, row r holding elements ``start + r * row_step + j``.
Piece = Union[tuple[torch.Tensor, int], tuple[torch.Tensor, int, int]]


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"cannot send {dtype}: weights travel as {', '.join(DTYPES)}")
    return name


def backend() -> str:
    """What host tensors are digested with in this process: ``"native"`` (the compiled library)
    or ``"torch"``."""
    return "torch" if _native is None else "native"


def piece_sum(values: torch.Tensor, start: int) -> int:
    """Layout-free digest contribution of flat ``values`` holding elements ``start..`` of a tensor:
    the sum mod 2^64 of ``mix(index * GAMMA + bits * MIX2)`` (one multiply-xorshift round)."""
    return piece_sums([(values, start)])[0]


def piece_sums(pieces: Sequence[Piece], *, host: str | None = None) -> list[int]:
    """``piece_sum`` of each piece (``Piece``: flat values, or rows of a 2-D view). Host pieces are
    summed one pass each; device pieces where they live, read back together with one
    synchronisation per device for all of them (a bucket's worth), not one per piece. ``host``
    forces the host path (``"native"`` or ``"torch"``; the benchmarks compare them)."""
    use_native = (host or backend()) == "native"
    if use_native and _native is None:
        raise RuntimeError("the compiled digest is not built in this install (setup.py's dist_sr.numerics.digest_c)")
    out: list[int | None] = [None] * len(pieces)
    pending: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, piece in enumerate(pieces):
        rows, start, step = _as_rows(piece)
        if rows.device.type == "cpu" and use_native:
            out[i] = _native_sum(rows, start, step)
        else:
            pending.setdefault(rows.device, []).append((i, _torch_sum(rows, start, step)))
    for group in pending.values():
        read = torch.stack([s for _, s in group]).tolist()  # the one read-back per device
        for (i, _), s in zip(group, read):
            out[i] = s & MASK64
    return out  # type: ignore[return-value]


def cast_piece_sum(values: torch.Tensor, dtype: torch.dtype, start: int = 0) -> int:
    """``piece_sum`` of ``values.to(dtype)`` (what a parameter of ``dtype`` holds after copying
    ``values`` in), cast ``CAST_CHUNK`` elements at a time: no copy of the whole tensor."""
    flat = values.reshape(-1)
    if flat.dtype == dtype:
        return piece_sum(flat, start)
    pieces = (flat[s : s + CAST_CHUNK].to(dtype) for s in range(0, flat.numel(), CAST_CHUNK))
    return sum(piece_sum(p, start + i * CAST_CHUNK) for i, p in enumerate(pieces)) & MASK64


def piece_sum_reference(flat: torch.Tensor, start: int) -> int:
    """The definition, term by term in torch (any device): the tests' oracle."""
    words = flat.reshape(-1).contiguous().view(_WORDS[flat.element_size()]).to(torch.int64)
    index = torch.arange(words.numel(), dtype=torch.int64, device=words.device) + signed64(start & MASK64)
    z = index * _GAMMA + words * _MIX2
    z = (z ^ _shr(z, 29)) * _MIX1
    z = z ^ _shr(z, 32)
    return int(z.sum()) & MASK64  # int64 arithmetic wraps: every step is mod 2^64


def _as_rows(piece: Piece) -> tuple[torch.Tensor, int, int]:
    """``(2-D view with contiguous rows, start, row step)`` of a piece."""
    values, start = piece[0], int(piece[1])
    if len(piece) == 2 or values.dim() != 2:
        flat = values.reshape(-1)
        if flat.numel() and flat.stride(0) != 1:
            flat = flat.contiguous()
        return flat.view(1, -1), start, 0
    if values.numel() and values.stride(1) != 1:
        values = values.contiguous()
    return values, start, int(piece[2])


def _native_sum(rows: torch.Tensor, start: int, step: int) -> int:
    n_rows, row_len = rows.shape
    if rows.numel() == 0:
        return 0
    return _native.strided_sum(
        rows.data_ptr(),
        n_rows,
        row_len,
        rows.stride(0) if n_rows > 1 else row_len,
        rows.element_size(),
        start & MASK64,
        step & MASK64,
        torch.get_num_threads(),
    )


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    return (z >> s) & ((1 << (64 - s)) - 1)  # logical right shift of int64 read as uint64


def _torch_sum(rows: torch.Tensor, start: int, step: int) -> torch.Tensor:
    """The digest sum of a piece in torch, as a device int64 scalar (nothing is read back). Works
    a block of rows (or a stretch of one long row) at a time, in place in two preallocated int64
    buffers of at most ``CHUNK`` elements; int64 arithmetic wraps, so each step is mod 2^64."""
    n_rows, row_len = rows.shape
    dev = rows.device
    total = torch.zeros((), dtype=torch.int64, device=dev)
    if rows.numel() == 0:
        return total
    words = rows.view(_WORDS[rows.element_size()])
    chunk = CHUNK if dev.type == "cpu" else _DEVICE_CHUNK
    width = min(row_len, chunk)  # columns per step
    block = max(1, chunk // width)  # rows per step
    col_mix = torch.arange(width, dtype=torch.int64, device=dev) * _GAMMA
    z = torch.empty(block * width, dtype=torch.int64, device=dev)
    u = torch.empty_like(z)
    for r0 in range(0, n_rows, block):
        nr = min(block, n_rows - r0)
        for c0 in range(0, row_len, width):
            nc = min(width, row_len - c0)
            v = words[r0 : r0 + nr, c0 : c0 + nc]
            zz, uu = z[: nr * nc].view(nr, nc), u[: nr * nc].view(nr, nc)
            torch.add(col_mix[:nc], v, alpha=_MIX2, out=zz)  # j * GAMMA + bits * MIX2
            first = signed64(((start + r0 * step + c0) * GAMMA) & MASK64)
            if nr == 1:
                zz.add_(first)
            else:  # each row's own first index
                row_at = torch.arange(nr, dtype=torch.int64, device=dev) * signed64((step * GAMMA) & MASK64) + first
                zz.add_(row_at.view(nr, 1))
            torch.bitwise_right_shift(zz, 29, out=uu)
            uu.bitwise_and_((1 << 35) - 1)
            zz.bitwise_xor_(uu).mul_(_MIX1)
            torch.bitwise_right_shift(zz, 32, out=uu)
            uu.bitwise_and_((1 << 32) - 1)
            total += zz.bitwise_xor_(uu).sum()
    return total


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
