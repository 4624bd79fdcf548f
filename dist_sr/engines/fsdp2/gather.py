"""The BF16 all-gather inputs of an SR model's FSDP2 shards: the keyed rounding of each padded
local FP32 shard, done for the whole model in one batched kernel call per step.

FSDP2 casts a group's padded local shards to ``param_dtype`` right before each all-gather: with a
``torch._foreach_copy_`` into the all-gather buffer (its fast path), or one ``.to()`` per
parameter (world size 1, older torch). ``SRShadowParam``'s dispatch (hook.py) hands both here. The first
cast at a new key (the step after an optimizer step, or masters written) rounds every wrapped
shard of this rank into kept BF16 shards; every cast then copies a kept shard, so a step costs
one rounding launch however many groups and re-gathers there are, and FSDP2 keeps its own copies
(a foreach copy per group, as torch's BF16 ``MixedPrecisionPolicy`` makes). The kept shards are
also ``SRContext.sent``: the bits the forward used, which the trainer's digest reads.

With FSDP2's ``CPUOffloadPolicy`` the sharded masters stay on the host and FSDP2 moves each
all-gather input to the device before casting it; here the rounding runs on the host (the C++
kernel, once per step for every shard, into pinned kept shards) and the move carries the BF16
bits, half the bytes of the FP32 master FSDP2 would copy (``moved``).

Nothing here keeps a master's storage alive across a device move: a wrapped master copied to
another device (``model.cpu()``, ``model.to(device)``, ``param.data = param.data.to(...)``, as
verl's offload helpers do) drops every view and kept shard (``release``), and the next cast
reads the layouts again where the shards are then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...numerics import RoundingBatch, RoundingJob, round_jobs
from ...numerics.shards import padded_shard
from ...replica import tensor_digest
from ..placement import Route


class KeyState(Protocol):
    """What the rounder reads of its model's ``SRContext``."""

    seed: int
    mode: str
    step: int
    version: int
    backend: str
    cache_rounded: bool
    record_gathers: bool
    gathers: list
    module: Any  # weakref to the wrapped model


# ``src`` below is an ``SRShadowParam`` (hook.py), the FP32 master as FSDP2 hands it to its cast:
# ``src.master`` the plain FP32 tensor, ``src.param_name`` the name it is keyed by.
Shadow = Any


@dataclass(frozen=True)
class GatherLayout:
    """Where FSDP2's padded local shard of a parameter (its all-gather input: ``padded``
    elements, flat, at the start of the local shard's storage) lies in the full parameter."""

    offset: int  # global flat index of the shard's first element
    rows: tuple[int, int] | None  # (row_len, row_stride) for a shard on a non-leading dim
    padded: tuple[int, ...]
    source: torch.Tensor  # the padded shard, flat FP32 (plain: a view of the local shard's storage)
    numel: int
    address: int  # the source's data_ptr
    gathered_on: torch.device | None = None  # where FSDP2 all-gathers it, when not where the shard is (offload)

    @classmethod
    def of(
        cls,
        offset: int,
        rows: tuple[int, int] | None,
        padded: tuple[int, ...],
        local: torch.Tensor,
        gathered_on: torch.device | None = None,
    ):
        """The layout of the padded shard whose first rows are the plain local shard ``local``."""
        numel = math.prod(padded)
        source = local.as_strided((numel,), (1,), 0)  # the padding rows follow the local rows
        moved = gathered_on if gathered_on is not None and gathered_on != source.device else None
        return cls(offset, rows, padded, source, numel, source.data_ptr(), moved)

    def holds(self, data: torch.Tensor) -> bool:
        """Whether ``data`` is this padded shard: the same memory (not a shard FSDP2 has since
        re-created by ``to_empty``, a device move or a reload with assignment), the same length."""
        return data.data_ptr() == self.address and data.numel() == self.numel

    def job(self, name: str, x: torch.Tensor, out: torch.Tensor) -> RoundingJob:
        if self.rows is None:
            return RoundingJob(name, x.view(-1), out.view(-1), self.offset)
        row_len, row_stride = self.rows
        return RoundingJob(name, x.view(-1, row_len), out.view(-1, row_len), self.offset, row_stride)


