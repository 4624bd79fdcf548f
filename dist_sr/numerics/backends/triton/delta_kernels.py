"""Triton kernels of the grid-step delta codec (``numerics.delta``): the dense passes over the
tensor, on the device where the weights live. The sparse parts (LEB128 gaps and escapes, whose
size is the number of changes) stay in torch ops on the same device (``delta_launch``).

Codes are read as 16-bit integers and compared modulo 2^16, exactly as the reference: the step of
an element is ``d = (new - old) mod 2^16``; it changed if ``d != 0``, moved down if ``d >= 2^15``,
and is an escape if ``d`` is neither 1 nor 2^16 - 1.

Encode is two passes over ``BLOCK`` elements per program: ``count`` writes the bitmap bytes (bit
``j`` of byte ``i`` = element ``8 i + j``) and the block's numbers of changes and escapes; the host
turns those into each block's first position in the sign stream and the escape list (a cumulative
sum); ``scatter`` then sets each change's sign bit at its position (an ``atomic_or`` into int32
words, whose little-endian bytes are the sign stream) and writes the escapes' indices and steps,
and, for the gaps layout, the changed indices. Decode of the bitmap layout is the same pair:
``popcount`` per block, then ``step`` adds each change's +1 or -1 in place.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _steps(old_ptr, new_ptr, offs, m):
    a = tl.load(old_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFFFF
    b = tl.load(new_ptr + offs, mask=m, other=0).to(tl.int32) & 0xFFFF
    d = (b - a) & 0xFFFF
    changed = (d != 0) & m
    escape = changed & (d != 1) & (d != 0xFFFF)
    return d, changed, escape


@triton.jit
def count_kernel(old_ptr, new_ptr, bitmap_ptr, counts_ptr, n, nbytes, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    d, changed, escape = _steps(old_ptr, new_ptr, offs, offs < n)
    bits = tl.reshape(changed.to(tl.int32), (BLOCK // 8, 8))
    byte = tl.sum(bits << tl.arange(0, 8)[None, :], axis=1)
    boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    tl.store(bitmap_ptr + boffs, byte.to(tl.uint8), mask=boffs < nbytes)
    tl.store(counts_ptr + 2 * pid, tl.sum(changed.to(tl.int64), axis=0))
    tl.store(counts_ptr + 2 * pid + 1, tl.sum(escape.to(tl.int64), axis=0))


@triton.jit
def scatter_kernel(
    old_ptr,
    new_ptr,
    starts_ptr,
    sign_words_ptr,
    idx_ptr,
    esc_idx_ptr,
    esc_step_ptr,
    n,
    BLOCK: tl.constexpr,
    WRITE_IDX: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    d, changed, escape = _steps(old_ptr, new_ptr, offs, offs < n)
    c = changed.to(tl.int64)
    pos = tl.load(starts_ptr + 2 * pid) + tl.cumsum(c, axis=0) - c  # this change's place in the stream
    down = changed & (d >= 0x8000)
    tl.atomic_or(sign_words_ptr + (pos >> 5), (1 << (pos & 31)).to(tl.int32), mask=down)
    if WRITE_IDX:
        tl.store(idx_ptr + pos, offs, mask=changed)
    e = escape.to(tl.int64)
    epos = tl.load(starts_ptr + 2 * pid + 1) + tl.cumsum(e, axis=0) - e
    tl.store(esc_idx_ptr + epos, offs, mask=escape)
    tl.store(esc_step_ptr + epos, d - ((d >> 15) << 16), mask=escape)


@triton.jit
def _bits(bitmap_ptr, pid, nbytes, BLOCK: tl.constexpr):
    boffs = pid * (BLOCK // 8) + tl.arange(0, BLOCK // 8)
    byte = tl.load(bitmap_ptr + boffs, mask=boffs < nbytes, other=0).to(tl.int32)
    return tl.reshape((byte[:, None] >> tl.arange(0, 8)[None, :]) & 1, (BLOCK,))


@triton.jit
def popcount_kernel(bitmap_ptr, counts_ptr, nbytes, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    tl.store(counts_ptr + pid, tl.sum(_bits(bitmap_ptr, pid, nbytes, BLOCK).to(tl.int64), axis=0))


@triton.jit
def step_kernel(held_ptr, bitmap_ptr, signs_ptr, starts_ptr, n, nbytes, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    c = _bits(bitmap_ptr, pid, nbytes, BLOCK).to(tl.int64)
    changed = (c != 0) & m
    pos = tl.load(starts_ptr + pid) + tl.cumsum(c, axis=0) - c
    sign = (tl.load(signs_ptr + (pos >> 3), mask=changed, other=0).to(tl.int32) >> (pos & 7).to(tl.int32)) & 1
    code = tl.load(held_ptr + offs, mask=changed, other=0).to(tl.int32)
    code = (code + 1 - 2 * sign) & 0xFFFF
    tl.store(held_ptr + offs, (code - ((code >> 15) << 16)).to(tl.int16), mask=changed)
