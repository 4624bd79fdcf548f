"""Where a local piece of a parameter lives in the full parameter: the element offsets that key
its rounding. FSDP2 and DTensor shard with ``torch.chunk`` semantics (``ceil(size / world)`` rows
per rank along the shard dim, trailing ranks possibly short or empty); HSDP adds ``Replicate``
mesh dims, whose ranks hold the same shard."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def chunking(shape: tuple[int, ...], dim: int, world: int) -> tuple[int, int]:
    """``(rows per shard along dim, elements per row of dim)`` for ``world`` shards of ``shape``."""
    return math.ceil(shape[dim] / world) if shape[dim] else 0, math.prod(shape[dim + 1 :])


def split_range(numel: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``parts`` contiguous, nearly equal parts of ``range(numel)``."""
    chunk = math.ceil(numel / parts)
    return min(index * chunk, numel), min((index + 1) * chunk, numel)


def shard_layout(orig_size: tuple[int, ...], local_shape: tuple[int, ...], world: int, rank: int):
    """Global flat offset, row stride (for a non-leading shard dim, else None) and padded shape of
    FSDP2's shard ``rank``.

    FSDP2 pads every shard to the first one's size; padding rows hold zeros, which round to zero
    under any key.
    """
    if local_shape == orig_size or world == 1:
        return 0, None, orig_size
    dims = [d for d, (a, b) in enumerate(zip(orig_size, local_shape)) if a != b]
    dim = dims[0] if dims else 0
    chunk, inner = chunking(orig_size, dim, world)
    padded = orig_size[:dim] + (chunk,) + orig_size[dim + 1 :]
    if dim == 0:
        return rank * chunk * inner, None, padded
    # a column block: local element (r, c) of the [prod(orig[:dim]), chunk*inner] view
    return rank * chunk * inner, orig_size[dim] * inner, padded


def replica_slot(p: torch.Tensor) -> tuple[int, int]:
    """``(index, count)``: which of the ``count`` ranks holding the same shard of ``p`` this rank
    is (its coordinates on the ``Replicate`` mesh dims, row-major); ``(0, 1)`` when nothing is
    replicated. HSDP's replica groups use it to split a shard's work among themselves."""
    from torch.distributed.tensor import DTensor, Replicate  # torch.distributed is optional in torch builds

    if not isinstance(p, DTensor):
        return 0, 1
    index, count = 0, 1
    for i, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            size = p.device_mesh.size(i)
            index, count = index * size + p.device_mesh.get_local_rank(i), count * size
    return index, count


def local_shard(p: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, int] | None]:
    """``(local tensor, global flat offset, rows)`` of a parameter: itself for a plain tensor; for
    a DTensor, its local shard placed in the full tensor. Any number of ``Replicate`` mesh dims
    and at most one ``Shard`` are supported (FSDP2, HSDP). ``rows = (row_len, row_stride)`` marks
    a shard on a non-leading dim: viewed as ``[-1, row_len]``, its row ``r`` starts at global
    ``offset + r * row_stride``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p, 0, None
    local = p.to_local()
    sharded = _sharding(p)
    if sharded is None:
        return local, 0, None
    dim, chunk, inner, coord = sharded
    shape = tuple(p.shape)
    offset = min(coord * chunk, shape[dim]) * inner
    if dim == 0 or math.prod(shape[:dim]) == 1:
        return local, offset, None
    return local, offset, (local.shape[dim] * inner, shape[dim] * inner)


def padded_shard(p: torch.Tensor) -> tuple[int, tuple[int, int] | None, tuple[int, ...]]:
    """``(global flat offset, rows, padded shape)`` of FSDP2's padded local shard of the sharded
    parameter ``p`` (a DTensor): what its all-gather sends. Every rank's shard is padded to the
    first one's ``ceil(size / world)`` rows along the shard dim; the padding holds zeros, which
    round to zero under any key. ``rows`` as in ``local_shard``, for the padded shard."""
    shape = tuple(p.shape)
    sharded = _sharding(p)
    if sharded is None:
        return 0, None, shape
    dim, chunk, inner, coord = sharded
    padded = shape[:dim] + (chunk,) + shape[dim + 1 :]
    rows = None if dim == 0 or math.prod(shape[:dim]) == 1 else (chunk * inner, shape[dim] * inner)
    return coord * chunk * inner, rows, padded


def _sharding(p) -> tuple[int, int, int, int] | None:
    """``(shard dim, rows per shard, elements per row, this rank's shard index)`` of DTensor
    ``p``; None when nothing is sharded. Refuses more than one ``Shard`` placement."""
    from torch.distributed.tensor import Replicate, Shard

    shards = [(i, pl) for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if not shards:
        return None
    if len(shards) > 1 or not isinstance(shards[0][1], Shard):
        raise NotImplementedError(
            f"keyed rounding of a DTensor with placements {p.placements}: one Shard "
            "(any number of Replicate) is supported"
        )
    mesh_dim, placement = shards[0]
    dim = placement.dim  # a Shard placement
    chunk, inner = chunking(tuple(p.shape), dim, p.device_mesh.size(mesh_dim))
    return dim, chunk, inner, p.device_mesh.get_local_rank(mesh_dim)


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


@dataclass(frozen=True)
class RowBlock:
    """A dense run of a local tensor's flat elements ``[local, local + rows * row_len)`` whose row
    ``r`` holds global flat indices ``[offset + r * row_stride, ... + row_len)`` of the full
    parameter: a whole parameter or a leading-dim shard is one row (``rows=1``), a column shard
    (tensor parallelism's row-parallel weight) one row per matrix row."""

    local: int
    rows: int
    row_len: int
    offset: int
    row_stride: int

    @classmethod
    def contiguous(cls, local: int, numel: int, offset: int) -> "RowBlock":
        return cls(local, 1 if numel else 0, numel, offset, numel)


@dataclass(frozen=True)
class Span:
    """Local flat elements ``[start, start + numel)`` at global offset ``offset``; with ``rows``
    ``(row_len, row_stride)`` a block of whole rows (``RoundingJob.row_stride``), else contiguous."""

    start: int
    numel: int
    offset: int
    rows: tuple[int, int] | None = None


def spans_in_range(blocks: list[RowBlock], start: int, stop: int) -> list[Span]:
    """The local elements ``[start, stop)`` (a ZeRO partition's fragment of a local shard) as
    spans whose global indices a rounding job can take: a partial first row, the whole rows
    (one strided span, or one contiguous span when the rows are adjacent in the parameter) and
    a partial last row of each block the range crosses."""
    out: list[Span] = []
    for b in blocks:
        lo, hi = max(start, b.local), min(stop, b.local + b.rows * b.row_len)
        if lo >= hi:
            continue
        r0, c0 = divmod(lo - b.local, b.row_len)
        r1, c1 = divmod(hi - b.local, b.row_len)
        if r0 == r1:  # inside one row
            out.append(Span(lo, hi - lo, b.offset + r0 * b.row_stride + c0))
            continue
        if c0:  # the tail of row r0
            out.append(Span(lo, b.row_len - c0, b.offset + r0 * b.row_stride + c0))
            r0 += 1
        if r1 > r0:  # whole rows r0 .. r1-1
            first = b.local + r0 * b.row_len
            rows = None if b.row_stride == b.row_len or r1 - r0 == 1 else (b.row_len, b.row_stride)
            out.append(Span(first, (r1 - r0) * b.row_len, b.offset + r0 * b.row_stride, rows))
        if c1:  # the head of row r1
            out.append(Span(b.local + r1 * b.row_len, c1, b.offset + r1 * b.row_stride))
    return out
