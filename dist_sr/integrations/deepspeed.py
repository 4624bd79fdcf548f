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

with ``dist_sr.integrations.deepspeed.initialize`` as a drop-in for ``deepspeed.initialize``.
"""

from __future__ import annotations

import copy
import math
import json
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..numerics import RoundingBatch, RoundingJob
from ..numerics.key import MODES, check_mode, normalize_param_name

TESTED = ((0, 19, 8), (0, 20, 0))  # [low, high): the DeepSpeed versions whose internals were tested
CONFIG_KEY = "stochastic_rounding"


class UnsupportedDeepSpeed(RuntimeError):
    pass


def check_version(version: str | None = None) -> None:
    """Refuse a DeepSpeed whose internals (copy sites, fragment mappings) were not tested."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    try:
        parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3])
    except ValueError:
        parts = ()
    low, high = TESTED
    if not (len(parts) == 3 and low <= parts < high):
        raise UnsupportedDeepSpeed(
            f"dist_sr patches DeepSpeed's FP32->BF16 copy sites, tested with DeepSpeed "
            f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}; this is DeepSpeed {version}. "
            "Install a tested version (pip install 'deepspeed>=0.19.8,<0.20'); dist_sr will not fall back to "
            "round-to-nearest silently"
        )


@dataclass(frozen=True)
class SRConfig:
    enabled: bool = True
    seed: int = 0
    mode: str = "stochastic"

    @classmethod
    def from_dict(cls, data: dict) -> "SRConfig":
        unknown = sorted(set(data) - {"enabled", "seed", "mode"})
        if unknown:
            raise ValueError(f"{CONFIG_KEY}: unknown field(s) {unknown}; valid: enabled, seed, mode")
        cfg = cls(**data)
        if cfg.mode not in MODES:
            raise ValueError(f"{CONFIG_KEY}.mode: unknown mode {cfg.mode!r}; choose one of {', '.join(MODES)}")
        if not isinstance(cfg.seed, int) or cfg.seed < 0:
            raise ValueError(f"{CONFIG_KEY}.seed must be a non-negative int, got {cfg.seed!r}")
        return cfg


def split_config(config: dict | str | Path) -> tuple[dict, SRConfig | None]:
    """DeepSpeed config without our block, and the block (None if absent or disabled)."""
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    config = copy.deepcopy(config)
    block = config.pop(CONFIG_KEY, None)
    if block is None:
        return config, None
    sr = SRConfig.from_dict(block)
    return config, (sr if sr.enabled else None)


def initialize(*args: Any, **kwargs: Any):
    """``deepspeed.initialize`` that reads the ``"stochastic_rounding"`` block of the config
    (given as ``config``, ``config_params`` or ``args.deepspeed_config``, a dict or a JSON path)
    and attaches SR to the engine; returns what ``deepspeed.initialize`` returns."""
    import deepspeed

    return hooked_initialize(getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize))(*args, **kwargs)


def hooked_initialize(original):
    """Wrap ``deepspeed.initialize``: a call whose config has no enabled SR block goes to
    ``original`` unchanged; otherwise the block is removed, the rest is passed as ``config`` (and
    ``args.deepspeed_config`` cleared on a copy of ``args``), and SR is attached to the engine.
    Installed for unmodified scripts by ``dist-sr deepspeed-hook install``."""
    import functools

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any):
        sr, args, kwargs = _take_sr_block(args, kwargs)
        if sr is None:
            return original(*args, **kwargs)
        check_version()  # before any work is done
        result = original(*args, **kwargs)
        attach(result[0], seed=sr.seed, mode=sr.mode)
        return result

    wrapper.__dist_sr_hook__ = True
    return wrapper


def _take_sr_block(args: tuple, kwargs: dict) -> tuple[SRConfig | None, tuple, dict]:
    """Find the DeepSpeed config the way ``deepspeed.initialize`` does; if it has our block, return
    it and the call's arguments with the block removed."""
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
        config = _load_ds_config(config)
    if CONFIG_KEY not in config:
        return None, args, kwargs
    config, sr = split_config(config)
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


