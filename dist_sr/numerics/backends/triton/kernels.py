"""Triton kernels: the keyed SR cast and the fused AdamW steps, for any number of tensors per launch.

Device code only; ``sr_launch`` and ``adamw_launch`` build the launches. Bitwise equal to the reference and the
C++ kernel: only the stream key ``K`` and the global element index enter, the hash is 64-bit
unsigned SplitMix64, and AdamW is the same sequence of IEEE-rounded operations (launched with
``enable_fp_fusion=False``, ``sqrt_rn`` and ``div_rn``).

Layout of a block: ``BLOCK`` consecutive elements seen as ``[BLOCK // 4, 4]``, one row per
hash. Row ``r`` of block ``b`` of a tensor whose first element has global index ``g0`` holds
global indices ``4 * q .. 4 * q + 3`` with ``q = (g0 - g0 % 4) / 4 + b * BLOCK / 4 + r``; local
element ``j = 4 * (q - q0) + c - g0 % 4``. So one 64-bit hash feeds the row's four elements
exactly as the contract says (``h_q >> 16 * (i & 3)``), whatever the offset.

``ALIGNED`` launches (every pointer 16-byte aligned, ``g0 % 4 == 0``) tell the compiler so:
full blocks then load and store 16 bytes per thread and instruction. Other launches are correct
for any address and offset, with narrower accesses.

Multi-tensor launches read per-tensor fields from an int64 table ``meta[F, T]`` (field-major).
Program ``pid`` finds its tensor and block in one load from ``bmap[pid] = t << 32 | block``,
which ``block_map_kernel`` expands on the device from the cumulative block counts: the host
builds and uploads O(T) data however many elements the tensors hold, and a program starts
loading data after one dependent load instead of a search.
"""

from __future__ import annotations

import triton
import triton.language as tl

GAMMA = 0x9E3779B97F4A7C15


