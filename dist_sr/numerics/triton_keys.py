"""Per-step data derived on the GPU, so a step captured in a CUDA graph replays correctly: the
rounding keys (BLAKE2b-64 of the key message with the step filled in from a device counter,
exactly ``key.stream_key``) and AdamW's constants (``fused.AdamWHyper.scalars`` from a device step).

One lane per tensor: every BLAKE2b operation is elementwise on uint64 vectors. The message of
lane ``t`` arrives as ``NB`` 128-byte blocks of little-endian words (``tmpl[16 * NB, T]``) with
the step bytes zero; the kernel ORs the step in (``key.STEP_BYTE``) and compresses.
"""

from __future__ import annotations

import triton
import triton.language as tl



@triton.jit
def _rotr(x, n: tl.constexpr):
    return (x >> n) | (x << (64 - n))


@triton.jit
def _g(a, b, c, d, x, y):
    a = a + b + x
    d = _rotr(d ^ a, 32)
    c = c + d
    b = _rotr(b ^ c, 24)
    a = a + b + y
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 63)
    return a, b, c, d


@triton.jit
def _round(v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
           x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """One BLAKE2b round; ``x`` are the message words in this round's SIGMA order."""
    v0, v4, v8, v12 = _g(v0, v4, v8, v12, x0, x1)
    v1, v5, v9, v13 = _g(v1, v5, v9, v13, x2, x3)
    v2, v6, v10, v14 = _g(v2, v6, v10, v14, x4, x5)
    v3, v7, v11, v15 = _g(v3, v7, v11, v15, x6, x7)
    v0, v5, v10, v15 = _g(v0, v5, v10, v15, x8, x9)
    v1, v6, v11, v12 = _g(v1, v6, v11, v12, x10, x11)
    v2, v7, v8, v13 = _g(v2, v7, v8, v13, x12, x13)
    v3, v4, v9, v14 = _g(v3, v4, v9, v14, x14, x15)
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _compress(h0, h1, h2, h3, h4, h5, h6, h7, m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14,
              m15, t, last):
    v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
    v8 = tl.full(h0.shape, 0x6A09E667F3BCC908, tl.uint64)
    v9 = tl.full(h0.shape, 0xBB67AE8584CAA73B, tl.uint64)
    v10 = tl.full(h0.shape, 0x3C6EF372FE94F82B, tl.uint64)
    v11 = tl.full(h0.shape, 0xA54FF53A5F1D36F1, tl.uint64)
    v12 = tl.full(h0.shape, 0x510E527FADE682D1, tl.uint64) ^ t
    v13 = tl.full(h0.shape, 0x9B05688C2B3E6C1F, tl.uint64)
    v14 = tl.full(h0.shape, 0x1F83D9ABFB41BD6B, tl.uint64) ^ tl.where(last, tl.full(h0.shape, 0xFFFFFFFFFFFFFFFF, tl.uint64), 0)
    v15 = tl.full(h0.shape, 0x5BE0CD19137E2179, tl.uint64)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m14, m10, m4, m8, m9, m15, m13, m6, m1, m12, m0, m2, m11, m7, m5, m3)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m11, m8, m12, m0, m5, m2, m15, m13, m10, m14, m3, m6, m7, m1, m9, m4)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m7, m9, m3, m1, m13, m12, m11, m14, m2, m6, m5, m10, m4, m0, m15, m8)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m9, m0, m5, m7, m2, m4, m10, m15, m14, m1, m11, m12, m6, m8, m3, m13)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m2, m12, m6, m10, m0, m11, m8, m3, m4, m13, m7, m5, m15, m14, m1, m9)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m12, m5, m1, m15, m14, m13, m4, m10, m0, m7, m6, m3, m9, m2, m8, m11)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m13, m11, m7, m14, m12, m1, m3, m9, m5, m0, m15, m4, m8, m6, m2, m10)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m6, m15, m14, m9, m11, m3, m0, m8, m12, m2, m13, m7, m1, m4, m10, m5)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m10, m2, m8, m4, m7, m6, m1, m5, m15, m11, m9, m14, m3, m12, m13, m0)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m0, m1, m2, m3, m4, m5, m6, m7, m8, m9, m10, m11, m12, m13, m14, m15)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15,
        m14, m10, m4, m8, m9, m15, m13, m6, m1, m12, m0, m2, m11, m7, m5, m3)
    return (h0 ^ v0 ^ v8, h1 ^ v1 ^ v9, h2 ^ v2 ^ v10, h3 ^ v3 ^ v11, h4 ^ v4 ^ v12, h5 ^ v5 ^ v13, h6 ^ v6 ^ v14,
            h7 ^ v7 ^ v15)


@triton.jit
def _word(tmpl, w, lanes, mask, T):
    return tl.load(tmpl + w * T + lanes, mask=mask, other=0).to(tl.uint64, bitcast=True)


@triton.jit
def _powi(x, n):
    """``x ** n`` for an int64 ``n >= 0`` by square-and-multiply: the same double operations as
    ``fused.powi`` on the host, so both round alike."""
    r = x * 0.0 + 1.0
    for _ in tl.static_range(64):
        r = tl.where((n & 1) != 0, r * x, r)
        x = x * x
        n = n >> 1
    return r


