"""TRL: keyed SR for ``GRPOTrainer`` (and the other TRL trainers that push weights to vLLM
through ``trl.generation.vllm_generation.VLLMGeneration``, and the experimental
``AsyncGRPOTrainer``, whose ``_streaming_iter`` is routed the same way), with one call between
building the trainer and training it:

    trainer = GRPOTrainer(model=..., args=GRPOConfig(..., bf16=True, deepspeed="ds.json"), ...)
    dist_sr.integrations.trl.enable(trainer, seed=1234)
    trainer.train()

DeepSpeed (ZeRO 0-3): ``enable`` puts the ``"stochastic_rounding"`` block into the DeepSpeed config
accelerate hands to ``deepspeed.initialize`` (or checks the one the JSON already has) and turns on
dist-sr's ``initialize`` hook in this process. The policy's engine rounds with the key at
DeepSpeed's copy sites; engines without an optimizer (the reference model with ``beta > 0``, a
reward model) stay as loaded. The BF16 parameters TRL gathers for vLLM are then the trainer's bits.

FSDP2 (accelerate ``fsdp_version: 2``): ``enable`` wraps the FP32 parameters for SR in the
all-gather before accelerate shards the model (upcasting BF16 ones, as accelerate itself would),
sets the mixed-precision policy to BF16 parameters with FP32 gradient reduction, and the key
follows the optimizer (resuming from a checkpoint, from the restored step). TRL exports FSDP2
weights as ``param.full_tensor()``, the FP32 masters, which vLLM's loader would round to nearest:
``enable`` routes TRL's weight iterator through ``export_bf16``, so server and colocate mode push
the keyed bits the forward pass used.

Metrics in the trainer's logs, so every ``report_to`` (TensorBoard, W&B, ...) gets them:
``dist_sr/key_step`` (the key's optimizer step) and, with ``sticking=True``,
``dist_sr/unfollowed_frac``: ``dist_sr.optim.metrics.unfollowed_frac`` over the window since the
previous log, the share of the FP32 masters' movement the BF16 working weights did not follow (~1
when round-to-nearest sticks, ~0 with SR).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from .. import patching
from ..engines.deepspeed.config import CONFIG_KEY
from ..engines.fsdp2.hook import MIXED_PRECISION, SRShadowParam, plain, prepare
from ..engines.fsdp2.source import reshard_all
from ..numerics import stochastic_round
from ..numerics.key import check_mode, normalize_param_name
from ..numerics.shards import local_shard, replica_slot
from ..optim.metrics import follow_sums, unfollowed_frac
from ..weightsync.trainer.export import export_bf16
from .plug_points import require_deepspeed_hooked

log = logging.getLogger("dist_sr.trl")

# accelerators of trainers with SR enabled: their VLLMGeneration pushes go through export_bf16
_ENABLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def enable(trainer, *, seed: int | None = None, mode: str = "stochastic", sticking: bool = False) -> "DistSRCallback":
    """Turn keyed SR on for a TRL/transformers trainer built but not yet trained; returns the
    callback it adds. ``seed``: the rounding key's seed (for DeepSpeed it may come from the JSON's
    block instead; given in both places, they must agree). ``sticking``: log
    ``dist_sr/unfollowed_frac`` (costs 6 bytes per local parameter)."""
    check_mode(mode)
    if any(isinstance(cb, DistSRCallback) for cb in trainer.callback_handler.callbacks):
        raise RuntimeError("dist-sr is already enabled for this trainer")
    accelerator = trainer.accelerator
    if getattr(trainer.args, "bf16", False) is not True:
        raise ValueError("stochastic rounding needs BF16 working weights: set bf16=True in the training arguments")
    if _is_peft(trainer.model):
        raise NotImplementedError(
            "dist-sr rounds full-parameter training; with PEFT/LoRA the adapters stay in "
            "their own dtype and the merged export is not a keyed rounding"
        )
    if getattr(trainer, "is_deepspeed_enabled", False):
        backend, ctx = "deepspeed", None  # the engine deepspeed.initialize builds holds the key
        seed = _deepspeed_block(accelerator, seed, mode)
    elif getattr(trainer, "is_fsdp_enabled", False):
        plugin = accelerator.state.fsdp_plugin
        if getattr(plugin, "fsdp_version", 1) != 2:
            raise NotImplementedError("dist-sr supports FSDP2 (fsdp_config fsdp_version: 2), not FSDP1")
        if getattr(plugin, "cpu_ram_efficient_loading", False):
            raise ValueError(
                "fsdp cpu_ram_efficient_loading re-creates the parameters while sharding, which drops "
                "the SR wrapping; set fsdp_cpu_ram_efficient_loading to false"
            )
        if seed is None:
            raise ValueError("enable(trainer, seed=...): FSDP2 needs the rounding key's seed")
        backend = "fsdp2"
        ctx = prepare_fsdp2(trainer.model, plugin, seed=seed, mode=mode)
    else:
        raise NotImplementedError(
            "dist-sr's TRL integration needs DeepSpeed (a deepspeed= config) or FSDP2 "
            "(fsdp_version 2); for one process, use DeepSpeed ZeRO-0..3 with one rank"
        )
    callback = DistSRCallback(trainer, backend, ctx, sticking=sticking)
    trainer.add_callback(callback)
    _add_metrics_to_logs(trainer, callback)
    route_vllm_exports(accelerator, callback)
    log.info("dist-sr: keyed SR enabled for %s (%s, seed %d, mode %s)", type(trainer).__name__, backend, seed, mode)
    return callback


def _is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def prepare_fsdp2(model, plugin, *, seed: int, mode: str = "stochastic"):
    """Before accelerate shards ``model`` with FSDP2: FP32 trainable parameters (BF16 ones
    upcast, as accelerate would), each wrapped for keyed SR in the all-gather, and the plugin's
    policy set to BF16 parameters with FP32 gradient reduction. Returns the ``SRContext``."""
    for _, p in model.named_parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
            p.data = p.data.to(torch.float32)
    ctx = prepare(model, seed=seed, mode=mode)
    plugin.mixed_precision_policy = MIXED_PRECISION
    return ctx


def _deepspeed_block(accelerator, seed: int | None, mode: str) -> int:
    from . import startup

    config = accelerator.state.deepspeed_plugin.deepspeed_config
    block = config.get(CONFIG_KEY)
    if block is None or not block.get("enabled", True):
        if seed is None:
            raise ValueError(
                'enable(trainer, seed=...): give the seed, or a "stochastic_rounding" block in the DeepSpeed JSON'
            )
        config[CONFIG_KEY] = {"enabled": True, "seed": seed, "mode": mode}
    else:
        if seed is not None and int(block.get("seed", seed)) != seed:
            raise ValueError(
                f"enable(trainer, seed={seed}) but the DeepSpeed JSON's {CONFIG_KEY!r} block has seed "
                f"{block.get('seed')}: give one seed"
            )
        if block.get("mode", mode) != mode:
            raise ValueError(
                f"enable(trainer, mode={mode!r}) but the DeepSpeed JSON's {CONFIG_KEY!r} block has mode "
                f"{block.get('mode')!r}: give one mode"
            )
        if seed is None and "seed" not in block:
            raise ValueError(
                f"the DeepSpeed JSON's {CONFIG_KEY!r} block has no seed: add one, or enable(trainer, seed=...)"
            )
        block.setdefault("seed", seed)
        block.setdefault("mode", mode)
        seed = int(block["seed"])
    if not startup.enabled():
        raise RuntimeError(f"{startup.ENV}=0 turns dist-sr's DeepSpeed hook off in this process; unset it to use SR")
    require_deepspeed_hooked("dist_sr.integrations.trl.enable(trainer)")  # imported unpatched: refused
    startup.register()  # not imported yet: deepspeed.initialize honours the block once it is
    return seed


class _BackendSide(Protocol):
    """What ``DistSRCallback`` asks of the training backend; ``model`` is the trainer's
    ``model_wrapped`` (the DeepSpeed engine, or the FSDP2-sharded model)."""

    def start(self, model, state, optimizer) -> None:
        """When training starts: refuse if SR did not reach the policy's weights, and put the key at
        the trainer's ``state.global_step`` where the backend does not keep it itself."""

    def key(self, model) -> Any:
        """The live rounding key: ``seed``, ``step``, ``mode``, ``key_name(name)``."""

    def master_pieces(self, model) -> Iterator[tuple[str, torch.Tensor, int]]:
        """``(name, flat FP32 master piece, global offset)`` of this rank's share of the SR'd
        parameters (the ranks' shares are disjoint)."""


