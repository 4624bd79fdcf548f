"""Pure-torch reference of the keyed rounding: runs on any device, slow, obviously correct.

torch has no unsigned 64-bit arithmetic that works everywhere, so the SplitMix64 mix runs on
int64 with wrap-around multiplication and masked (logical) right shifts.
"""

from __future__ import annotations

import torch

from .key import GAMMA, MIX1, MIX2

_CHUNK = 1 << 20  # bounds the int64 temporaries to a few MiB per call


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GAMMA, _MIX1, _MIX2 = _signed(GAMMA), _signed(MIX1), _signed(MIX2)


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values read as uint64."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def random_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 in [0, 65536)) for global element indices ``index`` (int64)."""
    z = _signed(key) + ((index >> 2) + 1) * _GAMMA
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    return (z >> ((index & 3) * 16)) & 0xFFFF


def round_into(x: torch.Tensor, out: torch.Tensor, key: int | None, offset: int,
               rows: tuple[int, int] | None = None) -> None:
    """Write the rounding of flat FP32 ``x`` into flat BF16 ``out`` (both contiguous, same numel).

    ``key=None`` is round-to-nearest-even; otherwise the element at position ``j`` uses the random
    bits of global index ``offset + j``, or with ``rows=(row_len, row_stride)`` of
    ``offset + (j // row_len) * row_stride + j % row_len``.
    """
    out_bits = out.view(torch.int16)
    x_bits = x.view(torch.int32)
    for start in range(0, x.numel(), _CHUNK):
        xb = x_bits[start:start + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        if key is None:
            r = 0x7FFF + ((xb >> 16) & 1)
        else:
            idx = torch.arange(start, start + xb.numel(), device=x.device, dtype=torch.int64)
            if rows is not None:
                idx = (idx // rows[0]) * rows[1] + idx % rows[0]
            idx = idx + offset
            r = random_bits(key, idx)
        y = ((xb + r) >> 16) & 0xFFFF
        is_nan = ((xb & 0x7F800000) == 0x7F800000) & ((xb & 0x007FFFFF) != 0)
        y = torch.where(is_nan, torch.full_like(y, 0x7FC0), y)
        y = y - ((y >> 15) & 1) * 0x10000  # to the int16 range, so the cast is exact
        out_bits[start:start + xb.numel()] = y.to(torch.int16)