def _load_ds_config(config) -> dict:
    """A config path (JSON, or HJSON as DeepSpeed accepts) or base64 string, read as DeepSpeed reads it."""
    try:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    except ImportError:  # pragma: no cover - other DeepSpeed versions are refused before use anyway
        return json.loads(Path(config).read_text())
    return copy.deepcopy(load_ds_config(str(config)))


def attach(engine, *, seed: int, mode: str = "stochastic") -> "DeepSpeedSR":
    """Make ``engine``'s FP32->BF16 copies keyed SR; call right after ``deepspeed.initialize``."""
    check_version()
    check_mode(mode)
    if not engine.bfloat16_enabled():
        raise ValueError("stochastic rounding needs BF16 working weights: enable \"bf16\" in the DeepSpeed config "
                         "(FP16 weights keep round-to-nearest; SR into FP16 is not supported)")
    sr = DeepSpeedSR(engine, seed, mode)
    sr.install()
    engine.dist_sr = sr  # the handle: engine.dist_sr.resync(), .step, .seed, .mode
    return sr


class DeepSpeedSR:
    """The patched state of one engine: its optimizer's copy sites call ``round_local``."""

    def __init__(self, engine, seed: int, mode: str):
        from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
        from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        self.engine, self.seed, self.mode = engine, seed, mode
        self.optimizer = engine.optimizer
        self.names = {id(p): normalize_param_name(n) for n, p in engine.module.named_parameters()}
        self._in_step = False
        self._batches: dict = {}
        opt = self.optimizer
        if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
            self.kind = "zero3"
        elif isinstance(opt, BF16_Optimizer):
            self.kind = "bf16_optimizer"
        elif isinstance(opt, DeepSpeedZeroOptimizer):
            self.kind = "zero12"
        elif isinstance(opt, FP16_UnfusedOptimizer) and not opt.fused_lamb_legacy:
            self.kind = "stage0"  # no partitioning: every rank rounds its full masters after the copy
        else:
            raise NotImplementedError(
                f"dist_sr supports ZeRO stages 0-3 (stage 0 through FP16_UnfusedOptimizer); this engine's optimizer "
                f"is {type(opt).__name__} (ZeRO stage {engine.zero_optimization_stage()}). Use "
                "\"zero_optimization\": {\"stage\": 1} or higher"
            )

    # -- the key's step ------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The optimizer step whose result is being rounded (global_steps advances after it)."""
        return self.engine.global_steps + (1 if self._in_step else 0)

    # -- rounding the local partition ----------------------------------------------------------

    def _lp_groups(self):
        return self.optimizer.bit16_groups if self.kind == "zero12" else self.optimizer.bf16_groups

    @torch.no_grad()
    def round_local(self) -> None:
        """Overwrite this rank's BF16 partition with the keyed rounding of its FP32 master."""
        if self.kind == "zero3":
            for sub_group_id in range(len(self.optimizer.fp16_groups)):
                self._round_zero3(sub_group_id)
            return
        self._batch("local", self._local_sources, self._local_jobs).run(seed=self.seed, step=self.step, mode=self.mode)

    def _batch(self, key, sources, jobs) -> RoundingBatch:
        """The cached rounding of one set of pieces, rebuilt when any piece's storage moved (every
        step reads only the addresses; jobs and launch tables are built once)."""
        signature = sources()
        cached = self._batches.get(key)
        if cached is None or cached[0] != signature:
            cached = self._batches[key] = (signature, RoundingBatch(jobs()))
        return cached[1]

    def _local_pairs(self):
        """(name, FP32 source, BF16 destination, offset) of every piece this rank rounds (stages 0-2)."""
        if self.kind == "stage0":
            opt = self.optimizer
            for fp32_group, lp_group in zip(opt.fp32_groups, opt.fp16_groups):
                for hp, lp in zip(fp32_group, lp_group):
                    yield self.names[id(lp)], hp, lp, 0
            return
        for group in self._lp_groups():
            for p in group:
                mapping = getattr(p, "_hp_mapping", None)
                if mapping is not None:
                    yield (self.names[id(p)], mapping.hp_fragment, mapping.lp_fragment,
                           mapping.lp_fragment_address.start)

    def _local_sources(self) -> tuple:
        return tuple((hp.data_ptr(), lp.data_ptr(), hp.numel(), offset) for _, hp, lp, offset in self._local_pairs())

    def _local_jobs(self) -> list[RoundingJob]:
        return [RoundingJob(name, hp.data, lp.data, offset) for name, hp, lp, offset in self._local_pairs()]

    def _round_zero3(self, sub_group_id: int) -> None:
        opt = self.optimizer
        fp32_flat = opt.fp32_partitioned_groups_flat[sub_group_id]

        def sources():
            return (fp32_flat.data_ptr(), *(part.data_ptr() for part in opt.fp16_partitioned_groups[sub_group_id]))

        batch = self._batch(("zero3", sub_group_id), sources, lambda: self._zero3_jobs(sub_group_id))
        batch.run(seed=self.seed, step=self.step, mode=self.mode)

    def _zero3_jobs(self, sub_group_id: int) -> list[RoundingJob]:
        import deepspeed.comm as ds_dist

        opt = self.optimizer
        fp32_flat = opt.fp32_partitioned_groups_flat[sub_group_id]
        rank = ds_dist.get_rank(group=opt.sub_group_process_groups[sub_group_id])
        jobs, offset = [], 0
        for param, part in zip(opt.fp16_groups[sub_group_id], opt.fp16_partitioned_groups[sub_group_id]):
            n = part.ds_numel
            if n:
                src = fp32_flat.data.narrow(0, offset, n)
                jobs.append(RoundingJob(self.names[id(param)], src, part.data.view(-1)[:n], rank * n))
            offset += n
        return jobs

    # -- patches -------------------------------------------------------------------------------

    def install(self) -> None:
        opt, engine = self.optimizer, self.engine
        original_step = opt.step

        def step(*args, **kwargs):
            self._in_step = True
            try:
                result = original_step(*args, **kwargs)
                if self.kind == "stage0" and not opt.overflow:
                    self.round_local()  # the unfused optimizer copied RTN; nothing gathers after it
                return result
            finally:
                self._in_step = False

        opt.step = step
        if self.kind == "zero3":
            original = opt._reassign_or_swap_out_partitioned_parameters

            def reassign(sub_group_id):
                original(sub_group_id)  # the RTN copy and the re-pointing of ds_tensors
                if opt.fp16_partitioned_groups_flat[sub_group_id] is None:
                    raise NotImplementedError("dist_sr: ZeRO-3 with NVMe parameter swapping is not supported")
                self._round_zero3(sub_group_id)

            opt._reassign_or_swap_out_partitioned_parameters = reassign
        elif self.kind != "stage0":
            _install_all_gather_hook(self)
        original_load = engine.load_checkpoint

        def load_checkpoint(*args, **kwargs):
            result = original_load(*args, **kwargs)
            self.resync()  # the loaders copy RTN: re-derive the keyed bits from the loaded master
            return result

        engine.load_checkpoint = load_checkpoint
        self.resync()  # step-0 rounding of the initial master

    @torch.no_grad()
    def resync(self) -> None:
        """Re-derive every BF16 weight from the FP32 master under the current key (collective)."""
        if self.kind == "stage0":
            self.round_local()
            return
        if self.kind == "zero3":
            # persistent (small) parameters stay gathered between steps: release their stale full
            # copies (without writing them back), round the partitions, and gather them again,
            # as DeepSpeed's own step does
            persistent = self.optimizer.persistent_parameters
            if persistent:
                persistent[0].partition(persistent, has_been_updated=False)
            self.round_local()
            self.optimizer.checkpoint_event_epilogue()
            return
        opt = self.optimizer
        groups_flat = self.groups_flat
        partitions = opt.parallel_partitioned_bit16_groups if self.kind == "zero12" else opt.bf16_partitioned_groups
        self.round_local()
        _ORIGINAL_ALL_GATHER["fn"](groups_flat=groups_flat, partitioned_param_groups=partitions,
                                   dp_process_group=opt.real_dp_process_group,
                                   start_alignment_factor=opt.nccl_start_alignment_factor,
                                   allgather_bucket_size=opt.allgather_bucket_size)
        if self.kind == "zero12":
            for i in range(len(opt.bit16_groups)):
                opt._update_model_bit16_weights(i)

    @property
    def groups_flat(self):
        return self.optimizer.bit16_groups_flat if self.kind == "zero12" else self.optimizer.bf16_groups_flat


