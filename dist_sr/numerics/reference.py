"""Pure-torch reference of the keyed rounding and of the fused AdamW step: any device, slow,
obviously correct; every other backend is tested against it bit for bit.

torch has no unsigned 64-bit arithmetic that works everywhere, so the SplitMix64 mix runs on
int64 with wrap-around multiplication and masked (logical) right shifts.
"""

from __future__ import annotations

import torch

from .adamw import AdamWHyper
from .key import GAMMA, MIX1, MIX2, signed64

_CHUNK = 1 << 20  # bounds the int64 temporaries to a few MiB per call
_GAMMA, _MIX1, _MIX2 = signed64(GAMMA), signed64(MIX1), signed64(MIX2)


def logical_shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 values read as uint64."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def random_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """16 random bits (int64 in [0, 65536)) for global element indices ``index`` (int64)."""
    z = signed64(key) + ((index >> 2) + 1) * _GAMMA
    z = (z ^ logical_shr(z, 30)) * _MIX1
    z = (z ^ logical_shr(z, 27)) * _MIX2
    z = z ^ logical_shr(z, 31)
    return (z >> ((index & 3) * 16)) & 0xFFFF


def round_into(
    x: torch.Tensor, out: torch.Tensor, key: int | None, offset: int, rows: tuple[int, int] | None = None
) -> None:
    """Write the rounding of flat FP32 ``x`` into flat BF16 ``out`` (both contiguous, same numel).

    ``key=None`` is round-to-nearest-even; otherwise the element at position ``j`` uses the random
    bits of global index ``offset + j``, or with ``rows=(row_len, row_stride)`` of
    ``offset + (j // row_len) * row_stride + j % row_len``.
    """
    out_bits = out.view(torch.int16)
    x_bits = x.view(torch.int32)
    for start in range(0, x.numel(), _CHUNK):
        xb = x_bits[start : start + _CHUNK].to(torch.int64) & 0xFFFFFFFF
        if key is None:
            r = 0x7FFF + ((xb >> 16) & 1)
        else:
            idx = torch.arange(start, start + xb.numel(), device=x.device, dtype=torch.int64)
            if rows is not None:
                idx = (idx // rows[0]) * rows[1] + idx % rows[0]
            idx = idx + offset
            r = random_bits(key, idx)
        y = ((xb + r) >> 16) & 0xFFFF
        is_nan = ((xb & 0x7F800000) == 0x7F800000) & ((xb & 0x007FFFFF) != 0)
        y = torch.where(is_nan, torch.full_like(y, 0x7FC0), y)
        y = y - ((y >> 15) & 1) * 0x10000  # to the int16 range, so the cast is exact
        out_bits[start : start + xb.numel()] = y.to(torch.int16)


def adamw_step(
    p,
    exp_avg,
    exp_avg_sq,
    grad,
    out,
    key: int | None,
    offset: int,
    h: AdamWHyper,
    moment_keys: tuple[int, int] | None = None,
    rows: tuple[int, int] | None = None,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """Pure-torch fused step (any device, either flavour); updates in place, rounds into ``out``
    (or into ``p`` when ``out`` is None). ``moment_keys``: keys of BF16 moments (None: nearest);
    ``grad_scale``: an FP32 tensor multiplying the gradient (overrides ``h.grad_scale``)."""
    c = h.scalars()
    f32 = lambda x: torch.tensor(x, dtype=torch.float32, device=p.device)  # noqa: E731  (FP32 constants)
    g = grad.reshape(-1).to(torch.float32)
    if grad_scale is not None:
        g = g * grad_scale.to(device=p.device, dtype=torch.float32).reshape(())
    elif c["grad_scale"] != 1.0:
        g = g * f32(c["grad_scale"])
    m0, v0 = exp_avg.reshape(-1).to(torch.float32), exp_avg_sq.reshape(-1).to(torch.float32)
    m = m0 + f32(c["one_minus_beta1"]) * (g - m0)
    v = v0 * f32(c["beta2"]) + (f32(c["one_minus_beta2"]) * g) * g
    s = p.reshape(-1).to(torch.float32) * f32(c["decay"])
    # torch's CPU sqrt is not correctly rounded; sqrt in double rounded once to FP32 is (53 >= 2*24+2)
    sqrt_v = torch.sqrt(v.double()).float()
    s = s + (f32(c["neg_step_size"]) * m) / (sqrt_v * f32(c["rbc2"]) + f32(c["eps"]))
    for moment, new, mkey in ((exp_avg, m, 0), (exp_avg_sq, v, 1)):
        if moment.dtype == torch.float32:
            moment.view(-1).copy_(new)
        else:
            round_into(new, moment.view(-1), None if moment_keys is None else moment_keys[mkey], offset, rows)
    if out is None:
        round_into(s, p.view(-1), key, offset, rows)
    else:
        p.view(-1).copy_(s)
        round_into(s, out.view(-1), key, offset, rows)
