"""Host side of the Triton delta codec (``delta_kernels``): the dense passes of encode and of the
bitmap layout's decode, on 16-bit codes (int16 views) on one CUDA device, or on CPU tensors under
``TRITON_INTERPRET=1``. ``numerics.delta`` composes the result into a ``Delta`` (the LEB128 parts,
whose size is the number of changes, in torch ops on the same device).

Encode reads the change and escape counts back once (they size the buffers of the second pass);
decode reads the number of set bitmap bits back once (checked against the delta's header before
anything is written)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import delta_kernels as dk
from .launcher import check_device

# Elements per program (a multiple of 32); the bits never depend on it.
BLOCK = int(os.environ.get("DIST_SR_TRITON_DELTA_BLOCK", 2048))


@dataclass(frozen=True)
class Changes:
    """Where ``new`` differs from ``old`` (flat 16-bit codes of ``numel`` elements)."""

    bitmap: torch.Tensor  # uint8, ceil(numel / 8): bit j of byte i = element 8 i + j changed
    changed: int
    signs: torch.Tensor  # uint8, ceil(changed / 8): bit j of the stream = change j went down
    indices: torch.Tensor | None  # int64 [changed], when asked for (the gaps layout)
    escape_indices: torch.Tensor  # int64 [escapes]
    escape_steps: torch.Tensor  # int32 [escapes]: the signed step, not +-1


def _grid(n: int) -> tuple[int]:
    return (-(-n // BLOCK),)


def changes(old: torch.Tensor, new: torch.Tensor, *, indices_below: int) -> Changes:
    """The changes of ``new`` against ``old`` (int16, flat, same size); ``indices`` are written
    when fewer than ``indices_below`` elements changed."""
    device = check_device([old, new])
    n = old.numel()
    bitmap = torch.empty(-(-n // 8), dtype=torch.uint8, device=device)
    grid = _grid(n)
    counts = torch.zeros(max(grid[0], 1), 2, dtype=torch.int64, device=device)
    if n:
        dk.count_kernel[grid](old, new, bitmap, counts, n, bitmap.numel(), BLOCK=BLOCK)
    starts = torch.cumsum(counts, 0) - counts
    k, e = (int(x) for x in counts.sum(0).tolist())  # they size what the second pass writes
    write_idx = k < indices_below
    words = torch.zeros(max(-(-k // 32), 1), dtype=torch.int32, device=device)
    idx = torch.empty(max(k, 1) if write_idx else 1, dtype=torch.int64, device=device)
    esc_idx = torch.empty(max(e, 1), dtype=torch.int64, device=device)
    esc_step = torch.empty(max(e, 1), dtype=torch.int32, device=device)
    if k:
        dk.scatter_kernel[grid](
            old, new, starts.contiguous(), words, idx, esc_idx, esc_step, n, BLOCK=BLOCK, WRITE_IDX=write_idx
        )
    return Changes(
        bitmap, k, words.view(torch.uint8)[: -(-k // 8)], idx[:k] if write_idx else None, esc_idx[:e], esc_step[:e]
    )


def bitmap_starts(bitmap: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Each block's first position in the sign stream, and the number of set bits."""
    check_device([bitmap])
    grid = _grid(n)
    counts = torch.zeros(max(grid[0], 1), dtype=torch.int64, device=bitmap.device)
    if n:
        dk.popcount_kernel[grid](bitmap, counts, bitmap.numel(), BLOCK=BLOCK)
    return torch.cumsum(counts, 0) - counts, int(counts.sum())


def bitmap_step(held: torch.Tensor, bitmap: torch.Tensor, signs: torch.Tensor, starts: torch.Tensor) -> None:
    """``held`` (int16, flat) moves one grid step at every set bit: down where the sign bit is 1."""
    check_device([held, bitmap, signs, starts])
    n = held.numel()
    if n and signs.numel():
        dk.step_kernel[_grid(n)](held, bitmap, signs, starts, n, bitmap.numel(), BLOCK=BLOCK)
