"""Per-step data derived on the GPU, so a step captured in a CUDA graph replays correctly: the
rounding keys (BLAKE2b-64 of the key message with the step filled in from a device counter,
exactly ``key.stream_key``) and AdamW's constants (``fused.AdamWHyper.scalars`` from a device step).

One lane per tensor: every BLAKE2b operation is elementwise on uint64 vectors. The message of
lane ``t`` arrives as ``NB`` 128-byte blocks of little-endian words (``tmpl[16 * NB, T]``) with
the step bytes zero; the kernel ORs the step in (``key.STEP_BYTE``) as it reads the words.
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


# BLAKE2b's message schedule: round r takes the message words in the order SIGMA[r % 10]. The
# host uploads it once (``launch.KeyTemplates``); the kernel reads a row per round.
SIGMA = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
    (14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3),
    (11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4),
    (7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8),
    (9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13),
    (2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9),
    (12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11),
    (13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10),
    (6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5),
    (10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0),
)


@triton.jit
def _words(tmpl, base, row, lanes, mask, T, s, first, W: tl.constexpr, K: tl.constexpr):
    """Message words ``row[0..7]`` of the block at word ``base`` (uint64 ``[8, BT]``), with the
    step's bytes ORed in (words ``W`` and ``W + 1`` from bit ``K`` of word ``W``) in block 0."""
    w = tl.load(row + tl.arange(0, 8))
    x = tl.load(tmpl + (base + w)[:, None] * T + lanes[None, :], mask=mask[None, :], other=0)
    x = x.to(tl.uint64, bitcast=True)
    zero = s * 0
    x = x | tl.where(first & (w == W)[:, None], s << K, zero)
    if K > 0:
        x = x | tl.where(first & (w == W + 1)[:, None], s >> (64 - K), zero)
    return x


@triton.jit
def _pick(x, i: tl.constexpr):
    return tl.sum(tl.where(tl.arange(0, 8)[:, None] == i, x, 0), axis=0)


@triton.jit
def _half(a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3, x):
    """G on ``(a_j, b_j, c_j, d_j)`` for j = 0..3 with message words ``x[2j], x[2j + 1]``."""
    a0, b0, c0, d0 = _g(a0, b0, c0, d0, _pick(x, 0), _pick(x, 1))
    a1, b1, c1, d1 = _g(a1, b1, c1, d1, _pick(x, 2), _pick(x, 3))
    a2, b2, c2, d2 = _g(a2, b2, c2, d2, _pick(x, 4), _pick(x, 5))
    a3, b3, c3, d3 = _g(a3, b3, c3, d3, _pick(x, 6), _pick(x, 7))
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@triton.jit
def _round(
    v0,
    v1,
    v2,
    v3,
    v4,
    v5,
    v6,
    v7,
    v8,
    v9,
    v10,
    v11,
    v12,
    v13,
    v14,
    v15,
    tmpl,
    base,
    row,
    lanes,
    mask,
    T,
    s,
    first,
    W: tl.constexpr,
    K: tl.constexpr,
):
    """One BLAKE2b round (message schedule ``row``): G down the columns, then the diagonals."""
    x = _words(tmpl, base, row, lanes, mask, T, s, first, W, K)
    v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _half(
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15, x
    )
    x = _words(tmpl, base, row + 8, lanes, mask, T, s, first, W, K)
    v0, v1, v2, v3, v5, v6, v7, v4, v10, v11, v8, v9, v15, v12, v13, v14 = _half(
        v0, v1, v2, v3, v5, v6, v7, v4, v10, v11, v8, v9, v15, v12, v13, v14, x
    )
    return v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15


@triton.jit
def _compress(
    h0,
    h1,
    h2,
    h3,
    h4,
    h5,
    h6,
    h7,
    tmpl,
    base,
    sigma,
    lanes,
    mask,
    T,
    s,
    first,
    t,
    last,
    W: tl.constexpr,
    K: tl.constexpr,
):
    v0, v1, v2, v3, v4, v5, v6, v7 = h0, h1, h2, h3, h4, h5, h6, h7
    v8 = tl.full(h0.shape, 0x6A09E667F3BCC908, tl.uint64)
    v9 = tl.full(h0.shape, 0xBB67AE8584CAA73B, tl.uint64)
    v10 = tl.full(h0.shape, 0x3C6EF372FE94F82B, tl.uint64)
    v11 = tl.full(h0.shape, 0xA54FF53A5F1D36F1, tl.uint64)
    v12 = tl.full(h0.shape, 0x510E527FADE682D1, tl.uint64) ^ t
    v13 = tl.full(h0.shape, 0x9B05688C2B3E6C1F, tl.uint64)
    final = tl.where(last, tl.full(h0.shape, 0xFFFFFFFFFFFFFFFF, tl.uint64), 0)  # the last block's flag
    v14 = tl.full(h0.shape, 0x1F83D9ABFB41BD6B, tl.uint64) ^ final
    v15 = tl.full(h0.shape, 0x5BE0CD19137E2179, tl.uint64)
    for r in range(12):
        v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15 = _round(
            v0,
            v1,
            v2,
            v3,
            v4,
            v5,
            v6,
            v7,
            v8,
            v9,
            v10,
            v11,
            v12,
            v13,
            v14,
            v15,
            tmpl,
            base,
            sigma + (r % 10) * 16,
            lanes,
            mask,
            T,
            s,
            first,
            W,
            K,
        )
    return (
        h0 ^ v0 ^ v8,
        h1 ^ v1 ^ v9,
        h2 ^ v2 ^ v10,
        h3 ^ v3 ^ v11,
        h4 ^ v4 ^ v12,
        h5 ^ v5 ^ v13,
        h6 ^ v6 ^ v14,
        h7 ^ v7 ^ v15,
    )


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
def step_data_kernel(
    tmpl,
    lens,
    sigma,
    step_ptr,
    keys,
    T,
    hyper,
    consts,
    S,
    NB,
    STEP_BYTE: tl.constexpr,
    KEYED_STEP: tl.constexpr,
    BT: tl.constexpr,
    BS: tl.constexpr,
):
    """For the step after ``*step_ptr``: ``keys[t]`` (int64) of every lane's message ``tmpl``
    (``lens[t]`` bytes, at most ``NB`` blocks; ``sigma``: ``SIGMA`` as int32), and (program 0)
    AdamW's FP32 constants ``consts[S, 8]`` from the double hyper-parameters ``hyper[S, 5]`` =
    (lr, beta1, beta2, eps, weight_decay). Blocks and rounds are runtime loops: one round is
    compiled, not 12 * NB."""
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
        # the step's 8 bytes start at STEP_BYTE (22: the top of word 2 and the bottom of word 3), block 0
        last = nblocks == b + 1
        t = tl.where(last, n, (b + 1) * 128).to(tl.uint64)
        c0, c1, c2, c3, c4, c5, c6, c7 = _compress(
            h0,
            h1,
            h2,
            h3,
            h4,
            h5,
            h6,
            h7,
            tmpl,
            b * 16,
            sigma,
            lanes,
            mask,
            T,
            s,
            b == 0,
            t,
            last,
            STEP_BYTE // 8,
            (STEP_BYTE % 8) * 8,
        )
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
