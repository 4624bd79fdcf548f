"""DeepSpeed ZeRO: keyed SR where DeepSpeed copies its FP32 master partitions into BF16.

DeepSpeed has no extension point for that copy, so this module patches the copy sites of the
DeepSpeed versions it was tested with (``TESTED``), and refuses any other version at attach time:

- ZeRO-0 (``FP16_UnfusedOptimizer``, no partitioning): after its per-parameter copy, every
  BF16 parameter is overwritten with the keyed rounding of its full FP32 master.
- ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ZeRO-1 with ``grad_accum_dtype: fp32``
  (``BF16_Optimizer``): after the RTN copy of the local partition and before the all-gather of
  the BF16 partitions, every parameter fragment in the local partition is overwritten with
  ``stochastic_round(fp32 fragment)`` keyed by the parameter's name and the fragment's element
  offset inside the parameter (``param._hp_mapping.lp_fragment_address.start``), never a
  flat-buffer offset (padding depends on the world size). CPU offload takes the same path.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): after the copy into each sub-group's BF16 partition,
  every ``param.ds_tensor`` (elements ``[r*pn, (r+1)*pn)`` of the parameter on partition rank ``r``)
  is overwritten with its keyed rounding.
- Checkpoints: after ``engine.load_checkpoint`` (normal or universal, any world size) the BF16
  weights are re-derived from the loaded FP32 master with the restored step, so the RTN copies in
  DeepSpeed's loaders never win.

The key's step is ``engine.global_steps`` (saved in every DeepSpeed checkpoint): the rounding
inside optimizer step ``k`` uses ``k``.

Turned on from the DeepSpeed JSON config itself::

    "stochastic_rounding": {"enabled": true, "seed": 1234, "mode": "stochastic"}

with ``dist_sr.engines.deepspeed.initialize`` as a drop-in for ``deepspeed.initialize``
(or, for unmodified scripts, the start-up hook ``dist-sr deepspeed-hook install``).
"""

from __future__ import annotations

import copy
import functools
import logging
import weakref
from typing import Any

import torch

from ...numerics import RoundingBatch, RoundingJob, live, stochastic_round
from ...numerics.digest import piece_sum
from ...numerics.key import check_mode, normalize_param_name
from .config import CONFIG_KEY, SRConfig, agree_with_env, load_ds_config, split_config
from .version import UnsupportedDeepSpeed, check_universal_reload, check_version

log = logging.getLogger("dist_sr.deepspeed")


def initialize(*args: Any, **kwargs: Any):
    """``deepspeed.initialize`` that reads the ``"stochastic_rounding"`` block of the config
    (given as ``config``, ``config_params`` or ``args.deepspeed_config``, a dict or a JSON path)
    and attaches SR to the engine; returns what ``deepspeed.initialize`` returns."""
    import deepspeed  # an optional dependency

    return hooked_initialize(getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize))(*args, **kwargs)