# ZeRO-1/2 and BF16_Optimizer copy the partition and then call all_gather_dp_groups(groups_flat=...):
# the hook rounds the local partition of the engine that owns ``groups_flat`` right before the gather.
_ENGINES_BY_GROUPS: dict[int, "weakref.ref[DeepSpeedSR]"] = {}
_ORIGINAL_ALL_GATHER: dict[str, Any] = {}


def _install_all_gather_hook(sr: DeepSpeedSR) -> None:
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
                owner.round_local()
            return original(*args, **kwargs)

        stage_1_and_2.all_gather_dp_groups = all_gather_dp_groups
        bf16_optimizer.all_gather_dp_groups = all_gather_dp_groups
    _ENGINES_BY_GROUPS[id(sr.groups_flat)] = weakref.ref(sr)


def precision_of_config(config: dict | str | Path) -> dict:
    """The precision switch a DeepSpeed config expresses: ``{"precision": ..., "seed": ...}``.

    ``fp16.enabled`` -> fp16; ``bf16.enabled`` -> bf16, or bf16-sr / bf16-dither with an enabled
    ``stochastic_rounding`` block (its seed included); neither -> fp32. An SR block without bf16
    is refused: SR rounds to BF16 working weights.
    """
    config, sr = split_config(config)
    fp16 = bool(config.get("fp16", {}).get("enabled", False))
    bf16 = bool(config.get("bf16", config.get("bfloat16", {})).get("enabled", False))
    if fp16 and bf16:
        raise ValueError("the DeepSpeed config enables both fp16 and bf16; enable one")
    if sr is not None and not bf16:
        raise ValueError(f'the DeepSpeed config has an enabled "{CONFIG_KEY}" block but not "bf16": '
                         '{"enabled": true}; SR rounds FP32 masters to BF16 working weights (FP16 SR is not '
                         "supported), so enable bf16 or drop the block")
    if fp16:
        return {"precision": "fp16"}
    if not bf16:
        return {"precision": "fp32"}
    if sr is None:
        return {"precision": "bf16"}
    return {"precision": "bf16-dither" if sr.mode == "dither" else "bf16-sr", "seed": sr.seed}


