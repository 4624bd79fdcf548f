"""FSDP2 (``torch.distributed.fsdp.fully_shard``): SR in the all-gather cast.

Each FP32 parameter is wrapped in ``SRShadowParam`` *before* ``fully_shard``. FSDP2 then shards
it as usual (the sharded FP32 master is the optimizer's parameter), and through the all-gather
extension hooks every gather sends ``stochastic_round(local FP32 shard)``, keyed by the
parameter's name and the shard's global element offset, in BF16. Because the bits are keyed,
the backward re-gather reproduces the forward weights exactly, every rank agrees, and any world
size or shard layout gives the bits of rounding the full master. Gradients are reduced in FP32
(``MixedPrecisionPolicy(reduce_dtype=torch.float32)``) and kept in FP32 on the FP32 shards; the
optimizer is any stock torch optimizer.

    ctx = fsdp2.prepare(model, seed=1234, mode="stochastic")   # before fully_shard
    for block in model.model.layers:
        fully_shard(block, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mp_policy=fsdp2.MIXED_PRECISION)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, foreach=True)
    ctx.track(opt)                                             # the key's step follows the optimizer
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ...numerics import live, stochastic_round
from ...numerics.key import check_key_state, check_mode, normalize_param_name
from ...numerics.shards import shard_layout
from ...replica import tensor_digest

aten = torch.ops.aten

try:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    MIXED_PRECISION = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
except ImportError:  # pragma: no cover - torch without FSDP2
    MIXED_PRECISION = None


@dataclass
class SRContext:
    """The rounding key's shared state: seed, mode and the optimizer step whose result is live."""

    seed: int
    mode: str
    step: int = 0
    backend: str = "auto"
    gathers: list[tuple[str, int, int, str]] = field(default_factory=list)  # (name, step, offset, digest)
    record_gathers: bool = False
    # The backward re-gather of a step reuses the forward's rounded shard instead of rounding again
    # (the bits are the same by construction); costs one BF16 copy of each local shard.
    cache_rounded: bool = True
    version: int = 0  # bumped whenever the masters may have changed: invalidates cached shards
    # name -> ((step, version), BF16 shard, global offset) last handed to the all-gather. Kept
    # here, not on the parameter: FSDP2 calls the hook on its own view of the sharded storage.
    rounded: dict[str, tuple[tuple[int, int], torch.Tensor, int]] = field(default_factory=dict)
    names: set[str] = field(default_factory=set)  # the parameters wrapped (rounded with this key)
    frozen: set[str] = field(default_factory=set)  # the model's other parameters (cast to BF16 as they are)
    aliases: dict[str, str] = field(default_factory=dict)  # a tied weight's other names -> the name it is keyed by

    def rounds(self, name: str) -> bool | None:
        name = self.aliases.get(name, name)
        return True if name in self.names else False if name in self.frozen else None

    def key_name(self, name: str) -> str:
        """The name a (possibly tied) parameter is keyed by."""
        return self.aliases.get(name, name)

    def sent(self, name: str) -> tuple[torch.Tensor, int] | None:
        """``(BF16 shard, global offset)`` this rank last handed to the all-gather for ``name``,
        if that was at the current key (the bits the forward pass used), else None."""
        cached = self.rounded.get(name)
        if cached is None or cached[0] != (self.step, self.version):
            return None
        return cached[1], cached[2]

    def track(self, optimizer: torch.optim.Optimizer):
        """Advance the key's step after every ``optimizer.step()``; returns the hook handle."""

        def advance(*_: Any) -> None:
            self.step += 1
            self.version += 1

        return optimizer.register_step_post_hook(advance)

    def masters_changed(self) -> None:
        """Call after writing the FP32 masters outside an optimizer step (e.g. loading weights)."""
        self.version += 1

    def state_dict(self) -> dict:
        return {"seed": self.seed, "mode": self.mode, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        check_key_state(state, seed=self.seed, mode=self.mode)
        self.step = int(state["step"])
        self.version += 1


# ops whose FP32 tensor outputs stay SR shadows: the views and the padded copy FSDP2 makes of the
# parameter while sharding it, and the parameter moved to another device (``module.to(device)``,
# FSDP2's own move to the mesh's device, verl's ``to_empty`` of meta-initialised ranks: without
# these the wrapper would be lost and the all-gather would cast round-to-nearest). Everything
# else (optimizer states from zeros_like, clones, math, casts to BF16) comes out plain.
_KEEP = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.chunk.default,
    aten.slice.Tensor,
    aten.narrow.default,
    aten.as_strided.default,
    aten.new_zeros.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.detach.default,
    aten.alias.default,
    aten._to_copy.default,
    aten.empty_like.default,
}