def hooked_initialize(original):
    """Wrap ``deepspeed.initialize``: a call whose config has no enabled SR block goes to
    ``original`` unchanged; otherwise the block is removed, the rest is passed as ``config`` (and
    ``args.deepspeed_config`` cleared on a copy of ``args``), and SR is attached to the engine.
    Installed for unmodified scripts by ``dist-sr deepspeed-hook install``."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any):
        sr, args, kwargs = take_sr_block(args, kwargs)
        if sr is None:
            return original(*args, **kwargs)
        check_version()  # before any work is done
        result = original(*args, **kwargs)
        engine = result[0]
        reason = untrained(engine)
        if reason:  # a reference or eval model built from the training config: its weights stay as loaded
            log.warning("dist-sr: no SR for DeepSpeed engine of %s: %s", type(engine.module).__name__, reason)
            return result
        attach(engine, seed=sr.seed, mode=sr.mode)
        log.warning(
            "dist-sr: keyed SR attached to DeepSpeed engine of %s (ZeRO stage %d, seed %d, mode %s)",
            type(engine.module).__name__,
            engine.zero_optimization_stage(),
            sr.seed,
            sr.mode,
        )
        return result

    wrapper.__dist_sr_hook__ = True
    return wrapper


def untrained(engine) -> str | None:
    """Why ``engine`` never updates its weights, or None if it trains: DeepSpeed's own test (no
    client optimizer and no ``optimizer`` section), as for a reference or eval model built from
    the policy's config (TRL with ``beta > 0``); DeepSpeed then wraps a ``DummyOptim`` or, at
    ZeRO-3, only offloads parameters."""
    if getattr(engine, "client_optimizer", None) is None and not engine.optimizer_name():
        return "it has no optimizer (a reference or eval model)"
    opt = getattr(engine, "optimizer", None)
    from deepspeed.runtime.utils import DummyOptim
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    if (
        opt is None
        or isinstance(opt, (DummyOptim, DeepSpeedZeRoOffload))
        or isinstance(getattr(opt, "optimizer", None), DummyOptim)
    ):
        return "it has no optimizer (a reference or eval model)"
    return None


def take_sr_block(args: tuple, kwargs: dict) -> tuple[SRConfig | None, tuple, dict]:
    """Find the DeepSpeed config the way ``deepspeed.initialize`` does; if it has our block, return
    it and the call's arguments with the block removed. A config without the block takes the
    job's environment (``DIST_SR_SEED``/``DIST_SR_MODE``, ``config.env_config``)."""
    ds_args = kwargs["args"] if "args" in kwargs else (args[0] if args else None)
    from_args = None
    for attr in ("deepspeed_config", "deepscale_config"):
        if getattr(ds_args, attr, None) is not None:
            from_args = attr
    config = kwargs.get("config")
    if config is None:
        config = kwargs.get("config_params")
    if config is not None and from_args is not None:
        return None, args, kwargs  # DeepSpeed refuses a config given twice; let it say so
    if config is None and from_args is not None:
        config = getattr(ds_args, from_args)
    if config is None:
        return None, args, kwargs
    if not isinstance(config, dict):
        config = load_ds_config(config)
    if CONFIG_KEY not in config:  # the job's environment may still turn SR on (DIST_SR_SEED)
        return agree_with_env(None, False), args, kwargs
    config, sr = split_config(config)
    sr = agree_with_env(sr, True)
    kwargs = {k: v for k, v in kwargs.items() if k != "config_params"}
    kwargs["config"] = config  # the block disabled still has to go: DeepSpeed would ignore it anyway
    if from_args is not None:
        ds_args = copy.copy(ds_args)
        setattr(ds_args, from_args, None)
        if "args" in kwargs:
            kwargs["args"] = ds_args
        else:
            args = (ds_args, *args[1:])
    return sr, args, kwargs


def attach(engine, *, seed: int, mode: str = "stochastic") -> "DeepSpeedSR":
    """Make ``engine``'s FP32->BF16 copies keyed SR; call right after ``deepspeed.initialize``."""
    check_version()
    check_mode(mode)
    if not engine.bfloat16_enabled():
        raise ValueError(
            'stochastic rounding needs BF16 working weights: enable "bf16" in the DeepSpeed config '
            "(FP16 weights keep round-to-nearest; SR into FP16 is not supported)"
        )
    sr = DeepSpeedSR(engine, seed, mode)
    sr.install()
    engine.dist_sr = sr  # the handle: engine.dist_sr.resync(), .step, .seed, .mode
    live.register(sr)  # export_bf16 finds the key of this engine's parameters
    return sr


