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

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..numerics import stochastic_round
from ..numerics.key import check_mode, normalize_param_name

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
        for field_name in ("seed", "mode"):
            if state[field_name] != getattr(self, field_name):
                raise ValueError(f"checkpoint has {field_name}={state[field_name]!r}, this run "
                                 f"{getattr(self, field_name)!r}; prepare() with the checkpoint's value to resume")
        self.step = int(state["step"])
        self.version += 1


# ops whose tensor outputs stay SR shadows: the views and the padded copy FSDP2 makes of the
# parameter while sharding it. Everything else (optimizer states from zeros_like, clones, math)
# comes out as plain tensors.
_KEEP = {
    aten.view.default, aten._unsafe_view.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.chunk.default, aten.slice.Tensor, aten.narrow.default, aten.as_strided.default,
    aten.new_zeros.default, aten.new_empty.default, aten.new_empty_strided.default,
    aten.detach.default, aten.alias.default,
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
            cls, data.size(), strides=data.stride(), storage_offset=data.storage_offset(), dtype=data.dtype,
            layout=data.layout, device=data.device, requires_grad=data.requires_grad)

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
        return tree_map(lambda t: SRShadowParam(t, src._ctx, src._name)
                        if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, out)

    # -- FSDP2 all-gather extension ------------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        """The BF16 all-gather input: this rank's (padded) shard, rounded with global indices."""
        ctx = self._ctx
        cached = getattr(self, "_rounded", None)
        if ctx.cache_rounded and cached is not None and cached[0] == (ctx.step, ctx.version):
            bf16 = cached[1]
            if ctx.record_gathers:
                from ..replica import tensor_digest

                ctx.gathers.append((self._name, ctx.step, cached[2], tensor_digest(bf16)))
            return (bf16,), None
        local = self._data
        world, rank = mesh.size(), mesh.get_local_rank()
        offset, row_stride, padded = shard_layout(tuple(orig_size), tuple(local.shape), world, rank)
        if tuple(local.shape) != padded:  # a short trailing shard: FSDP2 all-gathers equal sizes
            full = local.new_zeros(padded)
            full[tuple(slice(0, n) for n in local.shape)] = local
            local = full
        bf16 = stochastic_round(local, seed=ctx.seed, step=ctx.step, param=self._name, offset=offset,
                                mode=ctx.mode, row_stride=row_stride, backend=ctx.backend)
        if ctx.cache_rounded:
            self._rounded = ((ctx.step, ctx.version), bf16, offset)
        if ctx.record_gathers:
            from ..replica import tensor_digest

            ctx.gathers.append((self._name, ctx.step, offset, tensor_digest(bf16)))
        return (bf16,), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:  # FSDP2 re-gathered into the storage of the existing unsharded param
            return None
        return data, (data,)


def shard_layout(orig_size: tuple[int, ...], local_shape: tuple[int, ...], world: int, rank: int):
    """Global flat offset, row stride (for a non-leading shard dim, else None) and padded shape of
    FSDP2's shard ``rank``.

    FSDP2 shards with ``torch.chunk`` semantics (chunk = ceil(size/world), trailing ranks may be
    empty) and pads every shard to the first one's size; padding rows hold zeros, which round
    to zero under any key.
    """
    if local_shape == orig_size or world == 1:
        return 0, None, orig_size
    dims = [d for d, (a, b) in enumerate(zip(orig_size, local_shape)) if a != b]
    dim = dims[0] if dims else 0
    chunk = math.ceil(orig_size[dim] / world)
    inner = math.prod(orig_size[dim + 1:])
    padded = orig_size[:dim] + (chunk,) + orig_size[dim + 1:]
    if dim == 0:
        return rank * chunk * inner, None, padded
    # a column block: local element (r, c) of the [prod(orig[:dim]), chunk*inner] view
    return rank * chunk * inner, orig_size[dim] * inner, padded


