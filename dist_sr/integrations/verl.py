"""verl (0.9, FSDP2 engine): keyed SR turned on from a verl config alone, no fork.

    actor_rollout_ref.model.external_lib=dist_sr.integrations.verl
    actor_rollout_ref.actor.strategy=fsdp2
    actor_rollout_ref.actor.fsdp_config.seed=1234          # the rounding key's seed (verl's own field)

verl imports ``external_lib`` in every worker before it builds an engine
(``HFModelConfig.__post_init__``); importing this module patches verl's FSDP2 engine there:

- ``FSDPEngine._build_fsdp_module``: the actor's FP32 parameters are wrapped for SR
  (``engines.fsdp2.prepare``) before verl's ``apply_fsdp2``, so FSDP2's all-gather sends the
  keyed BF16 rounding of each shard; meta-initialised ranks (``to_empty``) and device moves keep
  the wrapping, and a rank that lost it stops the build. Checkpoints hold the plain FP32 masters.
- ``FSDPEngine._build_optimizer``: the key's step follows the optimizer (a step verl skips for a
  non-finite gradient norm does not advance it).
- ``FSDPEngine.get_per_tensor_param`` / ``get_per_tensor_param_shard``: every export (full
  tensors for the colocated ``BucketedWeightSender`` and the ``nccl``/``nixl`` checkpoint engines,
  local shards for ``delta_sharded``) carries the keyed BF16 bits the forward pass used, where
  verl 0.9.1 sent FP32 masters that vLLM rounds to nearest (or cast shards ``.to(bfloat16)``).
  verl's own key renaming and MoE unfusing run unchanged on the BF16 tensors.
- ``FSDPEngine.save_checkpoint`` / ``load_checkpoint``: the key (seed, mode, step) is saved beside
  verl's shards and restored on resume, checked against the optimizer's own step count.
- ``EngineRegistry.new``: an actor this cannot round with the key is refused before it is built
  (FSDP1, Megatron and the other backends, LoRA, QAT, non-BF16 working weights).
- after every weight sync, the engines' held weights are compared with the key, and dist-sr's
  metrics go into verl's own (``verl_sync``: ``ActorRolloutRefWorker.update_weights``,
  ``ServerAdapter.update_weights``, ``FSDPEngine.train_batch``).

``DIST_SR_MODE`` (``stochastic``, default, or ``dither``) and ``DIST_SR_SEED`` (overrides
``fsdp_config.seed``) reach the workers through ``+ray_kwargs.ray_init.runtime_env.env_vars``.
The reference model (``forward_only``) and a critic are left as verl builds them.

Without a seed of the user's (neither ``DIST_SR_SEED`` nor ``fsdp_config.seed`` other than verl's
default 42), training goes on, keyed with 42, and rank 0 logs a warning naming the two ways to
choose one; ``actor/dist_sr/seed`` is in verl's metrics either way. Not a refusal: any seed gives
unbiased rounding, and 42 is a seed verl's users pass on purpose too; what a default costs is
that runs keyed alike round alike, which a user comparing runs should know.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from .. import patching
from ..config import ConfigError
from ..engines import fsdp2
from ..engines.fsdp2.hook import SRShadowParam, master_dtensor
from ..engines.fsdp2.source import FSDP2Source
from ..numerics.key import check_mode, normalize_param_name
from . import verl_sync
from .plug_points import require_deepspeed_hooked

log = logging.getLogger(__name__)
MODE_ENV, SEED_ENV = "DIST_SR_MODE", "DIST_SR_SEED"
VERL_DEFAULT_SEED = 42  # fsdp_config.seed when the user names none
KEY_FILE = "dist_sr_key.json"  # beside verl's shards in global_step_N/actor/


class VerlUnsupported(ConfigError):
    """A verl setting under which the actor's weights cannot be rounded with the key."""


