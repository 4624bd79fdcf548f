"""Fused AdamW + keyed rounding: one pass over shadow, moments and gradient, BF16 weights out.

The update is a fixed sequence of IEEE-rounded FP32 operations (no fused multiply-add), so the
pure-torch reference, the C++ CPU kernel and the Triton kernel give the same bits:

    g = grad * grad_scale                               (grad may be BF16 or FP32)
    m = m + (1 - beta1) * (g - m)
    v = v * beta2 + ((1 - beta2) * g) * g
    s = s * (1 - lr * weight_decay)
    s = s + (-lr / (1 - beta1^t) * m) / (sqrt(v) * (1 / sqrt(1 - beta2^t)) + eps)
    w = round(s)                                        (the rounding key of ``param``)

This is torch.optim.AdamW's arithmetic, written without FMA; the host computes every scalar in
double and rounds it to FP32 once (``AdamWHyper.scalars``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import cpu_kernel, reference
from .key import check_mode, stream_key
from .rounding import BACKENDS, _as_int64, _choose


@dataclass(frozen=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int            # Adam's bias-correction step (1 for the first update)
    grad_scale: float = 1.0

    def scalars(self) -> dict[str, float]:
        """The FP32 constants every backend uses, computed once on the host in double."""
        return {
            "one_minus_beta1": 1.0 - self.beta1,
            "beta2": self.beta2,
            "one_minus_beta2": 1.0 - self.beta2,
            "decay": 1.0 - self.lr * self.weight_decay,
            "neg_step_size": -(self.lr / (1.0 - self.beta1 ** float(self.step))),
            "rbc2": 1.0 / math.sqrt(1.0 - self.beta2 ** float(self.step)),
            "eps": self.eps,
            "grad_scale": self.grad_scale,
        }


def adamw_reference_(shadow, exp_avg, exp_avg_sq, grad, out, key: int | None, offset: int, h: AdamWHyper) -> None:
    """Pure-torch fused step (any device): updates shadow/moments in place, rounds into ``out``."""
    c = h.scalars()
    f32 = lambda x: torch.tensor(x, dtype=torch.float32, device=shadow.device)  # noqa: E731  (FP32 constants)
    g = grad.to(torch.float32)
    if c["grad_scale"] != 1.0:
        g = g * f32(c["grad_scale"])
    m = exp_avg + f32(c["one_minus_beta1"]) * (g - exp_avg)
    v = exp_avg_sq * f32(c["beta2"]) + (f32(c["one_minus_beta2"]) * g) * g
    s = shadow * f32(c["decay"])
    # torch's CPU sqrt is not correctly rounded; sqrt in double rounded once to FP32 is (53 >= 2*24+2)
    sqrt_v = torch.sqrt(v.double()).float()
    s = s + (f32(c["neg_step_size"]) * m) / (sqrt_v * f32(c["rbc2"]) + f32(c["eps"]))
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    shadow.copy_(s)
    reference.round_into(shadow.view(-1), out.view(-1), key, offset)


def adamw_step_(
    shadow: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    out: torch.Tensor,
    *,
    hyper: AdamWHyper,
    seed: int,
    step: int,
    param: str,
    offset: int = 0,
    mode: str = "stochastic",
    backend: str = "auto",
) -> None:
    """One fused AdamW step on a parameter piece and the keyed rounding of the result into ``out``.

    ``shadow``, ``exp_avg``, ``exp_avg_sq``: contiguous FP32, updated in place; ``grad``: BF16 or
    FP32 of the same numel; ``out``: contiguous BF16. ``seed``/``step``/``param``/``offset``/``mode``
    are the rounding key, as in ``stochastic_round``.
    """
    check_mode(mode)
    for name, t in (("shadow", shadow), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise TypeError(f"fused AdamW: {name} of {param!r} must be contiguous float32, got {t.dtype}")
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() != shadow.numel():
        raise TypeError(f"fused AdamW: out of {param!r} must be contiguous bfloat16 with the shadow's numel")
    if grad.dtype not in (torch.float32, torch.bfloat16) or grad.numel() != shadow.numel():
        raise TypeError(f"fused AdamW: grad of {param!r} must be float32 or bfloat16 with the shadow's numel")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    key = stream_key(seed=seed, step=step, param=param, mode=mode) if mode != "nearest" else None
    grad = grad.contiguous()
    chosen = _choose(backend, param, shadow.device)
    if chosen == "reference":
        adamw_reference_(shadow, exp_avg, exp_avg_sq, grad, out, key, offset, hyper)
    elif chosen == "triton":
        from . import triton_kernels

        triton_kernels.adamw_sr_(shadow, exp_avg, exp_avg_sq, grad, out, key, offset, hyper)
    else:
        c = hyper.scalars()
        cpu_kernel.load().adamw_sr(
            shadow, exp_avg, exp_avg_sq, grad, out, key is not None, _as_int64(key) if key is not None else 0,
            offset, c["one_minus_beta1"], c["beta2"], c["one_minus_beta2"], c["decay"], c["neg_step_size"],
            c["rbc2"], c["eps"], c["grad_scale"])
