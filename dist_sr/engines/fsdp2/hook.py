"""FSDP2 (``torch.distributed.fsdp.fully_shard``): SR in the all-gather cast.

Each FP32 parameter is wrapped in ``SRShadowParam`` *before* ``fully_shard``. FSDP2 then shards
it as usual (the sharded FP32 master is the optimizer's parameter). Before each all-gather FSDP2
casts a group's padded local shards to BF16 with one ``torch._foreach_copy_``; for shards of
wrapped parameters that cast is ``stochastic_round``, keyed by the parameter's name and the
shard's global element offsets, in one batched kernel call per group (FSDP2's own fast path: no
per-parameter hook, the host work of torch's BF16 ``MixedPrecisionPolicy``). Because the bits
are keyed, the backward re-gather reproduces the forward weights exactly, every rank agrees, and
any world size or shard layout gives the bits of rounding the full master. Gradients are reduced
in FP32 (``MixedPrecisionPolicy(reduce_dtype=torch.float32)``) and kept in FP32 on the FP32
shards; the optimizer is any stock torch optimizer.

    ctx = fsdp2.prepare(model, seed=1234, mode="stochastic")   # before fully_shard
    for block in model.model.layers:
        fully_shard(block, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mp_policy=fsdp2.MIXED_PRECISION)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-6, foreach=True)
    ctx.track(opt)                                             # the key's step follows the optimizer
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...numerics import live
from ...numerics.key import check_key_state, check_mode, normalize_param_name
from .gather import ShardRounder, refusal

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
    # Every shard is rounded once per key and kept (one BF16 copy of each local shard): the
    # re-gathers of a step copy the kept bits. False: every all-gather rounds afresh.
    cache_rounded: bool = True
    version: int = 0  # bumped whenever the masters may have changed: invalidates kept shards
    names: set[str] = field(default_factory=set)  # the parameters wrapped (rounded with this key)
    frozen: set[str] = field(default_factory=set)  # the model's other parameters (cast to BF16 as they are)
    aliases: dict[str, str] = field(default_factory=dict)  # a tied weight's other names -> the name it is keyed by
    # the wrapped model (weakly): where the shard layouts are read from once FSDP2 has sharded it
    module: Any = None
    rounder: ShardRounder = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.rounder = ShardRounder(self)

    def rounds(self, name: str) -> bool | None:
        name = self.aliases.get(name, name)
        return True if name in self.names else False if name in self.frozen else None

    def key_name(self, name: str) -> str:
        """The name a (possibly tied) parameter is keyed by."""
        return self.aliases.get(name, name)

    def sent(self, name: str) -> tuple[torch.Tensor, int] | None:
        """``(flat BF16 padded shard, global offset)`` this rank's all-gathers send for ``name``
        at the current key (the bits the forward pass used), if it has been rounded since the
        key last moved, else None."""
        return self.rounder.sent(name)

    def release(self) -> None:
        """Let go of every view of the masters and every kept BF16 shard (a custom offload that
        moves the masters without ``.to``/``.cpu`` calls this first); the next all-gather rounds
        the shards where they are then. A move through ``.to`` releases by itself."""
        self.rounder.release()

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
# else (optimizer states from zeros_like, clones, math) comes out plain.
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
    aten._pin_memory.default,  # FSDP2's CPUOffloadPolicy pins the padded shard
}
# the casts that would lose the master's low bits: FSDP2's all-gather cast (a foreach copy, or
# ``.to(param_dtype)`` where it takes its slow path) becomes the keyed rounding; anything else
# that lowers a wrapped master's precision is refused rather than rounded to nearest
_FOREACH_COPY, _TO_COPY, _COPY = aten._foreach_copy_.default, aten._to_copy.default, aten.copy_.default
_CASTS = {_FOREACH_COPY, _TO_COPY, _COPY}


def _lowers(dtype) -> bool:
    return dtype is not None and dtype.is_floating_point and dtype.itemsize < 4


def _plain_args(args):
    """``args`` with every SRShadowParam (also inside a list, as foreach ops take them) replaced
    by its FP32 data: a comprehension per argument, not a pytree walk (optimizer foreach ops pass
    every parameter of a group through here)."""
    out = []
    for a in args:
        if isinstance(a, SRShadowParam):
            a = a._data
        elif isinstance(a, (list, tuple)):
            a = [t._data if isinstance(t, SRShadowParam) else t for t in a]
        out.append(a)
    return out


class SRShadowParam(torch.Tensor):
    """An FP32 parameter whose FSDP2 all-gather input is its keyed stochastic rounding to BF16.

    Every other operation sees the plain FP32 tensor (``_data``), so optimizers, clipping and
    checkpoints work on it unchanged; a cast that would lower its precision is either FSDP2's
    all-gather cast (rounded with the key) or refused.
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

    @property
    def master(self) -> torch.Tensor:
        """The plain FP32 tensor this parameter stands for (what optimizers and checkpoints see)."""
        return self._data

    @property
    def param_name(self) -> str:
        """The name the rounding key uses for it (a tied weight's first name)."""
        return self._name

    @property
    def sr_context(self) -> SRContext:
        """The key's shared state (seed, mode, step) it is rounded with."""
        return self._ctx

    def __repr__(self) -> str:
        return f"SRShadowParam({self._name!r}, {self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], (self._ctx, self._name)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return SRShadowParam(inner["_data"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CASTS:
            done = _cast(func, args, kwargs)
            if done is not _NOT_A_CAST:
                return done
        elif func.namespace == "fsdp":  # FSDP2's own copy-in ops get BF16 inputs, cast above
            raise NotImplementedError(
                f"this torch's FSDP2 (torch {torch.__version__}) hands wrapped FP32 masters to {func}: "
                "dist-sr's SR all-gather knows FSDP2's foreach and per-parameter casts before its "
                "copy-in; use a torch whose FSDP2 casts first (2.11 to 2.13 are tested)"
            )
        out = func(*_plain_args(args), **dict(zip(kwargs, _plain_args(kwargs.values()))))
        if func not in _KEEP:
            return out
        src = next(a for a in args if isinstance(a, SRShadowParam))
        if isinstance(out, torch.Tensor):
            return SRShadowParam(out, src._ctx, src._name) if out.dtype == torch.float32 else out
        return type(out)(SRShadowParam(t, src._ctx, src._name) if t.dtype == torch.float32 else t for t in out)