def _targets():
    """verl's classes this module patches; refuses (naming what is missing) a verl without them."""
    try:
        from verl.workers.engine import base
        from verl.workers.engine.fsdp import transformer_impl
    except ImportError as exc:
        raise ImportError(f"dist_sr.integrations.verl needs verl's engine modules (verl 0.9): {exc}") from exc
    engine = getattr(transformer_impl, "FSDPEngine", None)
    needed = (
        "_build_fsdp_module",
        "_build_optimizer",
        "get_per_tensor_param",
        "get_per_tensor_param_shard",
        "save_checkpoint",
        "load_checkpoint",
    )
    missing = [f"FSDPEngine.{m}" for m in needed if not hasattr(engine, m)] if engine is not None else ["FSDPEngine"]
    if not hasattr(getattr(base, "EngineRegistry", None), "new"):
        missing.append("EngineRegistry.new")
    if missing:
        import verl

        raise ImportError(
            f"dist_sr.integrations.verl: verl {getattr(verl, '__version__', '?')} lacks "
            f"{', '.join(missing)} (written for verl 0.9's FSDP2 engine)"
        )
    return base.EngineRegistry, engine, getattr(transformer_impl, "FSDPEngineWithValueHead", None)


def key_settings(engine_config) -> tuple[int, str]:
    """``(seed, mode)`` of the rounding key: ``DIST_SR_SEED`` or verl's ``fsdp_config.seed``, and
    ``DIST_SR_MODE`` (default ``stochastic``)."""
    raw = os.environ.get(SEED_ENV)
    try:
        seed = int(raw) if raw else int(engine_config.seed)
    except ValueError:
        raise VerlUnsupported(f"{SEED_ENV}={raw!r} is not an integer seed") from None
    mode = os.environ.get(MODE_ENV, "stochastic")
    try:
        check_mode(mode)
    except ValueError as exc:
        raise VerlUnsupported(f"{MODE_ENV}={mode!r}: {exc}") from None
    return seed, mode


def _is_trained_actor(engine) -> bool:
    _, _, value_head = _targets()
    return not engine.engine_config.forward_only and not (value_head and isinstance(engine, value_head))


def check_actor(model_type: str, backend: str, model_config, engine_config) -> None:
    """Refuse an actor setup whose weights cannot be rounded with the key (before it is built)."""
    if model_type != "language_model" or getattr(engine_config, "forward_only", False):
        return
    fix = "or drop actor_rollout_ref.model.external_lib=dist_sr.integrations.verl"
    if backend != "fsdp2":
        hint = (
            " (FSDP1 flattens parameters, so there is no per-parameter all-gather to round)"
            if backend == "fsdp"
            else ""
        )
        raise VerlUnsupported(
            f"keyed SR in verl needs the FSDP2 engine, but actor_rollout_ref.actor.strategy is "
            f"{backend!r}{hint}; set actor_rollout_ref.actor.strategy=fsdp2, {fix}"
        )
    lora = getattr(model_config, "lora", None) or {}
    if (
        getattr(model_config, "lora_rank", 0) > 0
        or getattr(model_config, "lora_adapter_path", None)
        or (hasattr(lora, "get") and lora.get("rank", 0))
    ):
        raise VerlUnsupported(
            "keyed SR with LoRA is not supported: the adapters train in their own dtype and vLLM "
            f"receives merged or separate adapter weights; set actor_rollout_ref.model.lora_rank=0, {fix}"
        )
    qat = getattr(engine_config, "qat", None)
    if qat is not None and getattr(qat, "enable", False):
        raise VerlUnsupported(f"keyed SR with QAT is not supported (the rollout holds quantized weights); {fix}")
    mp = getattr(engine_config, "mixed_precision", None) or {}
    param, reduce = mp.get("param_dtype", "bf16"), mp.get("reduce_dtype", "fp32")
    if str(param) not in ("bf16", "bfloat16") or str(reduce) not in ("fp32", "float32"):
        raise VerlUnsupported(
            f"keyed SR rounds FP32 masters to BF16 working weights with FP32 gradient reduction; "
            f"fsdp_config.mixed_precision has param_dtype={param!r}, reduce_dtype={reduce!r}: use "
            f"bf16 and fp32, {fix}"
        )
    if str(getattr(engine_config, "model_dtype", "fp32")) not in ("fp32", "float32"):
        raise VerlUnsupported(
            f"keyed SR needs FP32 masters; fsdp_config.model_dtype is "
            f"{engine_config.model_dtype!r}: set it to fp32, {fix}"
        )
    # fsdp_config.offload_policy (FSDP2's CPUOffloadPolicy): the shards are rounded on the host and
    # their BF16 bits moved for each all-gather (engines/fsdp2/gather.py); param_offload's moves of
    # the sharded model leave dist-sr holding none of their storage


