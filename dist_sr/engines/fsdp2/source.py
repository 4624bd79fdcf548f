"""The working weights of an FSDP2-sharded model as a ``WeightSource``."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ...numerics import stochastic_round
from ...numerics.digest import dtype_name, piece_sum
from ...numerics.key import normalize_param_name
from ...numerics.shards import local_shard, replica_slot, split_range
from ...sources import LocalPiece, Meta
from .hook import SRShadowParam, plain


@torch.no_grad()  # DTensor.to_local() then returns the local tensor itself, not an autograd view
def sent_sums(module: torch.nn.Module, ctx) -> dict[str, int]:
    """Layout-free digest sums of the BF16 shards this rank handed to the all-gathers at the
    current key: the working weights as the forward pass used them, read from what was sent, not
    re-derived. A parameter not gathered since its last update is left out (so a digest over it
    cannot match). Under HSDP one rank per replica group counts, so each element counts once."""
    sums = {}
    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        sent = ctx.sent(normalize_param_name(name)) if isinstance(local, SRShadowParam) else None
        if sent is None or replica_slot(p)[0] != 0:
            continue
        bits, offset = sent
        rows = local_shard(p)[2]
        n = local.numel()
        if rows is None:
            sums[normalize_param_name(name)] = piece_sum(bits.reshape(-1)[:n], offset)
        else:  # a column shard: each row of the local block is a contiguous span of the parameter
            row_len, row_stride = rows
            flat = bits.reshape(n // row_len, -1)[:, :row_len].reshape(-1)
            sums[normalize_param_name(name)] = sum(
                piece_sum(flat[r * row_len : (r + 1) * row_len], offset + r * row_stride) for r in range(n // row_len)
            ) & ((1 << 64) - 1)
    return sums


def reshard_all(module: torch.nn.Module) -> None:
    """Reshard every FSDP2 module in ``module``. A forward without backward leaves FSDP2's root
    (which does not reshard after forward) holding unsharded BF16 parameters; a sharded module is
    left as it is. Anything that reads the FP32 shards calls this first."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


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
        """The sharded parameters (resharded first, so the source always reads the FP32 shards)."""
        reshard_all(self.module)
        return {normalize_param_name(n): p for n, p in self.module.named_parameters()}

    def metadata(self) -> list[Meta]:
        keep = self.ctx is None and not self.as_bf16
        return [(n, dtype_name(p.dtype) if keep else "bfloat16", tuple(p.shape)) for n, p in self.params.items()]

    def _rounded_local(self, name: str, params: dict, part: tuple[int, int] = (0, 1)) -> tuple[int, torch.Tensor]:
        """``(global offset, bits)`` of this rank's shard of ``name``, or of part ``i`` of ``n``
        equal parts of it (``part=(i, n)``)."""
        p = params[name]
        local, offset, rows = local_shard(p)
        if rows is not None:
            raise NotImplementedError(
                f"{name}: FSDP2 shards on a non-leading dim are not contiguous in the full "
                "tensor; shard-direct needs dim-0 shards (FSDP2's default)"
            )
        local = plain(local).detach().contiguous()
        if part != (0, 1):
            lo, hi = split_range(local.numel(), part[1], part[0])
            local, offset = local.view(-1)[lo:hi], offset + lo
        if self.ctx is None:
            return offset, local.to(torch.bfloat16) if self.as_bf16 else local
        if self.ctx.rounds(name) is not True:  # frozen: FSDP2's all-gather casts it round-to-nearest
            return offset, local.to(torch.bfloat16)
        return offset, stochastic_round(
            local, seed=self.ctx.seed, step=self.ctx.step, param=name, offset=offset, mode=self.ctx.mode
        )

    def local_pieces(self, names):
        """This rank's shard of each tensor, rounded one at a time as the caller iterates (a
        generator: only one rounded copy is alive at once). Under HSDP the ranks holding the same
        shard (one per replica group) each take an equal part of it, so every element is sent (and
        summed) once and every group's links carry a share."""
        params = self.params
        for n in names:
            offset, bits = self._rounded_local(n, params, replica_slot(params[n]))
            yield LocalPiece(n, offset, offset + bits.numel(), bits.reshape(-1))

    def working(self, name: str, params: dict | None = None) -> torch.Tensor:
        """The working weight ``name`` sharded as its master is: a BF16 DTensor over this rank's
        keyed bits (nothing gathered), or the plain tensor of an unsharded parameter."""
        params = self.params if params is None else params
        p = params[name]
        _, bits = self._rounded_local(name, params)
        if not isinstance(p, DTensor):
            return bits.view(p.shape)
        return DTensor.from_local(
            bits.view(p.to_local().shape), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )

    def full(self, name: str, params: dict | None = None) -> torch.Tensor:
        """The full working weight ``name`` on every rank (collective: every rank calls it)."""
        w = self.working(name, params)
        return w.full_tensor() if isinstance(w, DTensor) else w

    def gather(self, names):
        out, params = {}, self.params
        for n in names:
            full = self.full(n, params)
            if self.rank == 0:
                out[n] = full
        return out