# -- FSDP2's all-gather cast ------------------------------------------------------------------

_NOT_A_CAST = object()


def _cast(func, args, kwargs):
    """A cast of wrapped masters to a lower precision, done with the key; ``_NOT_A_CAST`` for
    anything else (an FP32 copy, a device move), which dispatch runs as any other op."""
    if func is _FOREACH_COPY:  # FSDP2's all-gather copy-in of a whole group
        outs, srcs = args[0], args[1]
        keyed = [isinstance(s, SRShadowParam) and _lowers(o.dtype) for o, s in zip(outs, srcs)]
        if not any(keyed):
            return _NOT_A_CAST
        plain = [i for i, k in enumerate(keyed) if not k]
        if plain:  # frozen parameters gathered in the same group: FSDP2's plain cast
            torch._foreach_copy_([outs[i] for i in plain], [srcs[i] for i in plain], **kwargs)
        by_ctx: dict[int, list[tuple[SRShadowParam, torch.Tensor]]] = {}
        for i in (i for i, k in enumerate(keyed) if k):
            if outs[i].dtype != torch.bfloat16:
                raise refusal(srcs[i]._name, f"a {outs[i].dtype} copy")
            by_ctx.setdefault(id(srcs[i]._ctx), []).append((srcs[i], outs[i]))
        for group in by_ctx.values():  # (two SR models in one process gather in separate groups)
            group[0][0]._ctx.rounder.into(group)
        return None
    if func is _TO_COPY:  # FSDP2's per-parameter path: ``.to(param_dtype)``
        if not _lowers(kwargs.get("dtype")):
            device = kwargs.get("device")
            if device is not None and torch.device(device) != args[0].device:
                rounder = args[0]._ctx.rounder
                moved = rounder.moved(args[0], torch.device(device))  # CPUOffloadPolicy's move to the device
                if moved is not None:
                    return moved
                rounder.release()  # an offload, a reload: hold none of the masters' storage
            return _NOT_A_CAST
        if kwargs["dtype"] != torch.bfloat16 or kwargs.get("device") not in (None, args[0].device):
            raise refusal(args[0]._name, f"a {kwargs['dtype']} copy on {kwargs.get('device')}")
        return args[0]._ctx.rounder.one(args[0])
    out, src = args[0], args[1]  # copy_(out, src)
    if not (isinstance(src, SRShadowParam) and _lowers(out.dtype)):
        return _NOT_A_CAST
    if out.dtype != torch.bfloat16:
        raise refusal(src._name, f"a {out.dtype} copy")
    return out.copy_(src._ctx.rounder.one(src))


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
    ctx.module = weakref.ref(model)
    live.register(ctx)  # export_bf16 finds the key of these names
    return ctx


def sharded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's sharded FP32 masters as DTensors over plain local tensors, for
    ``torch.distributed.checkpoint``: saving writes the masters, loading (at any world size)
    writes into them in place; the BF16 weights are re-derived at the next all-gather."""
    return {name: master_dtensor(p) for name, p in model.state_dict().items()}


def master_dtensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor whose local shard is an ``SRShadowParam``, as a DTensor over that shard's plain
    FP32 master (same mesh and placements); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(t, DTensor) and isinstance(t._local_tensor, SRShadowParam)):
        return t
    return DTensor.from_local(
        t._local_tensor.master, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False
    )


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