def _state_dict_hook(module, state_dict, prefix, local_metadata):
    """The root's state dict: plain FP32 masters for checkpoints, or, while an export runs,
    BF16 DTensors over the keyed bits of each local shard (verl's exporters then gather, rename
    and unfuse those)."""
    from torch.distributed.tensor import DTensor

    export = getattr(module, "_dist_sr_export", None)
    params = export.params if export is not None else None
    for name, t in list(state_dict.items()):
        if not (isinstance(t, DTensor) and isinstance(t._local_tensor, SRShadowParam)):
            continue
        if export is None:  # the master behind the wrapper, same placements
            state_dict[name] = master_dtensor(t)
        else:
            state_dict[name] = export.working(t._local_tensor.param_name, params)


class _exporting:
    """While active, the module's state dict holds the keyed working weights."""

    def __init__(self, module, ctx):
        import torch.distributed as dist

        self.module = module
        self.source = FSDP2Source(module, ctx, dist.get_rank(), dist.get_world_size())

    def __enter__(self):
        self.module._dist_sr_export = self.source
        return self

    def __exit__(self, *exc):
        self.module._dist_sr_export = None


def _check_wrapped(module, ctx) -> None:
    """Collective: every rank's sharded actor parameters are still SR-wrapped after verl's build
    (meta init, ``to_empty``, device moves); otherwise the all-gather would round to nearest."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    lost = [
        n
        for n, p in module.named_parameters()
        if p.requires_grad
        and normalize_param_name(n) in ctx.names
        and not isinstance(p.to_local() if isinstance(p, DTensor) else p, SRShadowParam)
    ]
    flag = torch.tensor([len(lost)], dtype=torch.float64)
    dist.all_reduce(flag)
    if flag.item():
        raise RuntimeError(
            f"dist-sr: after verl's FSDP2 build, {int(flag.item())} actor parameter(s) lost the SR "
            f"wrapping on some rank (this rank: {lost[:4]}); the all-gather would round to nearest. "
            "This verl/torch combination is not supported"
        )


def _optimizer_steps(optimizer) -> int | None:
    """The step count the optimizer's own state holds (Adam's ``step``), or None."""
    for state in optimizer.state.values():
        step = state.get("step") if isinstance(state, dict) else None
        if step is not None:
            return int(step.item() if isinstance(step, torch.Tensor) else step)
    return None


# verl's own FSDPEngine methods, kept by ``enable`` before it puts the keyed ones below in their place
_VERL: dict[str, object] = {}


def _build_fsdp_module(self, module):
    """The actor's FP32 parameters wrapped for SR before verl's ``apply_fsdp2``, checked after it."""
    verl_sync.set_key_context(self, None)
    if not _is_trained_actor(self):
        return _VERL["_build_fsdp_module"](self, module)
    check_actor("language_model", self.engine_config.strategy, self.model_config, self.engine_config)
    seed, mode = key_settings(self.engine_config)
    ctx = fsdp2.prepare(module, seed=seed, mode=mode)  # before verl's apply_fsdp2
    module = _VERL["_build_fsdp_module"](self, module)
    _check_wrapped(module, ctx)
    module.register_state_dict_post_hook(_state_dict_hook)
    module._dist_sr_export = None
    ctx.masters_changed()  # verl loaded the full state dict into the shards
    verl_sync.set_key_context(self, ctx)
    verl_sync.actor_built(self, module)
    if self.rank == 0:
        log.info("dist-sr: keyed SR on the actor (seed %d, mode %s): %d parameters", seed, mode, len(ctx.names))
        if not os.environ.get(SEED_ENV, "").strip() and seed == VERL_DEFAULT_SEED:
            log.warning(
                "dist-sr: the rounding key's seed is %d, verl's default fsdp_config.seed: every run keyed "
                "alike unless you choose one (actor_rollout_ref.actor.fsdp_config.seed=<n>, or %s in the "
                "workers' environment); verl's metrics show it as actor/dist_sr/seed",
                seed,
                SEED_ENV,
            )
    return module


def _build_optimizer(self, module):
    """verl's optimizer, with the key's step following it."""
    optimizer = _VERL["_build_optimizer"](self, module)
    ctx = verl_sync.key_context(self)
    if ctx is not None:
        ctx.track(optimizer)
    return optimizer


def get_per_tensor_param(self, *args, **kwargs):
    """verl's full-tensor export, of the keyed BF16 bits."""
    ctx = verl_sync.key_context(self)
    if ctx is None:
        return _VERL["get_per_tensor_param"](self, *args, **kwargs)
    with _exporting(self.module, ctx):  # verl reads state_dict() eagerly; its generator gathers later
        return _VERL["get_per_tensor_param"](self, *args, **kwargs)


