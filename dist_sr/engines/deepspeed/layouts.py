"""Where each kind of DeepSpeed optimizer keeps its FP32 masters and BF16 partitions, and the copy
site dist-sr takes over there (DeepSpeed versions in ``version.TESTED``).

Every layout hands its (FP32 flat, BF16 flat) pairs to one ``placement.PlacedRounding``: the keyed
rounding runs where the masters live and the bits are copied to where the working weights live,
so optimizer offload (masters on the host, weights on the accelerator) and parameter offload
(both on the host) take the same path as the rest. Keys are the parameter's name and the
element's index in the full parameter: ``_hp_mapping`` fragment offsets (stages 1-2,
``BF16_Optimizer``), ``ds_tensor`` partitions ``[r*pn, (r+1)*pn)`` (stage 3), and for AutoTP
shards their place in the full parameter (``tp``), never a flat-buffer offset.

- ZeRO-0 (``FP16_UnfusedOptimizer``): every parameter rounded after the optimizer's RTN copy.
- ZeRO-1/2 (``DeepSpeedZeroOptimizer``), ZeRO-1 with ``grad_accum_dtype: fp32``
  (``BF16_Optimizer``): the local partition rounded right before the all-gather of partitions.
- ZeRO-1/2 with ``offload_optimizer``: DeepSpeed copies each group's host FP32 partition into a
  host BF16 buffer (pinned with ``pin_memory``) and that buffer, non-blocking, to the device; the
  keyed rounding is written into that buffer right after the group's optimizer step, so the one
  copy DeepSpeed makes carries the keyed bits to the device, overlapped as DeepSpeed overlaps it.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``, with or without ``offload_param`` /
  ``offload_optimizer``): DeepSpeed's copy of each sub-group's FP32 partition into its BF16
  partition is replaced by the rounding on the masters' device and one copy of the bits.

Any other optimizer is refused before the first step (``check_optimizer``): ZenFlow and
SuperOffload by their config fields, and any subclass of the four classes above that defines
methods of its own (it may write the BF16 weights itself, as both of those do), naming them.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable

import torch

from ...numerics.shards import RowBlock, spans_in_range
from ..placement import FlatTransfer, PlacedRounding, Segment
from .tp import tp_blocks, tp_size
from .version import UnsupportedDeepSpeed


class Layout:
    """One optimizer's masters and partitions; ``sr`` is the engine's ``DeepSpeedSR``."""

    def __init__(self, sr):
        self.sr, self.opt = sr, sr.optimizer
        self.blocks = tp_blocks(sr.engine, sr.engine.module)  # AutoTP shards: their place in the full parameter
        self._plans: dict[Any, tuple[tuple, PlacedRounding]] = {}

    def segments(self, name: str, param, local: int, numel: int, at: int) -> list[Segment]:
        """Elements ``[local, local + numel)`` of ``param``'s flat local tensor, which sit at
        ``at`` in a flat partition, as segments keyed by their index in the full parameter."""
        total = getattr(param, "ds_numel", None) or param.numel()
        blocks = self.blocks.get(id(param)) or [RowBlock.contiguous(0, total, 0)]
        return [
            Segment(name, at + s.start - local, s.numel, s.offset, s.rows)
            for s in spans_in_range(blocks, local, local + numel)
        ]

    def plan(self, key, signature: tuple, build: Callable[[], PlacedRounding]) -> PlacedRounding:
        """The plan cached under ``key``, rebuilt when ``signature`` (the partitions' addresses) moved."""
        cached = self._plans.get(key)
        if cached is None or cached[0] != signature:
            if cached is not None:
                cached[1].release()
            cached = self._plans[key] = (signature, build())
        return cached[1]

    def run(self, plan: PlacedRounding, copy: bool = True) -> None:
        sr = self.sr
        plan.run(seed=sr.seed, step=sr.step, mode=sr.mode, copy=copy)

    def release(self) -> None:
        """Drop every plan (and with them every view of DeepSpeed's partitions): called before
        DeepSpeed moves them (``offload_states``); the next rounding builds them again."""
        for _, plan in self._plans.values():
            plan.release()
        self._plans.clear()

    def routes(self):
        """Where every piece is rounded and where its bits go (``placement.Route``s), as planned now."""
        self.plans()
        return [r for _, plan in self._plans.values() for r in plan.routes]

    def plans(self) -> list[PlacedRounding]:
        raise NotImplementedError

    def round_local(self) -> None:
        for plan in self.plans():
            self.run(plan)

    def master_pieces(self):
        """``(name, FP32 master piece, global offset)`` this rank counts in a digest."""
        for plan in self.plans():
            yield from plan.pieces()

    def after_step(self) -> None:
        """Called right after the optimizer's own step."""

    def install(self) -> None:
        """Patch the copy site."""

    def resync(self) -> None:
        raise NotImplementedError


class Stage0Layout(Layout):
    """ZeRO-0 (``FP16_UnfusedOptimizer``): no partitioning; every rank rounds its full masters
    after the optimizer's per-parameter RTN copy (nothing gathers after it)."""

    def pairs(self):
        for fp32_group, lp_group in zip(self.opt.fp32_groups, self.opt.fp16_groups):
            yield from zip(fp32_group, lp_group)

    def plans(self) -> list[PlacedRounding]:
        pairs = list(self.pairs())

        def build():
            return PlacedRounding(
                [
                    FlatTransfer(
                        hp.data.view(-1), lp.data.view(-1), self.segments(self.sr.names[id(lp)], lp, 0, lp.numel(), 0)
                    )
                    for hp, lp in pairs
                ]
            )

        signature = tuple(t.data_ptr() for pair in pairs for t in pair)
        return [self.plan("stage0", signature, build)]

    def after_step(self) -> None:
        if not self.opt.overflow:
            self.round_local()

    def master_pieces(self):
        if self.sr.engine.global_rank == 0:  # every rank holds every master: count them once
            yield from super().master_pieces()

    def resync(self) -> None:
        self.round_local()


class FragmentLayout(Layout):
    """ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: each group's local FP32
    partition and BF16 partition, with each parameter's fragment at ``_hp_mapping``; rounded
    right before the all-gather of the partitions."""

    def __init__(self, sr, *, lp_groups: str, groups_flat: str, masters: str, partitions: str, refresh_model: bool):
        super().__init__(sr)
        self.lp_groups, self.groups_flat_attr = lp_groups, groups_flat
        self.masters, self.partitions = masters, partitions
        self.refresh_model = refresh_model  # ZeRO-1/2 re-points the model's params after the gather

    @property
    def groups_flat(self):
        return getattr(self.opt, self.groups_flat_attr)

    def partition_id(self, i: int) -> int:
        import deepspeed.comm as ds_dist

        return ds_dist.get_rank(group=self.opt.real_dp_process_group[i])

    def transfer(self, i: int) -> FlatTransfer:
        """Group ``i``'s FP32 partition feeding its BF16 partition (offsets from ``_hp_mapping``)."""
        segments = []
        for p in getattr(self.opt, self.lp_groups)[i]:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is not None:
                hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
                segments += self.segments(self.sr.names[id(p)], p, lp.start, hp.numel, hp.start)
        source = getattr(self.opt, self.masters)[i].data
        dest = getattr(self.opt, self.partitions)[i][self.partition_id(i)].data
        return FlatTransfer(source, dest, segments)

    def signature(self, i: int) -> tuple:
        return (getattr(self.opt, self.masters)[i].data_ptr(), getattr(self.opt, self.partitions)[i][0].data_ptr())

    def plans(self) -> list[PlacedRounding]:
        groups = range(len(getattr(self.opt, self.lp_groups)))
        signature = tuple(self.signature(i) for i in groups)
        return [self.plan("local", signature, lambda: PlacedRounding([self.transfer(i) for i in groups]))]

    def install(self) -> None:
        _install_all_gather_hook(self)

    def resync(self) -> None:
        opt = self.opt
        self.round_local()
        _ORIGINAL_ALL_GATHER["fn"](
            groups_flat=self.groups_flat,
            partitioned_param_groups=getattr(opt, self.partitions),
            dp_process_group=opt.real_dp_process_group,
            start_alignment_factor=opt.nccl_start_alignment_factor,
            allgather_bucket_size=opt.allgather_bucket_size,
        )
        if self.refresh_model:
            for i in range(len(getattr(opt, self.lp_groups))):
                opt._update_model_bit16_weights(i)


class OffloadFragmentLayout(FragmentLayout):
    """ZeRO-1/2 with ``offload_optimizer``: host FP32 partitions, device BF16 partitions. The keyed
    bits go into DeepSpeed's host BF16 buffer of each group right after the group's optimizer
    step; DeepSpeed then copies masters -> buffer (made a no-op here) and buffer -> device
    partition (non-blocking when pinned), so one copy of BF16 bytes reaches the device."""

    def __init__(self, sr, **kwargs):
        super().__init__(sr, **kwargs)
        self._swapped: tuple[int, Any] | None = None

    def buffers(self) -> list[torch.Tensor]:
        return self.opt.param_buffer_of_bit16_for_cpu_offload_groups

    def group_plan(self, i: int) -> PlacedRounding:
        def build():
            t = self.transfer(i)
            t.staging, t.copied_by = self.buffers()[i], "deepspeed"
            return PlacedRounding([t], fill_gaps=True)

        return self.plan(("group", i), (*self.signature(i), self.buffers()[i].data_ptr()), build)

    def plans(self) -> list[PlacedRounding]:
        return [self.group_plan(i) for i in range(len(getattr(self.opt, self.lp_groups)))]

    def install(self) -> None:
        opt = self.opt
        optimizer_step, release = opt._optimizer_step, opt._release_preflattened_grad_buffers
        masters = getattr(opt, self.masters)

        def step_and_round(group_no, *args, **kwargs):
            self.restore()
            result = optimizer_step(group_no, *args, **kwargs)
            self.run(self.group_plan(group_no), copy=False)
            # DeepSpeed next copies masters[group_no] into the buffer (round-to-nearest) and the
            # buffer to the device: with the buffer standing in for the masters, the first copy is
            # of a tensor onto its own memory, which torch skips, and the second carries our bits
            self._swapped = (group_no, masters[group_no])
            masters[group_no] = self.buffers()[group_no]
            return result

        def release_and_restore(*args, **kwargs):
            self.restore()
            return release(*args, **kwargs)

        opt._optimizer_step = step_and_round
        opt._release_preflattened_grad_buffers = release_and_restore
        _install_all_gather_hook(self)  # resync gathers through DeepSpeed's own all-gather

    def restore(self) -> None:
        """Put the FP32 partition back where DeepSpeed keeps it (right after its copy)."""
        if self._swapped is not None:
            i, master = self._swapped
            getattr(self.opt, self.masters)[i] = master
            self._swapped = None

    def after_step(self) -> None:
        self.restore()


class Zero3Layout(Layout):
    """ZeRO-3: each sub-group's FP32 partition (``fp32_partitioned_groups_flat``) and BF16
    partition (``fp16_partitioned_groups_flat``; ``param.ds_tensor`` views into it hold elements
    ``[r*pn, (r+1)*pn)`` of the parameter on partition rank ``r``), on the host or the device as
    ``offload_optimizer`` / ``offload_param`` put them. DeepSpeed's copy between them is replaced
    by the keyed rounding where the masters are and one copy of the bits."""

    def __init__(self, sr):
        super().__init__(sr)
        if any(flat is None for flat in self.opt.fp16_partitioned_groups_flat):
            raise UnsupportedDeepSpeed(
                'zero_optimization.offload_param.device "nvme": DeepSpeed swaps those BF16 partitions '
                "through NVMe, where dist-sr does not round them; offload parameters to the CPU "
                '("device": "cpu") or keep them on the accelerator'
            )

    def transfer(self, sub_group_id: int) -> FlatTransfer:
        import deepspeed.comm as ds_dist

        opt = self.opt
        rank = ds_dist.get_rank(group=opt.sub_group_process_groups[sub_group_id])
        segments, at = [], 0
        for param, part in zip(opt.fp16_groups[sub_group_id], opt.fp16_partitioned_groups[sub_group_id]):
            n = part.ds_numel  # this rank's partition, padding included (the padding is a gap)
            segments += self.segments(self.sr.names[id(param)], param, rank * n, n, at)
            at += n
        source = opt.fp32_partitioned_groups_flat[sub_group_id].data
        dest = opt.fp16_partitioned_groups_flat[sub_group_id].data
        return FlatTransfer(source, dest, segments)

    def sub_group_plan(self, sub_group_id: int) -> PlacedRounding:
        opt = self.opt
        signature = (
            opt.fp32_partitioned_groups_flat[sub_group_id].data_ptr(),
            opt.fp16_partitioned_groups_flat[sub_group_id].data_ptr(),
        )
        # DeepSpeed's own copy here waits; so does this one
        return self.plan(
            ("zero3", sub_group_id),
            signature,
            lambda: PlacedRounding([self.transfer(sub_group_id)], fill_gaps=True, non_blocking=False),
        )

    def plans(self) -> list[PlacedRounding]:
        return [self.sub_group_plan(i) for i in range(len(self.opt.fp16_groups))]

    def install(self) -> None:
        opt = self.opt

        def reassign(sub_group_id):
            # DeepSpeed: fp16_flat.copy_(fp32_flat) (round-to-nearest), then re-point the ds_tensors
            self.run(self.sub_group_plan(sub_group_id))
            opt._unflatten_partitioned_parameters(sub_group_id)

        opt._reassign_or_swap_out_partitioned_parameters = reassign

    def resync(self) -> None:
        # persistent (small) parameters stay gathered between steps: release their stale full
        # copies (without writing them back), round the partitions, and gather them again, as
        # DeepSpeed's own step does
        persistent = self.opt.persistent_parameters
        if persistent:
            persistent[0].partition(persistent, has_been_updated=False)
        self.round_local()
        self.opt.checkpoint_event_epilogue()


def layout_for(sr) -> Layout:
    """The layout of ``sr.optimizer`` (DeepSpeed's classes as of the tested versions)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt, engine = sr.optimizer, sr.engine
    check_zero_features(engine)
    check_optimizer(opt)
    if tp_size(engine) > 1 and not isinstance(opt, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
        raise UnsupportedDeepSpeed(
            f'"tensor_parallel": {{"autotp_size": {tp_size(engine)}}} with ZeRO stage '
            f"{engine.zero_optimization_stage()}: dist-sr keys AutoTP shards by their place in the full "
            "parameter at ZeRO stages 1 and 2 (tested); use "
            '"zero_optimization": {"stage": 1} or 2 with tensor parallelism'
        )
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        if type(opt).__name__.startswith("MiCS"):
            raise UnsupportedDeepSpeed(
                "zero_optimization.mics_shard_size: MiCS partitions parameters within shard groups, "
                "which dist-sr does not key; drop mics_shard_size (plain ZeRO-3, or hpZ with "
                "zero_hpz_partition_size)"
            )
        return Zero3Layout(sr)
    if isinstance(opt, BF16_Optimizer):
        return FragmentLayout(
            sr,
            lp_groups="bf16_groups",
            groups_flat="bf16_groups_flat",
            masters="fp32_groups_flat_partition",
            partitions="bf16_partitioned_groups",
            refresh_model=False,
        )
    if isinstance(opt, DeepSpeedZeroOptimizer):
        kind = OffloadFragmentLayout if getattr(opt, "cpu_offload", False) else FragmentLayout
        return kind(
            sr,
            lp_groups="bit16_groups",
            groups_flat="bit16_groups_flat",
            masters="single_partition_of_fp32_groups",
            partitions="parallel_partitioned_bit16_groups",
            refresh_model=True,
        )
    if isinstance(opt, FP16_UnfusedOptimizer) and not opt.fused_lamb_legacy:
        return Stage0Layout(sr)
    raise UnsupportedDeepSpeed(
        f"dist_sr supports ZeRO stages 0-3 (stage 0 through FP16_UnfusedOptimizer); this engine's optimizer "
        f"is {type(opt).__name__} (ZeRO stage {engine.zero_optimization_stage()}). Use "
        '"zero_optimization": {"stage": 1} or higher'
    )


# The tested optimizer classes (the keys of ``layout_for``) and, for each, the methods that hold
# the FP32->BF16 copy dist-sr takes over or run the step around it (DeepSpeed 0.19.8).
COPY_SITES = {
    "DeepSpeedZeroOptimizer_Stage3": (
        "step",
        "_reassign_or_swap_out_partitioned_parameters",
        "_unflatten_partitioned_parameters",
        "_partitioned_params_swap_out",
    ),
    "DeepSpeedZeroOptimizer": ("step", "_optimizer_step", "_update_model_bit16_weights"),
    "BF16_Optimizer": ("step", "update_lp_params"),
    "FP16_UnfusedOptimizer": ("step",),
}


def tested_classes() -> tuple[type, ...]:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return (DeepSpeedZeroOptimizer_Stage3, DeepSpeedZeroOptimizer, BF16_Optimizer, FP16_UnfusedOptimizer)


def own_methods(cls: type, base: type) -> list[str]:
    """The methods ``cls`` and its ancestors below ``base`` define (constructors aside)."""
    below = cls.__mro__[: cls.__mro__.index(base)]
    return sorted(
        {
            name
            for klass in below
            for name, value in vars(klass).items()
            if name != "__init__"
            and (inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod, property)))
        }
    )


def check_optimizer(opt) -> None:
    """Refuse an optimizer whose BF16 working weights dist-sr does not know it keys: ZenFlow and
    SuperOffload by name, and any subclass of a tested class (``COPY_SITES``) that defines methods
    of its own, which may write the BF16 weights outside the copy sites dist-sr takes over (both
    of those do). Detected from the class, not assumed from the config."""
    if getattr(opt, "zenflow", False):  # ZeRO-1/2: ZenFlowZeroOptimizer; ZeRO-3: the stage-3 class with ZenFlow's hooks
        check_zero_config({"zenflow": type(opt).__name__})
    if type(opt).__name__ == "SuperOffloadOptimizer_Stage3":
        check_zero_config({"offload_optimizer": {"super_offload": True}})
    cls = type(opt)
    base = next((b for b in cls.__mro__ if b in tested_classes()), None)
    if base is None or base is cls:
        return
    own = own_methods(cls, base)
    if not own:
        return  # a subclass that only constructs differently: the tested methods do the copies
    replaced = [m for m in own if m in COPY_SITES[base.__name__]]
    raise UnsupportedDeepSpeed(
        f"DeepSpeed's optimizer is {cls.__module__}.{cls.__qualname__}, a subclass of {base.__name__} that "
        f"defines its own {', '.join(own)}"
        + (f" (replacing {', '.join(replaced)}, where {base.__name__} copies FP32 to BF16)" if replaced else "")
        + f": dist-sr keys the copies of {base.__name__} and does not assume this class writes the BF16 weights "
        "only there. Turn off the DeepSpeed feature that selects it (train with DeepSpeed's own "
        f'{base.__name__}), or leave out "stochastic_rounding"'
    )


def check_zero_features(engine) -> None:
    """``check_zero_config`` of an initialized engine."""
    zero = {}
    for field in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        read = getattr(engine, field, None)
        zero[field] = bool(read()) if callable(read) else False
    config = getattr(engine, "config", None)
    raw = config.get("zero_optimization") if isinstance(config, dict) else None
    if isinstance(raw, dict) and "mics_shard_size" in raw:
        zero["mics_shard_size"] = raw["mics_shard_size"]
    check_zero_config(zero)


def check_zero_config(zero: dict) -> None:
    """Refuse, by their names in the ``zero_optimization`` section, ZeRO features whose working
    weights are not the BF16 partitions dist-sr rounds (before DeepSpeed builds anything)."""
    for field in ("zero_quantized_weights", "zero_quantized_nontrainable_weights"):
        if zero.get(field):
            raise UnsupportedDeepSpeed(
                f"zero_optimization.{field}: ZeRO++ all-gathers those weights quantized to int8, so the forward "
                "pass would not use the keyed BF16 bits; turn it off (zero_quantized_gradients and hpZ, "
                "zero_hpz_partition_size, are supported)"
            )
    mics = zero.get("mics_shard_size", -1)
    if isinstance(mics, int) and mics > 0:
        raise UnsupportedDeepSpeed(
            f"zero_optimization.mics_shard_size={mics}: MiCS partitions parameters within shard groups, which "
            "dist-sr does not key; drop mics_shard_size (plain ZeRO-3, or hpZ with zero_hpz_partition_size)"
        )
    if zero.get("zenflow") is not None:
        raise UnsupportedDeepSpeed(
            "zero_optimization.zenflow: ZenFlow writes the BF16 weights outside the copies dist-sr keys: its "
            "selective AdamW updates the selected columns of the working weights in BF16 during the backward pass "
            "(no FP32 master), each selection copies BF16 back over the FP32 masters, and with overlap_step it "
            'copies FP32 to BF16 itself (round-to-nearest). Remove the "zenflow" block (ZeRO-Offload without it, '
            '"offload_optimizer": {"device": "cpu"}, is keyed), or leave out "stochastic_rounding"'
        )
    offload = zero.get("offload_optimizer")
    if isinstance(offload, dict) and offload.get("super_offload"):
        raise UnsupportedDeepSpeed(
            "zero_optimization.offload_optimizer.super_offload: SuperOffload (SuperOffloadOptimizer_Stage3, CUDA "
            "only) steps the CPU optimizer asynchronously during the backward pass and copies FP32 to BF16 in its "
            'own methods, which dist-sr has not run and does not assume it keys. Set "super_offload": false '
            '(ZeRO-3 with "offload_optimizer": {"device": "cpu"} is keyed), or leave out "stochastic_rounding"'
        )


# ZeRO-1/2 and BF16_Optimizer copy the partition and then call all_gather_dp_groups(groups_flat=...):
# the hook rounds the local partition of the engine that owns ``groups_flat`` right before the gather.
_ENGINES_BY_GROUPS: dict[int, "weakref.ref[FragmentLayout]"] = {}
_ORIGINAL_ALL_GATHER: dict[str, Any] = {}


def _install_all_gather_hook(layout: FragmentLayout) -> None:
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.zero import stage_1_and_2

    if "fn" not in _ORIGINAL_ALL_GATHER:
        original = stage_1_and_2.all_gather_dp_groups
        if bf16_optimizer.all_gather_dp_groups is not original:
            raise UnsupportedDeepSpeed("DeepSpeed's all_gather_dp_groups is already patched by someone else")
        _ORIGINAL_ALL_GATHER["fn"] = original

        def all_gather_dp_groups(*args, **kwargs):
            groups_flat = kwargs.get("groups_flat", args[0] if args else None)
            ref = _ENGINES_BY_GROUPS.get(id(groups_flat))
            owner = ref() if ref is not None else None
            if owner is not None and owner.groups_flat is groups_flat:
                owner.sr.round_local()
            return original(*args, **kwargs)

        stage_1_and_2.all_gather_dp_groups = all_gather_dp_groups
        bf16_optimizer.all_gather_dp_groups = all_gather_dp_groups
    if not isinstance(layout, OffloadFragmentLayout):  # offload rounds in its optimizer step instead
        _ENGINES_BY_GROUPS[id(layout.groups_flat)] = weakref.ref(layout)
