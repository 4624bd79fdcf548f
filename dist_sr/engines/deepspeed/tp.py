"""DeepSpeed AutoTP (``"tensor_parallel": {"autotp_size": N}``): where each element of a rank's
tensor-parallel shard lies in the full parameter, so the rounding key takes the element's index in
the full parameter (the contract: any TP layout rounds an element alike).

AutoTP replaces linear layers by sharded ones (column-parallel ``LinearLayer``: rows of the
weight; row-parallel ``LinearAllreduce``: columns; fused and vocabulary variants) and describes
each shard on the parameter itself (``ds_autotp_universal_checkpoint_meta``, for universal
checkpoints): an affine map whose pieces place blocks of the shard in the full tensor. A shard
that DeepSpeed does not describe, or that holds a scaled copy of the full tensor (a replicated
bias pre-divided by the TP size), is refused by name when SR is attached, before the first step.
"""

from __future__ import annotations

import math

import torch

from ...numerics.shards import RowBlock
from .version import UnsupportedDeepSpeed

META = "ds_autotp_universal_checkpoint_meta"  # deepspeed.checkpoint.constants.DS_AUTOTP_UC_META


class UnsupportedTensorParallel(UnsupportedDeepSpeed):
    what = "unsupported tensor-parallel layout"


def tp_size(engine) -> int:
    size = getattr(engine, "autotp_size", None)
    return int(size()) if callable(size) else 0


def tp_blocks(engine, module: torch.nn.Module) -> dict[int, list[RowBlock]]:
    """``id(param) -> row blocks of its local shard`` for every parameter of a tensor-parallel
    layer of ``module`` (none without AutoTP); refuses a shard it cannot place."""
    if tp_size(engine) <= 1:
        return {}
    out = {}
    for mod_name, mod in module.named_modules():
        if not hasattr(mod, "tp_index") or not hasattr(mod, "mp_group"):  # not a TensorParallel_Layer
            continue
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            out[id(p)] = blocks_of(name, p, type(mod).__name__, int(mod.tp_index))
    return out


def blocks_of(name: str, param: torch.Tensor, layer: str, tp_rank: int) -> list[RowBlock]:
    """The row blocks of TP rank ``tp_rank``'s shard ``param`` (of layer class ``layer``), read
    from the affine map DeepSpeed attaches to it."""
    conversion = (getattr(param, META, None) or {}).get("conversion") or {}
    described = conversion.get("affine_map")
    fix = (
        "use AutoTP layers whose shards DeepSpeed describes (column/row-parallel linear layers, "
        'DeepSpeed 0.19.8), or turn "tensor_parallel" off for SR'
    )
    if described is None:
        why = conversion.get("unsupported_reason") or "DeepSpeed attached no affine map to it"
        raise UnsupportedTensorParallel(
            f"{name} ({layer}): the element indices of this tensor-parallel shard in the full parameter are "
            f"unknown ({why}), so its keyed rounding would depend on the TP layout; {fix}"
        )
    from deepspeed.checkpoint.affine import ParamAffineMap

    pieces = ParamAffineMap.from_dict(described).pieces_by_rank.get(tp_rank, [])
    blocks = []
    for piece in pieces:
        if piece.scale != 1.0:
            raise UnsupportedTensorParallel(
                f"{name} ({layer}): this TP rank holds the full tensor scaled by {piece.scale}, not its "
                f"elements, so no keyed rounding of the full parameter gives its bits; {fix}"
            )
        block = row_block(piece.shape, piece.source_offset, piece.source_strides, piece.dest_offset, piece.dest_strides)
        if block is None:
            raise UnsupportedTensorParallel(
                f"{name} ({layer}): a shard piece of shape {piece.shape} with strides {piece.source_strides} in the "
                f"full parameter and {piece.dest_strides} in the shard is not a block of rows; {fix}"
            )
        if block.rows:
            blocks.append(block)
    numel = getattr(param, "ds_numel", None) or param.numel()
    if sum(b.rows * b.row_len for b in blocks) != numel:
        raise UnsupportedTensorParallel(
            f"{name} ({layer}): DeepSpeed's map places {sum(b.rows * b.row_len for b in blocks)} elements of this "
            f"rank's shard, which has {numel}; {fix}"
        )
    return sorted(blocks, key=lambda b: b.local)


def row_block(shape, source_offset, source_strides, dest_offset, dest_strides) -> RowBlock | None:
    """A piece (``torch.as_strided`` arguments on the full tensor and on the shard) as one block
    of rows dense in the shard, or None if it is not one."""
    dims = [(n, s, d) for n, s, d in zip(shape, source_strides, dest_strides) if n != 1]
    numel = math.prod(shape)
    if numel == 0:
        return RowBlock(dest_offset, 0, 0, source_offset, 0)
    expect = 1
    for n, _, d in reversed(dims):  # dense, row-major in the shard
        if d != expect:
            return None
        expect *= n
    row_len, i = 1, len(dims)
    while i and dims[i - 1][1] == row_len:  # the trailing dims contiguous in the full tensor
        row_len *= dims[i - 1][0]
        i -= 1
    outer = dims[:i]
    if not outer:
        return RowBlock(dest_offset, 1, row_len, source_offset, row_len)
    for (_, s_a, _), (n_b, s_b, _) in zip(outer, outer[1:]):  # the leading dims must fold into one
        if s_a != s_b * n_b:
            return None
    if outer[-1][1] < row_len:  # rows that overlap in the full tensor
        return None
    return RowBlock(dest_offset, math.prod(n for n, _, _ in outer), row_len, source_offset, outer[-1][1])
