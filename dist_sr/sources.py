"""A trainer's working weights as HF-named tensors, from any layout, without ever materialising
the whole model: the ``WeightSource`` protocol every training engine implements, the source of
replicated weights, and the layout-free digest of a source.

A source answers three questions, the same way on every trainer rank:
- ``metadata()``: every tensor's name, dtype and full shape, in model order;
- ``local_pieces(names)``: the flat ranges this rank holds, as ``LocalPiece``s (shard-direct sync
  sends these as they are: an FSDP2 shard rounded with the global key, a ZeRO-3 partition, or
  this rank's slice of a replicated tensor);
- ``gather(names)``: the full tensors of one bucket on rank 0 (a collective every rank joins).

The bits are the working weights the forward pass uses: SR'd BF16 where the precision rounds.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple, Protocol

import torch
import torch.distributed as dist

from .numerics.digest import combine, dtype_name, piece_sums
from .numerics.key import normalize_param_name
from .numerics.shards import split_range


class Meta(NamedTuple):
    """One working weight as a source describes it (a tuple: equal to ``(name, dtype, shape)``)."""

    name: str  # the HF name (wrapper prefixes removed): the rounding key's parameter name
    dtype: str  # the dtype's name as sent (``numerics.digest.dtype_name``), e.g. "bfloat16"
    shape: tuple[int, ...]  # the full, unsharded shape


class LocalPiece(NamedTuple):
    """Elements ``[start, end)`` of the flattened full tensor ``name``, held by this rank."""

    name: str
    start: int
    end: int
    bits: torch.Tensor  # flat, ``end - start`` elements


class WeightSource(Protocol):
    """A trainer's working weights as HF-named tensors, however they are sharded: what a weight
    sync reads. Every method is called on every trainer rank, in the same order (collectives).

    Methods:
        metadata(): ``Meta`` of every tensor, in sync order; the same on every rank.
        local_pieces(names): for each name, the pieces this rank holds, each a ``LocalPiece``
            (name, global flat ``[start, end)``, the bits): over all ranks every element once
            (shard-direct sends them without a gather).
        gather(names): ``{name: full tensor}`` on rank 0, ``{}`` elsewhere (collective).
    """

    def metadata(self) -> list[Meta]: ...

    def local_pieces(self, names: list[str]) -> Iterable[LocalPiece]: ...

    def gather(self, names: list[str]) -> dict[str, torch.Tensor]: ...


class ReplicatedSource:
    """Every rank holds every working weight (one process; DeepSpeed stages 0-2, whose replicas
    are bitwise equal). Shard-direct splits each tensor into one contiguous slice per rank."""

    def __init__(self, module: torch.nn.Module, rank: int = 0, world: int = 1):
        self.params = {normalize_param_name(n): p for n, p in module.named_parameters()}
        self.rank, self.world = rank, world

    def metadata(self) -> list[Meta]:
        return [Meta(n, dtype_name(p.dtype), tuple(p.shape)) for n, p in self.params.items()]

    def local_pieces(self, names: list[str]) -> list[LocalPiece]:
        out = []
        for n in names:
            flat = self.params[n].detach().reshape(-1)
            start, end = split_range(flat.numel(), self.world, self.rank)
            out.append(LocalPiece(n, start, end, flat[start:end]))
        return out

    def gather(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.params[n].detach() for n in names} if self.rank == 0 else {}


def add_rank_sums(sums: dict[str, int], metas: list[Meta], world: int, group=None) -> dict:
    """Digest entries ``{name: (dtype, shape, sum)}`` of every tensor in ``metas``, adding up the
    partial sums ``{name: sum}`` of all ranks of ``group`` (collective when ``world > 1``)."""
    parts = [sums]
    if world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, sums, group=group)
    return {n: (d, tuple(shape), sum(p.get(n, 0) for p in parts) & ((1 << 64) - 1)) for n, d, shape in metas}


def digest_entries(source, world: int, group=None) -> dict:
    """Every rank: digest entries of the source's tensors from the pieces each rank holds, one
    tensor at a time (nothing is gathered or materialised whole); collective."""
    metas = source.metadata()
    pieces = [p for p in source.local_pieces([m[0] for m in metas]) if p.end > p.start]
    sums = dict(zip([p.name for p in pieces], piece_sums([(p.bits, p.start) for p in pieces])))
    return add_rank_sums(sums, metas, world, group)


def layout_free_digest(source, world: int, group=None) -> str:
    """One digest of the source's tensors that does not depend on how they are sharded: equal
    at any world size, engine or shard layout (``plan.piece_sum``); collective."""
    return combine(digest_entries(source, world, group))
