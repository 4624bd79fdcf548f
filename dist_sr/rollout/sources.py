"""Trainer side: the BF16 working weights of a trainer, as HF-named tensors, without ever
materialising the whole model.

A source answers three questions, the same way on every trainer rank:
- ``metadata()``: every tensor's name, dtype and full shape, in model order;
- ``local_pieces(names)``: an iterable of the flat ranges this rank holds and their bits
  (shard-direct sends these as they are: an FSDP2 shard rounded with the global key, a ZeRO-3
  partition, or this rank's slice of a replicated tensor);
- ``gather(names)``: the full tensors of one bucket on rank 0 (a collective every rank joins).

The bits are the working weights the forward pass uses: SR'd BF16 where the precision rounds.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..numerics.key import normalize_param_name
from .plan import combine, dtype_name, piece_sum

Meta = tuple[str, str, tuple[int, ...]]


def _split(numel: int, world: int, rank: int) -> tuple[int, int]:
    chunk = math.ceil(numel / world)
    return min(rank * chunk, numel), min((rank + 1) * chunk, numel)


class ReplicatedSource:
    """Every rank holds every working weight (one process; DeepSpeed stages 0-2, whose replicas
    are bitwise equal). Shard-direct splits each tensor into one contiguous slice per rank."""

    def __init__(self, module: torch.nn.Module, rank: int = 0, world: int = 1):
        self.params = {normalize_param_name(n): p for n, p in module.named_parameters()}
        self.rank, self.world = rank, world

    def metadata(self) -> list[Meta]:
        return [(n, dtype_name(p.dtype), tuple(p.shape)) for n, p in self.params.items()]

    def local_pieces(self, names: list[str]) -> list[tuple[str, int, int, torch.Tensor]]:
        out = []
        for n in names:
            flat = self.params[n].detach().reshape(-1)
            start, end = _split(flat.numel(), self.world, self.rank)
            out.append((n, start, end, flat[start:end]))
        return out

    def gather(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.params[n].detach() for n in names} if self.rank == 0 else {}


class FSDP2Source:
    """FSDP2 with keyed SR: the working weights exist only inside forward, as the all-gather of
    SR'd shards; this source rounds each local FP32 shard with its global offsets (the bits the
    all-gather sends), so shard-direct needs no gather at all. Without SR (``ctx`` None) the local
    shards are cast to BF16 for the engines, or taken as they are with ``as_bf16=False`` (the
    trainer's own digest: FP32 masters, or the BF16 parameters of bf16-pure-sr)."""

    def __init__(self, module: torch.nn.Module, ctx, rank: int, world: int, as_bf16: bool = True):
        self.module = module
        self.ctx, self.rank, self.world, self.as_bf16 = ctx, rank, world, as_bf16

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The sharded parameters. A forward without backward leaves FSDP2's root (which does not
        reshard after forward) holding unsharded BF16 parameters: reshard first (a no-op when
        sharded), so the source always reads the FP32 shards."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()
        return {normalize_param_name(n): p for n, p in self.module.named_parameters()}

    def metadata(self) -> list[Meta]:
        keep = self.ctx is None and not self.as_bf16
        return [(n, dtype_name(p.dtype) if keep else "bfloat16", tuple(p.shape)) for n, p in self.params.items()]

    def _rounded_local(self, name: str, params: dict, part: tuple[int, int] = (0, 1)) -> tuple[int, torch.Tensor]:
        """``(global offset, bits)`` of this rank's shard of ``name``, or of part ``i`` of ``n``
        equal parts of it (``part=(i, n)``)."""
        from ..integrations.fsdp2 import _plain, local_shard
        from ..numerics import stochastic_round

        p = params[name]
        local, offset, rows = local_shard(p)
        if rows is not None:
            raise NotImplementedError(f"{name}: FSDP2 shards on a non-leading dim are not contiguous in the full "
                                      "tensor; shard-direct needs dim-0 shards (FSDP2's default)")
        local = _plain(local).detach().contiguous()
        if part != (0, 1):
            lo, hi = _split(local.numel(), part[1], part[0])
            local, offset = local.view(-1)[lo:hi], offset + lo
        if self.ctx is None:
            return offset, local.to(torch.bfloat16) if self.as_bf16 else local
        return offset, stochastic_round(local, seed=self.ctx.seed, step=self.ctx.step, param=name, offset=offset,
                                        mode=self.ctx.mode)

    def local_pieces(self, names):
        """This rank's shard of each tensor, rounded one at a time as the caller iterates (a
        generator: only one rounded copy is alive at once). Under HSDP the ranks holding the same
        shard (one per replica group) each take an equal part of it, so every element is sent (and
        summed) once and every group's links carry a share."""
        from ..integrations.fsdp2 import replica_slot

        params = self.params
        for n in names:
            offset, bits = self._rounded_local(n, params, replica_slot(params[n]))
            yield n, offset, offset + bits.numel(), bits.reshape(-1)

    def gather(self, names):
        from torch.distributed.tensor import DTensor

        out, params = {}, self.params
        for n in names:
            p = params[n]
            _, bits = self._rounded_local(n, params)
            if isinstance(p, DTensor):
                full = DTensor.from_local(bits.view(p.to_local().shape), p.device_mesh, p.placements,
                                          shape=p.shape, stride=p.stride()).full_tensor()
            else:
                full = bits
            if self.rank == 0:
                out[n] = full
        return out


class ZeRO3Source:
    """DeepSpeed ZeRO-3: rank r holds elements ``[r*pn, (r+1)*pn)`` of each parameter's flat
    BF16 (``ds_tensor``, SR'd by dist-sr's hook); sizes come from ``ds_numel``/``ds_shape``,
    never from the (empty) partitioned ``numel()``."""

    def __init__(self, module: torch.nn.Module, rank: int, world: int):
        self.params = {normalize_param_name(n): p for n, p in module.named_parameters()}
        self.rank, self.world = rank, world

    def metadata(self) -> list[Meta]:
        return [(n, dtype_name(p.ds_tensor.dtype), tuple(p.ds_shape)) for n, p in self.params.items()]

    def local_pieces(self, names):
        out = []
        for n in names:
            p = self.params[n]
            pn = p.ds_tensor.numel()
            start, end = min(self.rank * pn, p.ds_numel), min((self.rank + 1) * pn, p.ds_numel)
            out.append((n, start, end, p.ds_tensor.detach().reshape(-1)[:end - start]))
        return out

    def gather(self, names):
        import deepspeed

        params = [self.params[n] for n in names]
        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().clone() for n, p in zip(names, params)} if self.rank == 0 else {}


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
    sums = {n: piece_sum(bits, start) for n, start, end, bits in source.local_pieces([m[0] for m in metas])
            if end > start}
    return add_rank_sums(sums, metas, world, group)


def layout_free_digest(source, world: int, group=None) -> str:
    """One digest of the source's tensors that does not depend on how they are sharded: equal
    at any world size, engine or shard layout (``plan.piece_sum``); collective."""
    return combine(digest_entries(source, world, group))


def source_for(trainer) -> "ReplicatedSource | FSDP2Source | ZeRO3Source":
    """The source for a training engine of ``dist_sr.rl.parallel``."""
    kind = type(trainer).__name__
    if kind == "FSDP2Engine":
        return FSDP2Source(trainer.module, trainer.ctx, trainer.rank, trainer.world)
    if kind == "DeepSpeedEngine" and trainer.zero3:
        return ZeRO3Source(trainer.module, trainer.rank, trainer.world)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    return ReplicatedSource(trainer.module, rank, world)