def get_per_tensor_param_shard(self, *args, **kwargs):
    """verl's local-shard export, of the keyed BF16 bits."""
    ctx = verl_sync.key_context(self)
    if ctx is None:
        return _VERL["get_per_tensor_param_shard"](self, *args, **kwargs)
    with _exporting(self.module, ctx):
        return _VERL["get_per_tensor_param_shard"](self, *args, **kwargs)


def save_checkpoint(self, local_path, *args, **kwargs):
    """verl's checkpoint, then the key beside its shards (complete on every rank's return)."""
    result = _VERL["save_checkpoint"](self, local_path, *args, **kwargs)
    ctx = verl_sync.key_context(self)
    if ctx is not None:
        if self.rank == 0:
            path = Path(local_path) / KEY_FILE
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(ctx.state_dict()))
            os.replace(tmp, path)
        torch.distributed.barrier()  # the checkpoint is complete on every rank's return, as verl's own is
    return result


def load_checkpoint(self, local_path, *args, **kwargs):
    """verl's resume, then the key's state, checked against the optimizer's own step count."""
    result = _VERL["load_checkpoint"](self, local_path, *args, **kwargs)
    ctx = verl_sync.key_context(self)
    if ctx is None:
        return result
    steps = _optimizer_steps(self.optimizer) if self.optimizer is not None else None
    path = Path(local_path) / KEY_FILE
    if path.exists():
        ctx.load_state_dict(json.loads(path.read_text()))  # refuses another seed or mode
        if steps is not None and steps != ctx.step:
            raise RuntimeError(
                f"dist-sr: {path} says the key is at step {ctx.step}, but the optimizer state loaded "
                f"beside it has taken {steps} steps; the checkpoint is inconsistent"
            )
    elif steps is not None:
        log.warning(
            "dist-sr: %s has no %s (saved without dist-sr); the key's step is taken from the optimizer (%d)",
            local_path,
            KEY_FILE,
            steps,
        )
        ctx.step = steps
    else:
        raise RuntimeError(
            f"dist-sr: {local_path} has neither {KEY_FILE} nor optimizer steps: the rounding key's "
            "step cannot be restored"
        )
    ctx.masters_changed()
    verl_sync.actor_built(self, self.module)
    return result


KEYED_METHODS = {
    f.__name__: f
    for f in (
        _build_fsdp_module,
        _build_optimizer,
        get_per_tensor_param,
        get_per_tensor_param_shard,
        save_checkpoint,
        load_checkpoint,
    )
}


def enable() -> None:
    """Patch verl's FSDP2 engine (idempotent). verl's ``external_lib`` contract is an import, so
    importing this module calls it: ``EngineRegistry.new`` refuses an actor the key cannot round,
    ``KEYED_METHODS`` replace ``FSDPEngine``'s own (kept in ``_VERL``), and ``verl_sync`` checks
    the engines after each weight sync. Refused in a process that imported DeepSpeed without
    dist-sr's start-up hook (``plug_points``)."""
    require_deepspeed_hooked("actor_rollout_ref.model.external_lib=dist_sr.integrations.verl")
    registry, engine_cls, _ = _targets()
    if patching.patched(engine_cls._build_fsdp_module):
        return
    new = registry.new.__func__

    def checked_new(cls, model_type, backend, *args, **kwargs):
        check_actor(model_type, backend, kwargs.get("model_config"), kwargs.get("engine_config"))
        return new(cls, model_type, backend, *args, **kwargs)

    patching.patch(registry, "new", classmethod(checked_new), by=__name__)
    for name, fn in KEYED_METHODS.items():
        _VERL[name] = getattr(engine_cls, name)
        patching.patch(engine_cls, name, fn, by=__name__)
    verl_sync.enable(engine_cls)


enable()