def replica_slot(p: torch.Tensor) -> tuple[int, int]:
    """``(index, count)``: which of the ``count`` ranks holding the same shard of ``p`` this rank
    is (its coordinates on the ``Replicate`` mesh dims, row-major); ``(0, 1)`` when nothing is
    replicated. HSDP's replica groups use it to split a shard's work among themselves."""
    from torch.distributed.tensor import DTensor, Replicate

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
    a DTensor, its local shard placed in the full tensor (``torch.chunk`` semantics, as FSDP2 and
    DTensor shard). Any number of ``Replicate`` mesh dims and at most one ``Shard`` are supported
    (FSDP2, HSDP). ``rows = (row_len, row_stride)`` marks a shard on a non-leading dim: viewed as
    ``[-1, row_len]``, its row ``r`` starts at global ``offset + r * row_stride``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return p, 0, None
    local = p.to_local()
    shards = [(i, pl) for i, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if not shards:
        return local, 0, None
    if len(shards) > 1 or not isinstance(shards[0][1], Shard):
        raise NotImplementedError(f"keyed rounding of a DTensor with placements {p.placements}: one Shard "
                                  "(any number of Replicate) is supported")
    mesh_dim, placement = shards[0]
    world, coord = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
    dim, shape = placement.dim, tuple(p.shape)
    chunk = math.ceil(shape[dim] / world) if shape[dim] else 0
    inner = math.prod(shape[dim + 1:])
    offset = min(coord * chunk, shape[dim]) * inner
    if dim == 0 or math.prod(shape[:dim]) == 1:
        return local, offset, None
    return local, offset, (local.shape[dim] * inner, shape[dim] * inner)


def prepare(model: nn.Module, *, seed: int, mode: str = "stochastic", backend: str = "auto") -> SRContext:
    """Wrap every FP32 trainable parameter of ``model`` in ``SRShadowParam``; call before ``fully_shard``.

    Parameters keep their names (the rounding keys). Returns the shared ``SRContext``.
    """
    check_mode(mode)
    ctx = SRContext(seed=seed, mode=mode, backend=backend)
    for full_name, param in list(model.named_parameters()):
        if not param.requires_grad:
            continue
        if param.dtype != torch.float32:
            raise TypeError(f"{full_name!r} is {param.dtype}: FSDP2 SR keeps the FP32 master as the sharded "
                            "parameter; build the model in FP32 and let the all-gather cast to BF16")
        if isinstance(param, SRShadowParam) or hasattr(param, "_local_tensor"):
            raise ValueError(f"{full_name!r} is already wrapped or sharded: call prepare() before fully_shard()")
        owner_name, _, attr = full_name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        wrapped = nn.Parameter(SRShadowParam(param.detach(), ctx, normalize_param_name(full_name)),
                               requires_grad=True)
        setattr(owner, attr, wrapped)
    return ctx


def sharded_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's sharded FP32 masters as DTensors over plain local tensors, for
    ``torch.distributed.checkpoint``: saving writes the masters, loading (at any world size)
    writes into them in place; the BF16 weights are re-derived at the next all-gather."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.state_dict().items():
        if isinstance(p, DTensor) and isinstance(p._local_tensor, SRShadowParam):
            p = DTensor.from_local(p._local_tensor._data, p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride(), run_check=False)
        out[name] = p
    return out


def full_master(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{name: full FP32 master}`` gathered from the shards (collective: call on every rank)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[normalize_param_name(name)] = _plain(full)
    return out


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t._data if isinstance(t, SRShadowParam) else t


@dataclass
class FSDP2Config:
    """How to shard a model with FSDP2 under the precision switch (see configs/fsdp2-sr.yaml)."""

    shard_modules: list[str] = field(default_factory=lambda: ["Qwen2DecoderLayer", "LlamaDecoderLayer"])
    reshard_after_forward: bool = True
    # HSDP: shard within groups of world/replicate ranks (e.g. a node), replicate across the groups
    replicate: int = 1

    @classmethod
    def from_dict(cls, data: dict | None) -> "FSDP2Config":
        data = dict(data or {})
        unknown = sorted(set(data) - {"shard_modules", "reshard_after_forward", "replicate"})
        if unknown:
            raise ValueError(f"fsdp2: unknown field(s) {unknown}; valid: replicate, reshard_after_forward, "
                             "shard_modules")
        cfg = cls(**data)
        if not isinstance(cfg.replicate, int) or isinstance(cfg.replicate, bool) or cfg.replicate < 1:
            raise ValueError(f"fsdp2.replicate must be a positive int, got {cfg.replicate!r}")
        return cfg

    def check_world(self, world: int) -> None:
        """HSDP needs world = replicate x shard-group size."""
        if world % self.replicate:
            raise ValueError(f"fsdp2.replicate={self.replicate} does not divide the world size {world}: HSDP "
                             "needs world = replicate x shard-group size")

    def mesh(self):
        """The device mesh: None (FSDP2's default, shard over the world) or, with ``replicate`` > 1,
        a ``(replicate, shard)`` mesh for HSDP. Needs the process group."""
        if self.replicate == 1:
            return None
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        self.check_world(world)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return init_device_mesh(device, (self.replicate, world // self.replicate),
                                mesh_dim_names=("replicate", "shard"))


def pure_bf16_optimizer(model: nn.Module, precision, **adamw_kwargs):
    """``AdamWSR`` over a model sharded by ``apply_fsdp2(model, "bf16-pure-sr")``: each rank
    updates its BF16 shards; the bits equal the unsharded ``AdamWSR`` at any world size."""
    from ..optim import AdamWSR
    from ..precision import PrecisionConfig

    if not isinstance(precision, PrecisionConfig):
        precision = PrecisionConfig.from_dict(precision)
    named = [(normalize_param_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    return AdamWSR(named, seed=precision.seed, moment_dtype=precision.moment_dtype, backend=precision.backend,
                   **adamw_kwargs)


def apply_fsdp2(model: nn.Module, precision, config: FSDP2Config | dict | None = None) -> SRContext | None:
    """``fully_shard`` every module whose class name is in ``config.shard_modules``, then the root,
    with the behaviour the precision switch selects. Returns the ``SRContext`` (track your
    optimizer with it) for the BF16 precisions, else None.

    fp32: plain FSDP2. fp16: FP16 all-gather (round-to-nearest), FP32 reduction. bf16 /
    bf16-sr / bf16-dither: FP32 sharded masters, BF16 all-gather rounded by the key (``nearest``,
    ``stochastic``, ``dither``), FP32 reduction. bf16-pure-sr: no master at all: the trainable
    parameters become BF16 (round-to-nearest, as a BF16 checkpoint would be) and are sharded as
    they are, gradients reduce in FP32; pair it with ``AdamWSR`` (``pure_bf16_optimizer``), which
    updates each BF16 shard in place with keys from the shard's global offsets.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ..precision import PrecisionConfig

    if not isinstance(precision, PrecisionConfig):
        precision = PrecisionConfig.from_dict(precision)
    if not isinstance(config, FSDP2Config):
        config = FSDP2Config.from_dict(config)
    p = precision.precision
    ctx = None
    if p == "bf16-pure-sr":
        for name, param in model.named_parameters():
            if param.requires_grad and param.is_floating_point():
                if hasattr(param, "_local_tensor"):
                    raise ValueError(f"{name!r} is already sharded: apply_fsdp2 before fully_shard")
                param.data = param.data.to(torch.bfloat16)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    elif p == "fp32":
        policy = MixedPrecisionPolicy()
    elif p == "fp16":
        policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    else:
        ctx = prepare(model, seed=precision.seed, mode=precision.rounding, backend=precision.backend)
        policy = MIXED_PRECISION
    blocks = [m for m in model.modules() if type(m).__name__ in config.shard_modules]
    if not blocks:
        raise ValueError(f"fsdp2.shard_modules {config.shard_modules} match no module of {type(model).__name__}; "
                         "name its transformer block class")
    mesh = config.mesh()
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward)
    return ctx