class ShardRounder:
    """Rounds one SR model's padded local shards with its ``SRContext``'s key and keeps them."""

    def __init__(self, ctx: KeyState):
        self.ctx = ctx
        self.layouts: dict[str, GatherLayout] = {}
        self._batch: RoundingBatch | None = None  # every shard -> its kept BF16 shard
        self._kept: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (flat BF16 shard, offset), the batch's
        self._rounded_at: tuple[int, int] | None = None  # the (step, version) the kept shards hold
        # an all-gather group's shard addresses -> their kept bits and offsets: a group checked
        # once copies without looking at each shard again, until the batch is rebuilt
        self._groups: dict[tuple[int, ...], tuple[list[torch.Tensor], list[int]]] = {}
        self._moving: Any = None  # the event after the last copy out of the pinned kept shards
        # (address, numel) of each offloaded all-gather input -> the device FSDP2 gathers it on:
        # plain numbers, so that reading them never holds a storage
        self._offloaded_inputs: dict[tuple[int, int], torch.device] = {}

    # -- what FSDP2's casts call --------------------------------------------------------------

    def into(self, pairs: list[tuple[Shadow, torch.Tensor]]) -> None:
        """FSDP2's foreach copy-in: write each all-gather input ``src``'s bits into ``out``."""
        ctx = self.ctx
        if not ctx.cache_rounded:  # round afresh into FSDP2's buffer: one call for the group
            jobs = [self.layout_of(src).job(src.param_name, src.master, out) for src, out in pairs]
            round_jobs(jobs, seed=ctx.seed, step=ctx.step, mode=ctx.mode, backend=ctx.backend)
            self._record([(job.param, out, job.offset) for job, (_, out) in zip(jobs, pairs)])
            return
        where = tuple(src.master.data_ptr() for src, _ in pairs)
        group = self._groups.get(where)
        if group is None:
            for src, _ in pairs:  # every shard checked before any bits are taken: a re-read rebuilds the batch
                self._check(src)
            if self._stale():
                self._round_all()
            kept = [self._kept[src.param_name] for src, _ in pairs]
            group = self._groups[where] = ([bits for bits, _ in kept], [offset for _, offset in kept])
        elif self._stale():
            self._round_all()
        torch._foreach_copy_([out for _, out in pairs], group[0])
        self._record([(src.param_name, bits, offset) for (src, _), bits, offset in zip(pairs, *group)])

    def one(self, src: Shadow) -> torch.Tensor:
        """FSDP2's per-parameter cast (``.to(param_dtype)``): the bits of ``src``, shaped like it.
        The kept shard itself is returned, not a copy: FSDP2 only copies from its all-gather
        inputs."""
        ctx = self.ctx
        if ctx.cache_rounded:
            bits, offset = self.current(src)
        else:
            bits, offset = self._fresh(src)
        if ctx.record_gathers:
            self._record([(src.param_name, bits, offset)])
        return bits if bits.shape == src.shape else bits.view(src.shape)

    def moved(self, src: Shadow, device: torch.device) -> "MovedShard | None":
        """FSDP2's move of an offloaded all-gather input to ``device`` (``CPUOffloadPolicy``):
        its BF16 bits, rounded on the host, copied there (None: not such a move, which then
        runs as any copy of the master does)."""
        gathered_on = self._gathered_on(src.master)
        if gathered_on is None or gathered_on != device:
            return None
        bits, offset = self.current(src) if self.ctx.cache_rounded else self._fresh(src)
        if self.ctx.record_gathers:
            self._record([(src.param_name, bits, offset)])
        pinned = bits.is_pinned()
        on_device = bits.to(device, non_blocking=pinned)
        if pinned and on_device.is_cuda:
            self._moving = torch.cuda.Event()
            self._moving.record()
        return MovedShard(on_device.view(src.shape), src.param_name)

    def _fresh(self, src: Shadow) -> tuple[torch.Tensor, int]:
        ctx, layout = self.ctx, self.layout_of(src)
        job = layout.job(src.param_name, src.master, torch.empty(layout.numel, dtype=torch.bfloat16, device=src.device))
        round_jobs([job], seed=ctx.seed, step=ctx.step, mode=ctx.mode, backend=ctx.backend)
        return job.out.view(-1), job.offset

    def sent(self, name: str) -> tuple[torch.Tensor, int] | None:
        if self._stale():
            return None
        return self._kept.get(name)

    # -- the kept shards ------------------------------------------------------------------------

    def current(self, src: Shadow) -> tuple[torch.Tensor, int]:
        """``(flat BF16 bits, offset)`` of ``src`` at the current key, rounding every shard of the
        model first when the key has moved on since the last rounding."""
        self._check(src)
        if self._stale():
            self._round_all()
        return self._kept[src.param_name]

    def _check(self, src: Shadow) -> None:
        """Refuse anything but an all-gather input; read the layouts again for a re-created shard."""
        layout = self.layouts.get(src.param_name)
        if layout is None or not layout.holds(src.master):
            self.layout_of(src)

    def _stale(self) -> bool:
        """Whether the kept shards hold another key than the current one (a step taken, masters
        written): they are rounded again before anything reads them."""
        at, ctx = self._rounded_at, self.ctx
        return at is None or at[0] != ctx.step or at[1] != ctx.version

    def _round_all(self) -> None:
        ctx = self.ctx
        if self._batch is None:
            jobs = [layout.job(name, layout.source, _kept_shard(layout)) for name, layout in self.layouts.items()]
            self._batch = RoundingBatch(jobs, backend=ctx.backend)
            self._kept = {job.param: (job.out.view(-1), job.offset) for job in jobs}
        if self._moving is not None:  # the last copy out of the pinned kept shards must be done
            self._moving.synchronize()
            self._moving = None
        self._batch.run(seed=ctx.seed, step=ctx.step, mode=ctx.mode)
        self._rounded_at = (ctx.step, ctx.version)

    def release(self) -> None:
        """Drop every view of the shards and every kept shard (the masters are moving to another
        device); the next cast reads the layouts again where the shards are then."""
        self.layouts, self._kept, self._groups, self._offloaded_inputs = {}, {}, {}, {}
        self._batch, self._rounded_at, self._moving = None, None, None

    def _gathered_on(self, data: torch.Tensor) -> torch.device | None:
        """The device FSDP2 all-gathers ``data`` on, if ``data`` is the all-gather input of a
        parameter its ``CPUOffloadPolicy`` keeps on the host; else None."""
        key = (data.data_ptr(), data.numel())
        if key not in self._offloaded_inputs:
            module = self.ctx.module() if self.ctx.module is not None else None
            self._offloaded_inputs = _offloaded_inputs(module) if module is not None else {}
        return self._offloaded_inputs.get(key)

    def routes(self) -> list[Route]:
        """Where each shard is rounded and where its bits go (``placement.Route``), as read now."""
        return [
            Route(
                name,
                str(layout.source.device),
                str(layout.source.device),
                str(layout.gathered_on or layout.source.device),
                "dist-sr" if layout.gathered_on is not None else None,
            )
            for name, layout in self.layouts.items()
        ]

    def _record(self, shards: list[tuple[str, torch.Tensor, int]]) -> None:
        if self.ctx.record_gathers:
            for name, bits, offset in shards:
                digest = tensor_digest(bits.view(self.layouts[name].padded))
                self.ctx.gathers.append((name, self.ctx.step, offset, digest))

    # -- where each shard lies -----------------------------------------------------------------

    def layout_of(self, src: Shadow) -> GatherLayout:
        """Where the all-gather input ``src`` lies in its full parameter. Read from the model's
        sharded parameters when first needed and again when FSDP2 has re-created a shard; refuses
        a tensor that is not a whole padded shard FSDP2 made of a parameter wrapped here."""
        layout = self.layouts.get(src.param_name)
        if layout is None or not layout.holds(src.master):
            self._read_layouts()
            layout = self.layouts.get(src.param_name)
        if layout is None or not layout.holds(src.master):
            raise refusal(src.param_name, "a BF16 copy (not an all-gather input FSDP2 made of it)")
        return layout

    def _read_layouts(self) -> None:
        module = self.ctx.module() if self.ctx.module is not None else None
        if module is None:
            return
        found = {}
        gathered_on = _offloaded(module)
        for p in module.parameters():  # the sharded ones (FSDP2 swaps in BF16 ones only inside forward)
            # the DTensor's own local tensor: to_local() would make a view, and views made while
            # a cast is being dispatched come out plain
            local = getattr(p, "_local_tensor", None)
            if getattr(local, "_ctx", None) is self.ctx:
                found[local.param_name] = GatherLayout.of(  # type: ignore[union-attr]
                    *padded_shard(p),
                    local.master,  # type: ignore[union-attr]
                    gathered_on.get(id(p)),
                )
        # a parameter unsharded right now keeps its layout: a shard of it re-created since fails
        # holds() at its next gather, which reads the layouts again
        if any(n not in self.layouts or not self.layouts[n].holds(lay.source) for n, lay in found.items()):
            # what was rounded from shards FSDP2 no longer uses is dropped
            self.layouts = {**self.layouts, **found}
            self._batch, self._rounded_at = None, None
            self._groups.clear()


