"""The trainer's working weights for a rollout engine, from any training setup: what a weight
exporter calls instead of ``.to(torch.bfloat16)``.

    for name, bf16 in dist_sr.rollout_weights(model_or_engine):      # every rank (collective)
        llm_model.load_weights([(name, bf16)])                        # the trainer's bits

- ``rollout_weights(obj)`` yields ``(name, tensor)`` for every parameter, full size, exactly as
  the trainer's forward pass uses it: from a plain module, a DeepSpeed engine (any ZeRO stage),
  an FSDP2 module (SR'd or not), or a model whose FP32 masters a live SR key rounds.
  ``rollout_shards(obj)`` yields this rank's pieces with their global offsets instead (nothing
  gathered: shard-direct export), and ``rollout_metadata(obj)`` what ``rollout_weights`` will
  yield (name, dtype, full shape), without gathering.
- ``export_bf16(name, fp32)`` turns one FP32 master tensor (the full parameter, or a piece at
  ``offset``) into the BF16 the forward pass uses: the keyed SR of the live step for a parameter
  SR rounds, the round-to-nearest cast for a frozen one. Never a silent RTN for an SR parameter:
  a name no live SR model knows is an error.

Names are the model's ``named_parameters()`` names with wrapper prefixes removed (the HF names
vLLM's ``load_weights`` takes).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ...numerics import live, stochastic_round
from ...numerics.digest import dtype_name
from ...numerics.key import normalize_param_name
from ...numerics.shards import split_range
from ...sources import LocalPiece, Meta, ReplicatedSource


def export_bf16(name: str, tensor: torch.Tensor, *, key: live.KeyOwner | None = None, offset: int = 0) -> torch.Tensor:
    """The BF16 working weight of the FP32 master ``tensor`` of parameter ``name`` (elements
    starting at flat index ``offset`` of the full parameter), as the live SR key rounds it now.

    A BF16 tensor is returned as it is (already working bits). ``key``: the owner of the key
    (an FSDP2 ``SRContext``, a DeepSpeed ``engine.dist_sr``); by default the one live SR model
    that has a parameter of this name.
    """
    from ...engines.fsdp2.hook import plain  # the FP32 behind an SR-wrapped parameter

    if hasattr(tensor, "device_mesh"):
        raise TypeError(
            f"export_bf16({name!r}): a DTensor (one rank's shard); pass tensor.full_tensor(), or use "
            "rollout_shards() for shard-direct export"
        )
    if getattr(tensor, "ds_id", None) is not None:
        raise TypeError(
            f"export_bf16({name!r}): a ZeRO-3 partitioned parameter; pass the DeepSpeed engine to "
            "rollout_weights(), or gather it first"
        )
    t = plain(tensor)
    if t.dtype == torch.bfloat16:
        return t
    if t.dtype != torch.float32:
        raise TypeError(
            f"export_bf16({name!r}): a {t.dtype} tensor; it rounds FP32 masters to BF16 (SR into FP16 is not supported)"
        )
    name = normalize_param_name(name)
    owner = key if key is not None else live.owner_of(name)
    if owner is None:
        if not live.owners():
            raise RuntimeError(
                f"export_bf16({name!r}): no model trained with SR is live in this process; turn SR on "
                'first (dist_sr.engines.fsdp2.prepare, the DeepSpeed "stochastic_rounding" block, '
                "dist_sr.integrations.trl.enable) or pass key="
            )
        raise KeyError(
            f"export_bf16({name!r}): no live SR model has a parameter of this name; pass the model's own "
            "named_parameters() name (wrapper prefixes are removed), not the rollout engine's"
        )
    rounds = owner.rounds(name)
    if rounds is None:
        raise KeyError(f"export_bf16({name!r}): the given key's model has no parameter of this name")
    if not rounds:  # frozen: the forward pass casts it round-to-nearest
        return t.to(torch.bfloat16)
    return stochastic_round(
        t, seed=owner.seed, step=owner.step, param=owner.key_name(name), offset=offset, mode=owner.mode
    )


def _fsdp2_root(module: nn.Module):
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    return next((m for m in module.modules() if isinstance(m, FSDPModule)), None)


def _is_deepspeed(obj) -> bool:
    return hasattr(obj, "zero_optimization_stage") and isinstance(getattr(obj, "module", None), nn.Module)


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)


def _fsdp2_source(module: nn.Module, root):
    from torch.distributed.tensor import DTensor

    from ...engines.fsdp2.hook import SRShadowParam
    from ...engines.fsdp2.source import FSDP2Source

    ctx = None
    for p in module.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        if isinstance(local, SRShadowParam):
            ctx = local.sr_context
            break
    param_dtype = root._get_fsdp_state()._mp_policy.param_dtype
    rank, world = _rank_world()
    return FSDP2Source(module, ctx, rank, world, as_bf16=ctx is None and param_dtype == torch.bfloat16)


def rollout_weights(obj) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter of ``obj`` as the forward pass uses it, one
    at a time. With DeepSpeed ZeRO-3 or FSDP2 each tensor is gathered: every rank must iterate
    (collective); every rank gets the full tensor. A plain module's parameters are taken as they
    are (BF16 working weights, or FP32 ones its forward uses in FP32), except FP32 masters
    wrapped by ``fsdp2.prepare``, which are rounded with their key."""
    if _is_deepspeed(obj):
        yield from _deepspeed_weights(obj)
        return
    module = obj
    root = _fsdp2_root(module)
    if root is not None:
        source = _fsdp2_source(module, root)
        params = source.params
        for name in params:
            yield name, source.full(name, params)
        return
    from ...engines.fsdp2.hook import SRShadowParam

    for name, p in module.named_parameters():
        if getattr(p, "ds_id", None) is not None:
            raise TypeError(
                f"{name!r} is a ZeRO-3 partitioned parameter: pass the DeepSpeed engine "
                "(trainer.model_wrapped), not its module"
            )
        name = normalize_param_name(name)
        if isinstance(p, SRShadowParam):
            yield name, export_bf16(name, p, key=p.sr_context)
        else:
            yield name, p.detach()