class _DeepSpeedSide:
    """DeepSpeed ZeRO 0-3: the policy's engine holds the key (``engine.dist_sr``, built by
    ``deepspeed.initialize`` from the block ``enable`` configured) and its ZeRO layout the masters."""

    def start(self, model, state, optimizer) -> None:
        if getattr(model, "dist_sr", None) is None:
            raise RuntimeError(
                "the DeepSpeed engine was built without dist-sr's SR: call "
                "dist_sr.integrations.trl.enable(trainer) before trainer.train()"
            )

    def key(self, model):
        return model.dist_sr

    def master_pieces(self, model):
        for name, hp, offset in model.dist_sr.layout.master_pieces():
            yield name, hp.detach().reshape(-1), offset


class _FSDP2Side:
    """FSDP2: ``enable`` wrapped the parameters for SR in the all-gather; the ``SRContext`` holds
    the key, which follows the optimizer from training's start, and the sharded parameters
    (``model_wrapped``) are the FP32 masters."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._handle = None

    def start(self, model, state, optimizer) -> None:
        reshard_all(model)  # a forward without backward leaves the root unsharded: read the shards
        lost = [
            n
            for n, p in model.named_parameters()
            if p.requires_grad and not isinstance(getattr(p, "_local_tensor", p), SRShadowParam)
        ]
        if lost:
            raise RuntimeError(
                f"{len(lost)} trainable parameters lost their SR wrapping while accelerate prepared "
                f"the model (first: {lost[0]}); enable() must run before trainer.train(), with no "
                "other code re-creating the parameters"
            )
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        if self._handle is None:
            self._handle = self.ctx.track(inner)
        self.ctx.step = int(state.global_step)  # a resumed run continues the key where it stopped
        self.ctx.masters_changed()

    def key(self, model):
        return self.ctx

    def master_pieces(self, model):
        reshard_all(model)
        for name, p in model.named_parameters():
            local, offset, rows = local_shard(p)
            local = plain(local)
            name = normalize_param_name(name)
            if rows is None and replica_slot(p)[0] == 0 and self.ctx.rounds(name) is True and local.numel():
                yield name, local.reshape(-1), offset


# DistSRCallback's backend name -> its side, built from the callback's ctx
_SIDES: dict[str, Callable[[Any], _BackendSide]] = {"deepspeed": lambda ctx: _DeepSpeedSide(), "fsdp2": _FSDP2Side}


class DistSRCallback(TrainerCallback):
    """Keeps the key in step with the optimizer (FSDP2), checks SR reached the policy's weights
    when training starts, and adds the SR metrics to the logs. ``backend``: ``"deepspeed"`` or
    ``"fsdp2"``; ``ctx``: the FSDP2 ``SRContext`` (None for DeepSpeed, whose engine holds the key)."""

    def __init__(self, trainer, backend: str, ctx, *, sticking: bool = False):
        if backend not in _SIDES:
            raise ValueError(f"backend={backend!r}: dist-sr's TRL integration knows {sorted(_SIDES)}")
        self.trainer = weakref.proxy(trainer)
        self.backend, self.ctx, self.sticking = backend, ctx, sticking
        self.side = _SIDES[backend](ctx)
        self._previous: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs: Any):
        self.side.start(self.trainer.model_wrapped, state, optimizer)

    def _key(self):
        return self.side.key(self.trainer.model_wrapped)

    @torch.no_grad()
    def unfollowed_frac(self) -> float | None:
        """``dist_sr.optim.metrics.unfollowed_frac`` over the window since the previous call (each
        log): the share of the FP32 masters' movement (dS) the BF16 working weights (dW, the keyed
        SR of the masters) did not follow; ~1 when round-to-nearest sticks, ~0 with SR. Collective
        (sums over every rank's pieces); None on the first call or when the masters did not move.
        Keeps a copy of this rank's masters (FP32) and working weights (BF16): 6 bytes per local
        parameter."""
        key = self._key()
        device = self.trainer.accelerator.device
        sums = torch.zeros(2, dtype=torch.float64, device=device)
        current = {}
        for name, master, offset in self.side.master_pieces(self.trainer.model_wrapped):
            working = stochastic_round(
                master, seed=key.seed, step=key.step, param=key.key_name(name), offset=offset, mode=key.mode
            )
            current[(name, offset)] = (master.clone(), working)
            before = None if self._previous is None else self._previous.get((name, offset))
            if before is not None and before[0].shape == master.shape:
                sums += follow_sums(before[0], master, before[1], working).to(device)
        first = self._previous is None
        self._previous = current
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        return None if first else unfollowed_frac(*sums.tolist())

    def add_metrics(self, logs: dict) -> None:
        """Called by the trainer's ``log`` (wrapped by ``enable``) before any logger sees ``logs``."""
        if "train_runtime" in logs or "eval_loss" in logs:
            return
        logs["dist_sr/key_step"] = int(self._key().step)
        if self.sticking:
            frac = self.unfollowed_frac()
            if frac is not None:
                logs["dist_sr/unfollowed_frac"] = frac


def _add_metrics_to_logs(trainer, callback: DistSRCallback) -> None:
    """The trainer's ``log`` adds the SR metrics first, so its history and every ``report_to``
    logger get them (a callback's ``on_log`` runs after the history is written and after the
    loggers registered before it)."""
    original = trainer.log

    def log(logs: dict, *args: Any, **kwargs: Any):
        callback.add_metrics(logs)
        return original(logs, *args, **kwargs)

    trainer.log = log


def route_vllm_exports(accelerator, callback: DistSRCallback) -> None:
    """From now on TRL's ``VLLMGeneration._iter_named_params`` (the one iterator its server and
    colocate pushes read) yields, for generations on ``accelerator``, each tensor through
    ``export_bf16`` with ``callback``'s key: BF16 working weights as they are, FP32 masters as the
    keyed SR of the live step."""
    _ENABLED[accelerator] = callback
    try:
        from trl.generation.vllm_generation import VLLMGeneration
    except ImportError:  # a TRL without this class: nothing to route
        return
    original = VLLMGeneration._iter_named_params

    def _iter_named_params(self):
        callback = _ENABLED.get(self.accelerator)
        if callback is None:
            yield from original(self)
            return
        for name, tensor in original(self):
            yield name, export_bf16(name, tensor, key=callback.ctx)

    patching.patch(VLLMGeneration, "_iter_named_params", _iter_named_params, by=__name__)
    _route_async_grpo()


def _route_async_grpo() -> None:
    """``trl.experimental.async_grpo.AsyncGRPOTrainer`` streams ``full_tensor()`` masters to vLLM
    from ``_streaming_iter``: route each through ``export_bf16`` too, in the dtype its weight
    manifest announced (keyed BF16 upcast to FP32 is exact, and so is vLLM's cast back)."""
    try:
        from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer
    except ImportError:  # a TRL without the experimental trainer
        return
    original = AsyncGRPOTrainer._streaming_iter

    def _streaming_iter(self):
        callback = _ENABLED.get(self.accelerator)
        if callback is None:
            yield from original(self)
            return
        wire = _manifest_dtypes(getattr(self, "weight_transfer", None))
        for name, full in original(self):
            yield name, export_bf16(name, full, key=callback.ctx).to(wire.get(name, full.dtype))

    patching.patch(AsyncGRPOTrainer, "_streaming_iter", _streaming_iter, by=__name__)


def _manifest_dtypes(weight_transfer) -> dict[str, torch.dtype]:
    """``{name: dtype}`` of the manifest TRL's ``WeightTransferClient`` sent the server (rank 0),
    or empty (other ranks, whose stream is only iterated for the collectives)."""
    info = getattr(weight_transfer, "_weight_update_info", None) or {}
    return {n: getattr(torch, d) for n, d in zip(info.get("names", ()), info.get("dtype_names", ()))}