class DeepSpeedSR:
    """The patched state of one engine: its optimizer's copy sites round with the key; where the
    FP32 master and the BF16 partitions live depends on the optimizer (``Layout``)."""

    def __init__(self, engine, seed: int, mode: str):
        self.engine, self.seed, self.mode = engine, seed, mode
        self.optimizer = engine.optimizer
        self.names = {id(p): normalize_param_name(n) for n, p in engine.module.named_parameters()}
        self.trained = {self.names[id(p)] for p in engine.module.parameters() if p.requires_grad}
        self.aliases = {
            normalize_param_name(n): self.names[id(p)]  # a tied weight's other names
            for n, p in engine.module.named_parameters(remove_duplicate=False)
            if normalize_param_name(n) != self.names[id(p)]
        }
        self._in_step = False
        self._batches: dict = {}
        self.layout = layout_for(self)

    @property
    def step(self) -> int:
        """The optimizer step whose result is being rounded (global_steps advances after it)."""
        return self.engine.global_steps + (1 if self._in_step else 0)

    def rounds(self, name: str) -> bool | None:
        name = self.aliases.get(name, name)
        return True if name in self.trained else False if name in self.names.values() else None

    def key_name(self, name: str) -> str:
        """The name a (possibly tied) parameter is keyed by."""
        return self.aliases.get(name, name)

    @torch.no_grad()
    def round_local(self) -> None:
        """Overwrite this rank's BF16 partition with the keyed rounding of its FP32 master."""
        self.layout.round_local()

    def run(self, key, sources, jobs) -> None:
        """Round one set of pieces at the current key, through a batch cached under ``key`` and
        rebuilt when any piece's storage moved (``sources()``: their addresses; ``jobs()``: the
        ``RoundingJob``s, built only then)."""
        signature = sources()
        cached = self._batches.get(key)
        if cached is None or cached[0] != signature:
            cached = self._batches[key] = (signature, RoundingBatch(jobs()))
        cached[1].run(seed=self.seed, step=self.step, mode=self.mode)

    def install(self) -> None:
        opt, engine = self.optimizer, self.engine
        original_step = opt.step

        def step(*args, **kwargs):
            self._in_step = True
            try:
                result = original_step(*args, **kwargs)
                self.layout.after_step()
                return result
            finally:
                self._in_step = False

        opt.step = step
        self.layout.install()
        original_load = engine.load_checkpoint

        def load_checkpoint(*args, **kwargs):
            if engine.load_universal_checkpoint():
                check_universal_reload()
            result = original_load(*args, **kwargs)
            self.resync()  # the loaders copy RTN: re-derive the keyed bits from the loaded master
            return result

        engine.load_checkpoint = load_checkpoint
        self.resync()  # step-0 rounding of the initial master

    @torch.no_grad()
    def resync(self) -> None:
        """Re-derive every BF16 weight from the FP32 master under the current key (collective)."""
        self.layout.resync()

    @torch.no_grad()
    def master_sums(self) -> dict[str, int]:
        """Layout-free digest sums of this rank's share of the working weights re-derived from the
        FP32 masters with the key (the ranks' shares are disjoint): what the BF16 copies must be."""
        sums: dict[str, int] = {}
        for name, hp, offset in self.layout.master_pieces():
            bits = stochastic_round(
                hp.detach().reshape(-1), seed=self.seed, step=self.step, param=name, offset=offset, mode=self.mode
            )
            sums[name] = (sums.get(name, 0) + piece_sum(bits, offset)) & ((1 << 64) - 1)
        return sums


class Layout:
    """Where one kind of DeepSpeed optimizer keeps its masters and BF16 partitions, and which copy
    site dist-sr patches."""

    def __init__(self, sr: DeepSpeedSR):
        self.sr, self.opt = sr, sr.optimizer

    def round_local(self) -> None:
        raise NotImplementedError

    def master_pieces(self):
        """``(name, FP32 master piece, global offset)`` this rank counts in a digest."""
        raise NotImplementedError

    def after_step(self) -> None:
        """Called right after the optimizer's own step (which copied the partition RTN)."""

    def install(self) -> None:
        """Patch the copy site."""

    def resync(self) -> None:
        raise NotImplementedError


class PairsLayout(Layout):
    """Layouts whose pieces are (FP32 source, BF16 destination) pairs rounded in one batch."""

    def pairs(self):
        raise NotImplementedError

    def master_pieces(self):
        """``(name, FP32 master piece, global offset)`` this rank counts in a digest."""
        for name, hp, _, offset in self.pairs():
            yield name, hp, offset

    def round_local(self) -> None:
        self.sr.run(
            "local",
            lambda: tuple((hp.data_ptr(), lp.data_ptr(), hp.numel(), offset) for _, hp, lp, offset in self.pairs()),
            lambda: [RoundingJob(name, hp.data, lp.data, offset) for name, hp, lp, offset in self.pairs()],
        )


class Stage0Layout(PairsLayout):
    """ZeRO-0 (``FP16_UnfusedOptimizer``): no partitioning; every rank rounds its full masters
    after the optimizer's per-parameter RTN copy (nothing gathers after it)."""

    def pairs(self):
        for fp32_group, lp_group in zip(self.opt.fp32_groups, self.opt.fp16_groups):
            for hp, lp in zip(fp32_group, lp_group):
                yield self.sr.names[id(lp)], hp, lp, 0

    def after_step(self) -> None:
        if not self.opt.overflow:
            self.round_local()

    def master_pieces(self):
        if self.sr.engine.global_rank == 0:  # every rank holds every master: count them once
            yield from super().master_pieces()

    def resync(self) -> None:
        self.round_local()