def config_for_precision(precision, base: dict | str | Path) -> dict:
    """A DeepSpeed config whose ``bf16``/``fp16`` sections and SR block follow the precision switch.

    ``precision`` is a ``PrecisionConfig`` (or its string / mapping form); ``base`` is the rest of
    the DeepSpeed config (dict or JSON path). fp32 -> neither; fp16 -> ``fp16`` with dynamic loss
    scaling; bf16 -> ``bf16`` with round-to-nearest; bf16-sr / bf16-dither -> ``bf16`` plus the SR
    block. bf16-pure-sr has no FP32 master, which DeepSpeed always keeps: refused.
    """
    from ..precision import PrecisionConfig, PrecisionConfigError

    if not isinstance(precision, PrecisionConfig):
        precision = PrecisionConfig.from_dict(precision)
    config, _ = split_config(base)
    config.pop("bf16", None)
    config.pop("fp16", None)
    p = precision.precision
    if p == "bf16-pure-sr":
        raise PrecisionConfigError("precision bf16-pure-sr keeps no FP32 master, but DeepSpeed ZeRO always does; "
                                   "use bf16-sr with DeepSpeed (or the single-process AdamWSR)")
    if p == "fp16":
        dynamic = precision.loss_scale == "dynamic"
        config["fp16"] = {"enabled": True, "loss_scale": 0 if dynamic else float(precision.loss_scale),
                          "initial_scale_power": int(math.log2(precision.initial_loss_scale)),
                          "loss_scale_window": precision.loss_scale_window}
    elif p.startswith("bf16"):
        config["bf16"] = {"enabled": True}
        if precision.rounding in ("stochastic", "dither"):
            config[CONFIG_KEY] = {"enabled": True, "seed": precision.seed, "mode": precision.rounding}
    return config