class SRShadowParam(torch.Tensor):
    """An FP32 parameter whose FSDP2 all-gather input is its keyed stochastic rounding to BF16.

    Every other operation sees the plain FP32 tensor (``_data``), so optimizers, clipping and
    checkpoints work on it unchanged.
    """

    _data: torch.Tensor
    _ctx: SRContext
    _name: str

    @staticmethod
    def __new__(cls, data: torch.Tensor, ctx: SRContext, name: str):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor, ctx: SRContext, name: str):
        self._data, self._ctx, self._name = data, ctx, name

    def __repr__(self) -> str:
        return f"SRShadowParam({self._name!r}, {self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], (self._ctx, self._name)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return SRShadowParam(inner["_data"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        found: list[SRShadowParam] = []

        def unwrap(t):
            if isinstance(t, SRShadowParam):
                found.append(t)
                return t._data
            return t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        if func not in _KEEP:
            return out
        src = found[0]
        return tree_map(
            lambda t: (
                SRShadowParam(t, src._ctx, src._name) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t
            ),
            out,
        )

    # -- FSDP2 all-gather extension ------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """The BF16 all-gather input: this rank's (padded) shard, rounded with global indices."""
        ctx = self._ctx
        cached = ctx.sent(self._name) if ctx.cache_rounded else None
        if cached is not None:
            bf16 = cached[0]
            if ctx.record_gathers:
                ctx.gathers.append((self._name, ctx.step, cached[1], tensor_digest(bf16)))
            return (bf16,), None
        local = self._data
        world, rank = mesh.size(), mesh.get_local_rank()
        offset, row_stride, padded = shard_layout(tuple(orig_size), tuple(local.shape), world, rank)
        if tuple(local.shape) != padded:  # a short trailing shard: FSDP2 all-gathers equal sizes
            full = local.new_zeros(padded)
            full[tuple(slice(0, n) for n in local.shape)] = local
            local = full
        bf16 = stochastic_round(
            local,
            seed=ctx.seed,
            step=ctx.step,
            param=self._name,
            offset=offset,
            mode=ctx.mode,
            row_stride=row_stride,
            backend=ctx.backend,
        )
        if ctx.cache_rounded:
            ctx.rounded[self._name] = ((ctx.step, ctx.version), bf16, offset)
        if ctx.record_gathers:
            ctx.gathers.append((self._name, ctx.step, offset, tensor_digest(bf16)))
        return (bf16,), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:  # FSDP2 re-gathered into the storage of the existing unsharded param
            return None
        return data, (data,)


def prepare(model: nn.Module, *, seed: int, mode: str = "stochastic", backend: str = "auto") -> SRContext:
    """Wrap every FP32 trainable parameter of ``model`` in ``SRShadowParam``; call before ``fully_shard``.

    Parameters keep their names (the rounding keys). Returns the shared ``SRContext``.
    """
    check_mode(mode)
    ctx = SRContext(seed=seed, mode=mode, backend=backend)
    wrapped_by_id: dict[int, tuple[nn.Parameter, str]] = {}  # a tied parameter is wrapped once, under its first name
    for full_name, param in list(model.named_parameters(remove_duplicate=False)):
        name = normalize_param_name(full_name)
        owner_name, _, attr = full_name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if id(param) in wrapped_by_id:  # another name of a tied weight: the same wrapped parameter
            wrapped, first = wrapped_by_id[id(param)]
            setattr(owner, attr, wrapped)
            ctx.aliases[name] = first
            continue
        if not param.requires_grad:
            ctx.frozen.add(name)
            continue
        if param.dtype != torch.float32:
            raise TypeError(
                f"{full_name!r} is {param.dtype}: FSDP2 SR keeps the FP32 master as the sharded "
                "parameter; build the model in FP32 and let the all-gather cast to BF16"
            )
        if isinstance(param, SRShadowParam) or hasattr(param, "_local_tensor"):
            raise ValueError(f"{full_name!r} is already wrapped or sharded: call prepare() before fully_shard()")
        wrapped = nn.Parameter(SRShadowParam(param.detach(), ctx, name), requires_grad=True)
        setattr(owner, attr, wrapped)
        wrapped_by_id[id(param)] = (wrapped, name)
        ctx.names.add(name)
    live.register(ctx)  # export_bf16 finds the key of these names
    return ctx


def sharded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's sharded FP32 masters as DTensors over plain local tensors, for
    ``torch.distributed.checkpoint``: saving writes the masters, loading (at any world size)
    writes into them in place; the BF16 weights are re-derived at the next all-gather."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.state_dict().items():
        if isinstance(p, DTensor) and isinstance(p._local_tensor, SRShadowParam):
            p = DTensor.from_local(
                p._local_tensor._data, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
            )
        out[name] = p
    return out


def full_master(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full FP32 master}`` gathered from the shards (collective: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[normalize_param_name(name)] = plain(full)
    return out


def plain(t: torch.Tensor) -> torch.Tensor:
    """The FP32 tensor behind an ``SRShadowParam`` (a plain tensor as it is), detached."""
    t = t.detach()
    return t._data if isinstance(t, SRShadowParam) else t
