"""The fused AdamW + keyed rounding step, defined once for every backend.

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

Two flavours. *Shadow*: ``s`` is an FP32 master updated in place, ``w`` goes to a separate BF16
working tensor, moments are FP32. *Pure BF16* (arXiv 2502.20566): ``s = float(p)`` for a BF16
parameter ``p`` and ``p <- w`` in place; moments FP32, or BF16 written back as ``round(m)`` and
``round(v)`` with the keys ``"<param>#exp_avg"`` and ``"<param>#exp_avg_sq"`` (``moment_param``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdamWHyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # Adam's bias-correction step (1 for the first update)
    grad_scale: float = 1.0

    def scalars(self) -> dict[str, float]:
        """The constants every backend uses, computed in double and rounded to FP32 once by the
        kernel that reads them. The GPU derives the same doubles from a device step counter when
        a step is captured in a CUDA graph (``triton_keys.step_data_kernel``): only IEEE
        operations, and ``beta ** t`` by ``powi``."""
        return {
            "one_minus_beta1": 1.0 - self.beta1,
            "beta2": self.beta2,
            "one_minus_beta2": 1.0 - self.beta2,
            "decay": 1.0 - self.lr * self.weight_decay,
            "neg_step_size": -(self.lr / (1.0 - powi(self.beta1, self.step))),
            "rbc2": 1.0 / math.sqrt(1.0 - powi(self.beta2, self.step)),
            "eps": self.eps,
            "grad_scale": self.grad_scale,
        }


def powi(x: float, n: int) -> float:
    """``x ** n`` for an int ``n >= 0`` by square-and-multiply in double: a fixed sequence of
    correctly rounded multiplications that a GPU repeats bit for bit (``pow`` does not promise it)."""
    result = 1.0
    while n:
        if n & 1:
            result *= x
        x *= x
        n >>= 1
    return result


CONSTANTS = ("one_minus_beta1", "beta2", "one_minus_beta2", "decay", "neg_step_size", "rbc2", "eps")


def moment_param(param: str, moment: str) -> str:
    """The name whose key rounds a BF16 moment (``exp_avg`` or ``exp_avg_sq``) of ``param``."""
    return f"{param}#{moment}"


@functools.lru_cache(maxsize=4096)
def constants(h: AdamWHyper) -> tuple[float, ...]:
    """The 8 constants a kernel reads for one piece (``CONSTANTS`` and a pad)."""
    c = h.scalars()
    return tuple(c[k] for k in CONSTANTS) + (0.0,)


def distinct_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct entries of ``values`` (rows, for a 2-D array), sorted, and each entry's index
    among them: how a step finds its few AdamW settings. One comparison when every entry is the
    same (the usual step)."""
    if len(values) and (values == values[0]).all():
        return values[:1], np.zeros(len(values), dtype=np.int64)
    uniq, index = np.unique(values, axis=0, return_inverse=True)
    return uniq, index.reshape(-1)
