"""Sharding a model with FSDP2 the way its precision asks (``apply_fsdp2``), and the pure-BF16
optimizer over the shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from ...numerics.key import normalize_param_name
from ...optim import AdamWSR
from ...precision import PrecisionConfig
from .config import FSDP2Config
from .hook import MIXED_PRECISION, SRContext, prepare


def pure_bf16_optimizer(model: nn.Module, precision, **adamw_kwargs):
    """``AdamWSR`` over a model sharded by ``apply_fsdp2(model, "bf16-pure-sr")``: each rank
    updates its BF16 shards; the bits equal the unsharded ``AdamWSR`` at any world size."""
    if not isinstance(precision, PrecisionConfig):
        precision = PrecisionConfig.from_dict(precision)
    named = [(normalize_param_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    return AdamWSR(
        named, seed=precision.seed, moment_dtype=precision.moment_dtype, backend=precision.backend, **adamw_kwargs
    )


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
    if not isinstance(precision, PrecisionConfig):
        precision = PrecisionConfig.from_dict(precision)
    if not isinstance(config, FSDP2Config):
        config = FSDP2Config.from_dict(config)
    spec = precision.spec
    ctx = None
    if spec.pure:
        for name, param in model.named_parameters():
            if param.requires_grad and param.is_floating_point():
                if hasattr(param, "_local_tensor"):
                    raise ValueError(f"{name!r} is already sharded: apply_fsdp2 before fully_shard")
                param.data = param.data.to(torch.bfloat16)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    elif spec.working_dtype == torch.float32:
        policy = MixedPrecisionPolicy()
    elif spec.working_dtype != torch.bfloat16:  # FP16: FSDP2's own all-gather cast (round-to-nearest)
        policy = MixedPrecisionPolicy(param_dtype=spec.working_dtype, reduce_dtype=torch.float32)
    else:
        ctx = prepare(model, seed=precision.seed, mode=precision.rounding, backend=precision.backend)
        policy = MIXED_PRECISION
    blocks = [m for m in model.modules() if type(m).__name__ in config.shard_modules]
    if not blocks:
        raise ValueError(
            f"fsdp2.shard_modules {config.shard_modules} match no module of {type(model).__name__}; "
            "name its transformer block class"
        )
    mesh = config.mesh()
    kwargs: dict = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": config.reshard_after_forward}
    if config.cpu_offload:  # pinned host memory needs an accelerator
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    if ctx is not None:
        ctx.cache_rounded = config.keep_rounded
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return ctx