@triton.jit
def _mix(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _row_bits(key, q):
    """``[R, 4]`` uint32 random bits of rows ``q`` (``[R]`` int64 global 4-element groups)."""
    h = _mix(key + (q.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15)
    shift = (tl.arange(0, 4) * 16).to(tl.uint64)
    return ((h[:, None] >> shift[None, :]) & 0xFFFF).to(tl.uint32)


@triton.jit
def _to_bf16(b, r):
    """BF16 bits (uint16) of FP32 bits ``b`` (uint32) plus random bits ``r``; NaN -> 0x7FC0."""
    y = (b + r) >> 16
    return tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, y).to(tl.uint16)


@triton.jit
def _round(b, key, q, KEYED: tl.constexpr):
    if KEYED:
        r = _row_bits(key, q)
    else:
        r = 0x7FFF + ((b >> 16) & 1)
    return _to_bf16(b, r)


@triton.jit
def _widen(bits16):
    """FP32 value of BF16 bits (uint16)."""
    return (bits16.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def block_map_kernel(starts, bmap, CHUNK: tl.constexpr):
    """Program ``t`` writes ``t << 32 | b`` for each of its blocks ``b`` at ``bmap[starts[t] + b]``."""
    t = tl.program_id(0).to(tl.int64)
    lo = tl.load(starts + t)
    hi = tl.load(starts + t + 1)
    for i in range(lo, hi, CHUNK):
        j = i + tl.arange(0, CHUNK)
        tl.store(bmap + j, (t << 32) | (j - lo), mask=j < hi)


@triton.jit
def _locate(bmap):
    entry = tl.load(bmap + tl.program_id(0))
    return entry >> 32, entry & 0xFFFFFFFF


@triton.jit
def _tile(blk, g0, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Local element indices ``[R, 4]`` and global rows ``[R]`` of block ``blk``."""
    R: tl.constexpr = BLOCK // 4
    rows = tl.arange(0, R).to(tl.int64)
    u = blk * BLOCK + rows[:, None] * 4 + tl.arange(0, 4)[None, :]
    if ALIGNED:
        return u, g0 // 4 + blk * R + rows
    shift = g0 % 4
    return u - shift, (g0 - shift) // 4 + blk * R + rows


# ---- SR cast -----------------------------------------------------------------------------------


@triton.jit
def _sr_block(x_ptr, out_ptr, n, g0, key, blk, KEYED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    j, q = _tile(blk, g0, BLOCK, ALIGNED)
    if ALIGNED and blk * BLOCK + BLOCK <= n:  # a full block: no mask, 16-byte accesses
        b = tl.load(x_ptr + j)
        tl.store(out_ptr + j, _round(b, key, q, KEYED))
    else:
        mask = (j >= 0) & (j < n)
        b = tl.load(x_ptr + j, mask=mask, other=0)
        tl.store(out_ptr + j, _round(b, key, q, KEYED), mask=mask)


@triton.jit(do_not_specialize=["n", "g0", "key"])
def sr_one_kernel(x_ptr, out_ptr, n, g0, key, KEYED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One tensor: ``x`` (FP32 bits as uint32) -> ``out`` (BF16 bits as uint16); ``key`` is the
    stream key as a signed 64-bit int."""
    key = key.to(tl.int64).to(tl.uint64, bitcast=True)
    _sr_block(x_ptr, out_ptr, n, g0.to(tl.int64), key, tl.program_id(0).to(tl.int64), KEYED, ALIGNED, BLOCK)


# meta rows of a multi-tensor SR launch
SR_FIELDS = ("x", "out", "n", "g0")


@triton.jit(do_not_specialize=["T"])
def sr_many_kernel(meta, bmap, keys, T, KEYED: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """Many tensors: ``meta[SR_FIELDS, T]``, the block map ``bmap`` (one entry per program), ``keys[T]``."""
    t, blk = _locate(bmap)
    x_ptr = tl.load(meta + t).to(tl.pointer_type(tl.uint32))
    out_ptr = tl.load(meta + T + t).to(tl.pointer_type(tl.uint16))
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
        out_ptr = tl.multiple_of(out_ptr, 16)
    n = tl.load(meta + 2 * T + t)
    g0 = tl.load(meta + 3 * T + t)
    if KEYED:
        key = tl.load(keys + t).to(tl.uint64, bitcast=True)
    else:
        key = 0
    _sr_block(x_ptr, out_ptr, n, g0, key, blk, KEYED, ALIGNED, BLOCK)


@triton.jit(do_not_specialize=["n", "g0", "key", "row_len", "row_stride"])
def sr_rows_kernel(x_ptr, out_ptr, n, g0, key, row_len, row_stride, KEYED: tl.constexpr, BLOCK: tl.constexpr):
    """A strided shard (see ``RoundingJob``): local ``(r, c)`` is global ``g0 + r * row_stride + c``.
    One hash per element: rows need not align with the 4-element groups."""
    key = key.to(tl.int64).to(tl.uint64, bitcast=True)
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < n
    b = tl.load(x_ptr + j, mask=mask, other=0)
    if KEYED:
        g = (g0 + (j // row_len) * row_stride + j % row_len).to(tl.uint64)
        h = _mix(key + ((g >> 2) + 1) * 0x9E3779B97F4A7C15)
        r = ((h >> ((g & 3) * 16)) & 0xFFFF).to(tl.uint32)
    else:
        r = 0x7FFF + ((b >> 16) & 1)
    tl.store(out_ptr + j, _to_bf16(b, r), mask=mask)


# ---- fused AdamW ---------------------------------------------------------------------------------
# Two flavours share one body. Shadow (PURE=False): FP32 shadow ``p``, FP32 moments, BF16 working
# copy ``out = round(p)``. Pure BF16 (PURE=True, arXiv 2502.20566): BF16 ``p`` updated in place
# with ``round(p')``; moments FP32, or BF16 rounded with their own keys (MOMENT_BF16).

# meta rows of a multi-tensor AdamW launch (``out`` unused when PURE)
ADAMW_FIELDS = ("p", "m", "v", "out", "n", "g0")
# per-step rows: gradient address, index of the constants row (keys come in their own [3, T]:
# param, exp_avg, exp_avg_sq)
ADAMW_STEP_FIELDS = ("grad", "slot")
# FP32 constants per slot, computed on the host in double (``fused.AdamWHyper.scalars``)
ADAMW_CONSTS = ("one_minus_beta1", "beta2", "one_minus_beta2", "decay", "neg_step_size", "rbc2", "eps", "unused")


@triton.jit
def _adamw_tile(
    p_ptr,
    m_ptr,
    v_ptr,
    g_ptr,
    out_ptr,
    j,
    q,
    mask,
    kp,
    km,
    kv,
    c,
    scale,
    MASKED: tl.constexpr,
    KEYED: tl.constexpr,
    GRAD_BF16: tl.constexpr,
    PURE: tl.constexpr,
    MOMENT_BF16: tl.constexpr,
):
    if MASKED:
        g = tl.load(g_ptr + j, mask=mask, other=0)
        p = tl.load(p_ptr + j, mask=mask, other=0)
        m = tl.load(m_ptr + j, mask=mask, other=0)
        v = tl.load(v_ptr + j, mask=mask, other=0)
    else:
        g = tl.load(g_ptr + j)
        p = tl.load(p_ptr + j)
        m = tl.load(m_ptr + j)
        v = tl.load(v_ptr + j)
    if GRAD_BF16:
        g = _widen(g)
    if PURE:
        p = _widen(p)
    if MOMENT_BF16:
        m = _widen(m)
        v = _widen(v)
    g = g * scale
    m = m + tl.load(c + 0) * (g - m)
    v = v * tl.load(c + 1) + (tl.load(c + 2) * g) * g
    p = p * tl.load(c + 3)
    p = p + tl.div_rn(tl.load(c + 4) * m, tl.sqrt_rn(v) * tl.load(c + 5) + tl.load(c + 6))
    w = _round(p.to(tl.uint32, bitcast=True), kp, q, KEYED)
    if MOMENT_BF16:
        m = _round(m.to(tl.uint32, bitcast=True), km, q, KEYED)
        v = _round(v.to(tl.uint32, bitcast=True), kv, q, KEYED)
    if PURE:
        p = w
    if MASKED:
        tl.store(p_ptr + j, p, mask=mask)
        tl.store(m_ptr + j, m, mask=mask)
        tl.store(v_ptr + j, v, mask=mask)
        if not PURE:
            tl.store(out_ptr + j, w, mask=mask)
    else:
        tl.store(p_ptr + j, p)
        tl.store(m_ptr + j, m)
        tl.store(v_ptr + j, v)
        if not PURE:
            tl.store(out_ptr + j, w)


@triton.jit
def _ptr(addr, dtype, ALIGNED: tl.constexpr):
    p = addr.to(tl.pointer_type(dtype))
    if ALIGNED:
        p = tl.multiple_of(p, 16)
    return p


@triton.jit(do_not_specialize=["T"])
def adamw_many_kernel(
    meta,
    bmap,
    keys,
    step_data,
    consts,
    scale_ptr,
    T,
    KEYED: tl.constexpr,
    ALIGNED: tl.constexpr,
    GRAD_BF16: tl.constexpr,
    PURE: tl.constexpr,
    MOMENT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``meta[ADAMW_FIELDS, T]``, ``bmap`` (one entry per program), ``keys[3, T]`` (int64: param,
    exp_avg, exp_avg_sq),
    ``step_data[ADAMW_STEP_FIELDS, T]``, ``consts[slots, 8]`` (FP32), ``scale_ptr``: the gradient
    scale (one FP32 on the device, e.g. from gradient clipping)."""
    t, blk = _locate(bmap)
    p_dtype: tl.constexpr = tl.uint16 if PURE else tl.float32
    m_dtype: tl.constexpr = tl.uint16 if MOMENT_BF16 else tl.float32
    g_dtype: tl.constexpr = tl.uint16 if GRAD_BF16 else tl.float32
    p_ptr = _ptr(tl.load(meta + t), p_dtype, ALIGNED)
    m_ptr = _ptr(tl.load(meta + T + t), m_dtype, ALIGNED)
    v_ptr = _ptr(tl.load(meta + 2 * T + t), m_dtype, ALIGNED)
    out_ptr = _ptr(tl.load(meta + 3 * T + t), tl.uint16, ALIGNED)
    n = tl.load(meta + 4 * T + t)
    g0 = tl.load(meta + 5 * T + t)
    if KEYED:
        kp = tl.load(keys + t).to(tl.uint64, bitcast=True)
        km = tl.load(keys + T + t).to(tl.uint64, bitcast=True)
        kv = tl.load(keys + 2 * T + t).to(tl.uint64, bitcast=True)
    else:
        kp = 0
        km = 0
        kv = 0
    g_ptr = _ptr(tl.load(step_data + t), g_dtype, ALIGNED)
    c = consts + tl.load(step_data + T + t) * 8
    scale = tl.load(scale_ptr)
    j, q = _tile(blk, g0, BLOCK, ALIGNED)
    if ALIGNED and blk * BLOCK + BLOCK <= n:
        _adamw_tile(
            p_ptr,
            m_ptr,
            v_ptr,
            g_ptr,
            out_ptr,
            j,
            q,
            None,
            kp,
            km,
            kv,
            c,
            scale,
            False,
            KEYED,
            GRAD_BF16,
            PURE,
            MOMENT_BF16,
        )
    else:
        mask = (j >= 0) & (j < n)
        _adamw_tile(
            p_ptr,
            m_ptr,
            v_ptr,
            g_ptr,
            out_ptr,
            j,
            q,
            mask,
            kp,
            km,
            kv,
            c,
            scale,
            True,
            KEYED,
            GRAD_BF16,
            PURE,
            MOMENT_BF16,
        )