@triton.jit(do_not_specialize=["T", "S", "NB"])
def step_data_kernel(tmpl, lens, step_ptr, keys, T, hyper, consts, S, NB, STEP_BYTE: tl.constexpr,
                     KEYED_STEP: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr):
    """For the step after ``*step_ptr``: ``keys[t]`` (int64) of every lane's message ``tmpl``
    (``lens[t]`` bytes, at most ``NB`` blocks), and (program 0) AdamW's FP32 constants
    ``consts[S, 8]`` from the double hyper-parameters ``hyper[S, 5]`` = (lr, beta1, beta2, eps,
    weight_decay). The block loop is a runtime loop: one compression is compiled, not NB."""
    step = tl.load(step_ptr) + 1
    lanes = tl.program_id(0) * BT + tl.arange(0, BT)
    mask = lanes < T
    n = tl.load(lens + lanes, mask=mask, other=1)
    nblocks = (n + 127) // 128
    h0 = tl.full([BT], 0x6A09E667F3BCC908 ^ 0x01010008, tl.uint64)  # digest length 8, no key
    h1 = tl.full([BT], 0xBB67AE8584CAA73B, tl.uint64)
    h2 = tl.full([BT], 0x3C6EF372FE94F82B, tl.uint64)
    h3 = tl.full([BT], 0xA54FF53A5F1D36F1, tl.uint64)
    h4 = tl.full([BT], 0x510E527FADE682D1, tl.uint64)
    h5 = tl.full([BT], 0x9B05688C2B3E6C1F, tl.uint64)
    h6 = tl.full([BT], 0x1F83D9ABFB41BD6B, tl.uint64)
    h7 = tl.full([BT], 0x5BE0CD19137E2179, tl.uint64)
    s = step.to(tl.uint64, bitcast=True)
    if not KEYED_STEP:
        s = s * 0
    for b in range(NB):
        base = b * 16
        m0 = _word(tmpl, base + 0, lanes, mask, T)
        m1 = _word(tmpl, base + 1, lanes, mask, T)
        m2 = _word(tmpl, base + 2, lanes, mask, T)
        m3 = _word(tmpl, base + 3, lanes, mask, T)
        m4 = _word(tmpl, base + 4, lanes, mask, T)
        m5 = _word(tmpl, base + 5, lanes, mask, T)
        m6 = _word(tmpl, base + 6, lanes, mask, T)
        m7 = _word(tmpl, base + 7, lanes, mask, T)
        m8 = _word(tmpl, base + 8, lanes, mask, T)
        m9 = _word(tmpl, base + 9, lanes, mask, T)
        m10 = _word(tmpl, base + 10, lanes, mask, T)
        m11 = _word(tmpl, base + 11, lanes, mask, T)
        m12 = _word(tmpl, base + 12, lanes, mask, T)
        m13 = _word(tmpl, base + 13, lanes, mask, T)
        m14 = _word(tmpl, base + 14, lanes, mask, T)
        m15 = _word(tmpl, base + 15, lanes, mask, T)
        # the step's 8 bytes start at STEP_BYTE (22: the top of word 2 and the bottom of word 3), block 0
        first = b == 0
        m2 = tl.where(first, m2 | (s << (8 * (STEP_BYTE - 16))), m2)
        m3 = tl.where(first, m3 | (s >> (8 * (24 - STEP_BYTE))), m3)
        last = nblocks == b + 1
        t = tl.where(last, n, (b + 1) * 128).to(tl.uint64)
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(h0, h1, h2, h3, h4, h5, h6, h7, m0, m1, m2, m3, m4, m5, m6, m7,
                                                   m8, m9, m10, m11, m12, m13, m14, m15, t, last)
        live = nblocks > b
        h0 = tl.where(live, c0, h0)
        h1 = tl.where(live, c1, h1)
        h2 = tl.where(live, c2, h2)
        h3 = tl.where(live, c3, h3)
        h4 = tl.where(live, c4, h4)
        h5 = tl.where(live, c5, h5)
        h6 = tl.where(live, c6, h6)
        h7 = tl.where(live, c7, h7)
    tl.store(keys + lanes, h0.to(tl.int64, bitcast=True), mask=mask)
    if tl.program_id(0) == 0:
        slots = tl.arange(0, BS)
        smask = slots < S
        lr = tl.load(hyper + slots * 5 + 0, mask=smask, other=0.0)
        beta1 = tl.load(hyper + slots * 5 + 1, mask=smask, other=0.0)
        beta2 = tl.load(hyper + slots * 5 + 2, mask=smask, other=0.0)
        eps = tl.load(hyper + slots * 5 + 3, mask=smask, other=0.0)
        wd = tl.load(hyper + slots * 5 + 4, mask=smask, other=0.0)
        c = consts + slots * 8
        tl.store(c + 0, (1.0 - beta1).to(tl.float32), mask=smask)
        tl.store(c + 1, beta2.to(tl.float32), mask=smask)
        tl.store(c + 2, (1.0 - beta2).to(tl.float32), mask=smask)
        tl.store(c + 3, (1.0 - lr * wd).to(tl.float32), mask=smask)
        tl.store(c + 4, (-(lr / (1.0 - _powi(beta1, step)))).to(tl.float32), mask=smask)
        tl.store(c + 5, (1.0 / tl.sqrt(1.0 - _powi(beta2, step))).to(tl.float32), mask=smask)
        tl.store(c + 6, eps.to(tl.float32), mask=smask)
        tl.store(c + 7, (lr * 0.0).to(tl.float32), mask=smask)