def _kept_shard(layout: GatherLayout) -> torch.Tensor:
    """The kept BF16 shard of ``layout``: beside its master, pinned when FSDP2 copies it to CUDA."""
    pin = layout.gathered_on is not None and layout.gathered_on.type == "cuda"
    return torch.empty(layout.numel, dtype=torch.bfloat16, device=layout.source.device, pin_memory=pin)


def _offloaded(module) -> dict[int, torch.device]:
    """``id(sharded parameter) -> the device FSDP2 all-gathers it on``, for the parameters a
    ``CPUOffloadPolicy`` keeps on the host."""
    return {id(fp.sharded_param): fp.device for fp in _offloaded_params(module)}


def _offloaded_inputs(module) -> dict[tuple[int, int], torch.device]:
    """``(address, numel)`` of each offloaded parameter's all-gather input (the plain tensor
    inside its SR wrapper) -> the device FSDP2 all-gathers it on."""
    out = {}
    for fp in _offloaded_params(module):
        data = getattr(fp._sharded_param_data, "_data", fp._sharded_param_data)
        out[(data.data_ptr(), data.numel())] = fp.device
    return out


def _offloaded_params(module) -> list:
    """FSDP2's ``FSDPParam``s of ``module`` that a ``CPUOffloadPolicy`` keeps on the host."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            state = m._get_fsdp_state()
        except AssertionError:  # fully_shard has not finished with it
            continue
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch < 2.12: one group per module
            group = getattr(state, "_fsdp_param_group", None)
            groups = [group] if group is not None else []
        for group in groups:
            out += [fp for fp in group.fsdp_params if fp.offload_to_cpu]
    return out


class MovedShard(torch.Tensor):
    """What FSDP2's move of an offloaded FP32 all-gather input to the device returns: it stands
    for the FP32 shard (dtype, shape, device) but holds only its keyed BF16 bits, which is all
    FSDP2 asks of it (the cast to ``param_dtype`` right after the move)."""

    _bits: torch.Tensor
    _name: str

    @staticmethod
    def __new__(cls, bits: torch.Tensor, name: str):
        return torch.Tensor._make_wrapper_subclass(cls, bits.size(), dtype=torch.float32, device=bits.device)

    def __init__(self, bits: torch.Tensor, name: str):
        self._bits, self._name = bits, name

    @property
    def param_name(self) -> str:
        """The name the rounding key uses for it (as ``SRShadowParam.param_name``)."""
        return self._name

    def __repr__(self) -> str:
        return f"MovedShard({self._name!r}, {self._bits!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        src = args[0]
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == torch.bfloat16:
            if kwargs.get("device") in (None, src.device):
                return src._bits
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return MovedShard(src._bits, src.param_name)
        if func is torch.ops.aten.view.default:
            return MovedShard(src._bits.view(args[1]), src.param_name)
        raise NotImplementedError(
            f"{func} on the device copy of the offloaded FP32 master of {src.param_name!r}: under FSDP2's "
            "CPUOffloadPolicy dist-sr moves only its keyed BF16 bits for the all-gather; read the master "
            "on the host with fsdp2.plain(param)"
        )


def refusal(name: str, what: str) -> TypeError:
    """The error for a cast of a wrapped master that is not FSDP2's all-gather cast."""
    return TypeError(
        f"{what} of the FP32 master of {name!r} would round to nearest: with SR, dist-sr casts only "
        "the padded local shards fully_shard all-gathers, to BF16. Read the master with "
        "fsdp2.plain(param), or the BF16 working weights with dist_sr.export_bf16"
    )
