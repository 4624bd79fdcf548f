"""Triton kernels: the keyed SR cast and fused AdamW + SR, for many tensors in one launch.

Bitwise equal to the reference and the C++ kernel: the same key (only ``K`` and the global index
enter the kernel), 64-bit unsigned SplitMix64, and for AdamW the same sequence of IEEE-rounded
operations (launched with ``enable_fp_fusion=False``, ``sqrt_rn`` and ``div_rn``).

A launch covers a list of tensors through a task table: one program per (tensor, block), with
each tensor's pointers, length, key and global offset read from small int64 arrays. Under
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors, which is how they are tested on a
machine without a GPU.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _round_block(b, idx, key, KEYED: tl.constexpr):
    """BF16 bits (uint32) of FP32 bits ``b`` (uint32) at global indices ``idx`` (uint64)."""
    if KEYED:
        z = key + ((idx >> 2) + 1) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        r = ((z >> ((idx & 3) * 16)) & 0xFFFF).to(tl.uint32)
    else:
        r = 0x7FFF + ((b >> 16) & 1)
    y = (b + r) >> 16
    is_nan = (b & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, 0x7FC0, y)


@triton.jit
def _task(task_tensor, task_block, ns, keys, offsets):
    pid = tl.program_id(0)
    t = tl.load(task_tensor + pid)
    start = tl.load(task_block + pid).to(tl.int64)
    n = tl.load(ns + t)
    key = tl.load(keys + t).to(tl.uint64, bitcast=True)
    offset = tl.load(offsets + t)
    return t, start, n, key, offset


@triton.jit
def _sr_kernel(task_tensor, task_block, x_ptrs, out_ptrs, ns, keys, offsets, row_lens, row_strides,
               KEYED: tl.constexpr, STRIDED: tl.constexpr, BLOCK: tl.constexpr):
    t, start, n, key, offset = _task(task_tensor, task_block, ns, keys, offsets)
    x_ptr = tl.load(x_ptrs + t).to(tl.pointer_type(tl.uint32))
    out_ptr = tl.load(out_ptrs + t).to(tl.pointer_type(tl.uint16))
    j = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = j < n
    b = tl.load(x_ptr + j, mask=mask, other=0)
    if STRIDED:  # a strided shard: local row r, column c is global offset + r * row_stride + c
        row_len = tl.load(row_lens + t)
        g = offset + (j // row_len) * tl.load(row_strides + t) + j % row_len
    else:
        g = offset + j
    y = _round_block(b, g.to(tl.uint64), key, KEYED)
    tl.store(out_ptr + j, y.to(tl.uint16), mask=mask)


@triton.jit
def _adamw_kernel(task_tensor, task_block, s_ptrs, m_ptrs, v_ptrs, g_ptrs, out_ptrs, ns, keys, offsets, consts,
                  KEYED: tl.constexpr, GRAD_BF16: tl.constexpr, BLOCK: tl.constexpr):
    t, start, n, key, offset = _task(task_tensor, task_block, ns, keys, offsets)
    s_ptr = tl.load(s_ptrs + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(m_ptrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(v_ptrs + t).to(tl.pointer_type(tl.float32))
    out_ptr = tl.load(out_ptrs + t).to(tl.pointer_type(tl.uint16))
    c = consts + t * 8
    one_minus_beta1 = tl.load(c + 0)
    beta2 = tl.load(c + 1)
    one_minus_beta2 = tl.load(c + 2)
    decay = tl.load(c + 3)
    neg_step_size = tl.load(c + 4)
    rbc2 = tl.load(c + 5)
    eps = tl.load(c + 6)
    grad_scale = tl.load(c + 7)
    j = start + tl.arange(0, BLOCK).to(tl.int64)
    mask = j < n
    if GRAD_BF16:
        g_bits = tl.load(tl.load(g_ptrs + t).to(tl.pointer_type(tl.uint16)) + j, mask=mask, other=0)
        g = (g_bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        g = tl.load(tl.load(g_ptrs + t).to(tl.pointer_type(tl.float32)) + j, mask=mask, other=0.0)
    g = tl.where(grad_scale != 1.0, g * grad_scale, g)
    m = tl.load(m_ptr + j, mask=mask, other=0.0)
    v = tl.load(v_ptr + j, mask=mask, other=0.0)
    s = tl.load(s_ptr + j, mask=mask, other=0.0)
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + (one_minus_beta2 * g) * g
    s = s * decay
    s = s + tl.div_rn(neg_step_size * m, tl.sqrt_rn(v) * rbc2 + eps)
    tl.store(m_ptr + j, m, mask=mask)
    tl.store(v_ptr + j, v, mask=mask)
    tl.store(s_ptr + j, s, mask=mask)
    y = _round_block(s.to(tl.uint32, bitcast=True), (offset + j).to(tl.uint64), key, KEYED)
    tl.store(out_ptr + j, y.to(tl.uint16), mask=mask)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    device = tensors[0].device
    if device.type != "cuda" and not _interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (got {device}); set TRITON_INTERPRET=1 to run them on the CPU")
    for t in tensors:
        if t.device != device or not t.is_contiguous():
            raise ValueError("Triton kernels need contiguous tensors on one device")
    return device


def _table(ns: list[int], device) -> tuple[torch.Tensor, torch.Tensor, int]:
    tensor_ids, blocks = [], []
    for t, n in enumerate(ns):
        for start in range(0, n, BLOCK):
            tensor_ids.append(t)
            blocks.append(start)
    ids = torch.tensor(tensor_ids, dtype=torch.int32, device=device)
    return ids, torch.tensor(blocks, dtype=torch.int64, device=device), len(blocks)


def _i64(values, device) -> torch.Tensor:
    return torch.tensor([v - (1 << 64) if v >= 1 << 63 else v for v in values], dtype=torch.int64, device=device)


def round_many(xs: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], keys: Sequence[int | None],
               offsets: Sequence[int], rows: Sequence[tuple[int, int] | None] | None = None) -> None:
    """Round flat FP32 tensors into flat BF16 tensors, one launch per (keyed, strided) kind.

    ``rows[i] = (row_len, row_stride)`` marks tensor ``i`` as a strided shard (see RoundingJob).
    """
    rows = list(rows) if rows is not None else [None] * len(xs)
    for keyed in (True, False):
        for strided in (False, True):
            sel = [i for i, k in enumerate(keys)
                   if (k is not None) == keyed and (rows[i] is not None) == strided and xs[i].numel()]
            if not sel:
                continue
            device = _check_device([xs[i] for i in sel] + [outs[i] for i in sel])
            ns = [xs[i].numel() for i in sel]
            ids, blocks, grid = _table(ns, device)
            shape = [rows[i] or (1, 1) for i in sel]
            _sr_kernel[(grid,)](
                ids, blocks, _i64([xs[i].data_ptr() for i in sel], device),
                _i64([outs[i].data_ptr() for i in sel], device), _i64(ns, device),
                _i64([keys[i] or 0 for i in sel], device), _i64([offsets[i] for i in sel], device),
                _i64([r[0] for r in shape], device), _i64([r[1] for r in shape], device),
                KEYED=keyed, STRIDED=strided, BLOCK=BLOCK,
            )


def adamw_sr_(shadow, exp_avg, exp_avg_sq, grad, out, key: int | None, offset: int, hyper) -> None:
    """Fused AdamW + rounding for one tensor (see ``adamw_many_`` for lists)."""
    adamw_many_([(shadow, exp_avg, exp_avg_sq, grad, out, key, offset, hyper)])


def adamw_many_(items) -> None:
    """``items``: (shadow, exp_avg, exp_avg_sq, grad, out, key, offset, AdamWHyper); one launch per
    (keyed, grad dtype) combination."""
    groups: dict[tuple[bool, bool], list] = {}
    for item in items:
        if item[0].numel():
            groups.setdefault((item[5] is not None, item[3].dtype == torch.bfloat16), []).append(item)
    for (keyed, grad_bf16), group in groups.items():
        device = _check_device([t for it in group for t in it[:5]])
        ns = [it[0].numel() for it in group]
        ids, blocks, grid = _table(ns, device)
        consts = torch.tensor([[h[k] for k in ("one_minus_beta1", "beta2", "one_minus_beta2", "decay", "neg_step_size",
                                                "rbc2", "eps", "grad_scale")]
                               for h in (it[7].scalars() for it in group)], dtype=torch.float32, device=device)
        ptrs = [_i64([it[k].data_ptr() for it in group], device) for k in range(5)]
        _adamw_kernel[(grid,)](
            ids, blocks, *ptrs, _i64(ns, device), _i64([it[5] or 0 for it in group], device),
            _i64([it[6] for it in group], device), consts, KEYED=keyed, GRAD_BF16=grad_bf16, BLOCK=BLOCK,
            **({} if _interpreting() else {"enable_fp_fusion": False}),
        )