class FragmentLayout(PairsLayout):
    """ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ``BF16_Optimizer``: each parameter's fragment of the
    local partition (``param._hp_mapping``), rounded right before the all-gather of the partitions."""

    def __init__(self, sr: DeepSpeedSR, *, lp_groups: str, groups_flat: str, partitions: str, refresh_model: bool):
        super().__init__(sr)
        self.lp_groups, self.groups_flat_attr, self.partitions = lp_groups, groups_flat, partitions
        self.refresh_model = refresh_model  # ZeRO-1/2 re-points the model's params after the gather

    @property
    def groups_flat(self):
        return getattr(self.opt, self.groups_flat_attr)

    def pairs(self):
        for group in getattr(self.opt, self.lp_groups):
            for p in group:
                mapping = getattr(p, "_hp_mapping", None)
                if mapping is not None:
                    yield (
                        self.sr.names[id(p)],
                        mapping.hp_fragment,
                        mapping.lp_fragment,
                        mapping.lp_fragment_address.start,
                    )

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


class Zero3Layout(Layout):
    """ZeRO-3: each ``param.ds_tensor`` (elements ``[r*pn, (r+1)*pn)`` on partition rank ``r``),
    rounded after the optimizer's copy into each sub-group's BF16 partition."""

    def round_local(self) -> None:
        for sub_group_id in range(len(self.opt.fp16_groups)):
            self.round_sub_group(sub_group_id)

    def master_pieces(self):
        for sub_group_id in range(len(self.opt.fp16_groups)):
            for job in self.jobs(sub_group_id):
                yield job.param, job.x, job.offset

    def round_sub_group(self, sub_group_id: int) -> None:
        opt = self.opt
        fp32_flat = opt.fp32_partitioned_groups_flat[sub_group_id]
        self.sr.run(
            ("zero3", sub_group_id),
            lambda: (fp32_flat.data_ptr(), *(part.data_ptr() for part in opt.fp16_partitioned_groups[sub_group_id])),
            lambda: self.jobs(sub_group_id),
        )

    def jobs(self, sub_group_id: int) -> list[RoundingJob]:
        import deepspeed.comm as ds_dist

        opt = self.opt
        fp32_flat = opt.fp32_partitioned_groups_flat[sub_group_id]
        rank = ds_dist.get_rank(group=opt.sub_group_process_groups[sub_group_id])
        jobs, offset = [], 0
        for param, part in zip(opt.fp16_groups[sub_group_id], opt.fp16_partitioned_groups[sub_group_id]):
            n = part.ds_numel
            if n:
                src = fp32_flat.data.narrow(0, offset, n)
                jobs.append(RoundingJob(self.sr.names[id(param)], src, part.data.view(-1)[:n], rank * n))
            offset += n
        return jobs

    def install(self) -> None:
        opt = self.opt
        original = opt._reassign_or_swap_out_partitioned_parameters

        def reassign(sub_group_id):
            original(sub_group_id)  # the RTN copy and the re-pointing of ds_tensors
            if opt.fp16_partitioned_groups_flat[sub_group_id] is None:
                raise NotImplementedError("dist_sr: ZeRO-3 with NVMe parameter swapping is not supported")
            self.round_sub_group(sub_group_id)

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


def layout_for(sr: DeepSpeedSR) -> Layout:
    """The layout of ``sr.optimizer`` (DeepSpeed's classes as of the tested versions)."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = sr.optimizer
    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        return Zero3Layout(sr)
    if isinstance(opt, BF16_Optimizer):
        return FragmentLayout(
            sr,
            lp_groups="bf16_groups",
            groups_flat="bf16_groups_flat",
            partitions="bf16_partitioned_groups",
            refresh_model=False,
        )
    if isinstance(opt, DeepSpeedZeroOptimizer):
        return FragmentLayout(
            sr,
            lp_groups="bit16_groups",
            groups_flat="bit16_groups_flat",
            partitions="parallel_partitioned_bit16_groups",
            refresh_model=True,
        )
    if isinstance(opt, FP16_UnfusedOptimizer) and not opt.fused_lamb_legacy:
        return Stage0Layout(sr)
    raise NotImplementedError(
        f"dist_sr supports ZeRO stages 0-3 (stage 0 through FP16_UnfusedOptimizer); this engine's optimizer "
        f"is {type(opt).__name__} (ZeRO stage {sr.engine.zero_optimization_stage()}). Use "
        '"zero_optimization": {"stage": 1} or higher'
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
    _ENGINES_BY_GROUPS[id(layout.groups_flat)] = weakref.ref(layout)
