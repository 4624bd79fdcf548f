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
  flat-buffer offset (padding depends on the world size). With ``offload_optimizer`` the
  rounding runs on the host into DeepSpeed's BF16 buffer, which DeepSpeed copies to the device.
- ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``, parameter and optimizer offload included): the copy
  into each sub-group's BF16 partition (``param.ds_tensor``: elements ``[r*pn, (r+1)*pn)`` of the
  parameter on partition rank ``r``) is the keyed rounding, run where the masters live.
- AutoTP shards round with each element's index in the full parameter (``tp``).
- Checkpoints: after ``engine.load_checkpoint`` (normal or universal, any world size) the BF16
  weights are re-derived from the loaded FP32 master with the restored step, so the RTN copies in
  DeepSpeed's loaders never win.

Where each optimizer keeps what, and the plan that rounds it there, is ``layouts``.

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
from typing import Any

import torch

from ...numerics import live, stochastic_round
from ...numerics.digest import piece_sum
from ...numerics.key import check_mode, normalize_param_name
from .agree import agree
from .config import CONFIG_KEY, SRConfig, agree_with_env, load_ds_config, split_config
from .layouts import check_zero_config, layout_for
from .version import check_universal_reload, check_version

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
    Either way, once DeepSpeed built the engine, every rank agrees on it (``agree``) before any
    rank attaches. Installed for unmodified scripts by ``dist-sr deepspeed-hook install``."""

    if getattr(original, "__dist_sr_hook__", False):
        return original

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any):
        sr, args, kwargs = take_sr_block(args, kwargs)
        if sr is not None:
            check_version()  # before any work is done
            if isinstance(kwargs.get("config"), dict):  # (else attach checks the built engine)
                check_zero_config(kwargs["config"].get("zero_optimization") or {})
        result = original(*args, **kwargs)
        engine = result[0]
        reason = None if sr is None else untrained(engine)
        agree(sr, attached=sr is not None and not reason)  # every rank, before any of them patches anything
        if sr is None:
            return result
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

    def release(self) -> None:
        """Let go of every view of DeepSpeed's partitions (before DeepSpeed moves them); the next
        rounding plans again where they are then."""
        self.layout.release()

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
        original_offload = getattr(opt, "offload_states", None)
        if original_offload is not None:  # engine.offload_states moves the partitions: hold none of them

            def offload_states(*args, **kwargs):
                self.release()
                return original_offload(*args, **kwargs)

            opt.offload_states = offload_states
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