def rollout_metadata(obj) -> list[Meta]:
    """``Meta`` (name, dtype name, full shape) of every tensor ``rollout_weights(obj)`` yields, in
    the same order, read from the parameters without gathering (every rank gets the same list)."""
    if _is_deepspeed(obj):
        stage3 = obj.zero_optimization_stage() == 3
        return [
            Meta(
                normalize_param_name(n),
                dtype_name(p.ds_tensor.dtype if stage3 else p.dtype),
                tuple(p.ds_shape if stage3 else p.shape),
            )
            for n, p in obj.module.named_parameters()
        ]
    root = _fsdp2_root(obj)
    if root is not None:
        return [Meta(*m) for m in _fsdp2_source(obj, root).metadata()]
    from ...engines.fsdp2.hook import SRShadowParam

    def dtype(p) -> str:  # a keyed FP32 master is exported as its BF16 rounding
        return "bfloat16" if isinstance(p, SRShadowParam) else dtype_name(p.dtype)

    return [Meta(normalize_param_name(n), dtype(p), tuple(p.shape)) for n, p in obj.named_parameters()]


def _deepspeed_weights(engine) -> Iterator[tuple[str, torch.Tensor]]:
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        for name, p in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p]):
                full = p.detach().clone()
            yield normalize_param_name(name), full
        return
    for name, p in engine.module.named_parameters():
        yield normalize_param_name(name), p.detach()


def rollout_shards(obj) -> Iterator[LocalPiece]:
    """This rank's pieces of the working weights with their global flat offsets, nothing
    gathered: an FSDP2 shard rounded with its global key, a ZeRO-3 partition, or an equal
    contiguous slice of a replicated tensor (the ranks' pieces cover every element once)."""
    rank, world = _rank_world()
    if _is_deepspeed(obj):
        if obj.zero_optimization_stage() == 3:
            from ...engines.deepspeed.source import ZeRO3Source

            source = ZeRO3Source(obj.module, rank, world)
        else:
            source = ReplicatedSource(obj.module, rank, world)
    else:
        root = _fsdp2_root(obj)
        if root is None:  # a replicated model: each rank an equal contiguous slice
            for name, full in rollout_weights(obj):
                flat = full.reshape(-1)
                start, end = split_range(flat.numel(), world, rank)
                yield LocalPiece(name, start, end, flat[start:end])
            return
        source = _fsdp2_source(obj, root)
    yield from source.local_pieces([m[0] for m in source.metadata()])
