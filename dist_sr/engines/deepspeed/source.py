"""The working weights of a ZeRO-3 DeepSpeed engine as a ``WeightSource``."""

from __future__ import annotations

import torch

from ...numerics.digest import dtype_name
from ...numerics.key import normalize_param_name
from ...sources import LocalPiece, Meta


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
            out.append(LocalPiece(n, start, end, p.ds_tensor.detach().reshape(-1)[: end - start]))
        return out

    def gather(self, names):
        import deepspeed  # an optional dependency: this source exists only under a DeepSpeed engine

        params = [self.params[n] for n in names]
        with deepspeed.zero.GatheredParameters(params):
            return {n: p.detach().clone() for n, p in zip(names, params)} if self.rank == 0 else {}
