"""Fused AdamW + keyed rounding: one pass over weights, moments and gradient, BF16 weights out.

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
from typing import Sequence

import numpy as np
import torch

from . import cpu_kernel, reference
from .key import check_mode, stream_keys
from .rounding import BACKENDS, choose_backend


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


@dataclass(frozen=True)
class AdamWPiece:
    """One parameter piece of an ``AdamWPlan``.

    ``p``: the FP32 shadow (with ``out``, the BF16 working tensor) or the BF16 parameter itself
    (``out=None``, updated in place). ``exp_avg``/``exp_avg_sq``: FP32, or BF16 for a BF16
    parameter. All contiguous with one numel. ``offset``/``rows``: where the piece lives in the
    full parameter, as in ``RoundingJob``.
    """

    param: str
    p: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    out: torch.Tensor | None = None
    offset: int = 0
    rows: tuple[int, int] | None = None

    @property
    def pure(self) -> bool:
        return self.out is None


def adamw_reference_(p, exp_avg, exp_avg_sq, grad, out, key: int | None, offset: int, h: AdamWHyper,
                     moment_keys: tuple[int, int] | None = None, rows: tuple[int, int] | None = None,
                     grad_scale: torch.Tensor | None = None) -> None:
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
            reference.round_into(new, moment.view(-1), None if moment_keys is None else moment_keys[mkey], offset, rows)
    if out is None:
        reference.round_into(s, p.view(-1), key, offset, rows)
    else:
        p.view(-1).copy_(s)
        reference.round_into(s, out.view(-1), key, offset, rows)


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
    """One fused AdamW step on an FP32 shadow piece and the keyed rounding of the result into ``out``.

    ``shadow``, ``exp_avg``, ``exp_avg_sq``: contiguous FP32, updated in place; ``grad``: BF16 or
    FP32 of the same numel; ``out``: contiguous BF16. ``seed``/``step``/``param``/``offset``/``mode``
    are the rounding key, as in ``stochastic_round``.
    """
    for name, t in (("shadow", shadow), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise TypeError(f"fused AdamW: {name} of {param!r} must be contiguous float32, got {t.dtype}")
    if out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() != shadow.numel():
        raise TypeError(f"fused AdamW: out of {param!r} must be contiguous bfloat16 with the shadow's numel")
    plan = AdamWPlan([AdamWPiece(param, shadow, exp_avg, exp_avg_sq, out, offset)], backend=backend)
    plan.step_([grad], [hyper], seed=seed, step=step, mode=mode)


class AdamWPlan:
    """Fused AdamW steps over a fixed list of pieces (an optimizer's parameters), one kernel call
    per backend and step: one C++ call for CPU tensors, one Triton launch for CUDA tensors.

    Everything that depends only on the pieces is checked and prepared here, once; a step does
    O(pieces) host work (its keys, gradient addresses and the constants of its few distinct
    hyper-parameter sets) and never reads a device value back.
    """

    def __init__(self, pieces: Sequence[AdamWPiece], *, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        for piece in pieces:
            _validate(piece)
        self.pieces = list(pieces)
        self.names = [pc.param for pc in self.pieces]
        self._moment_names = [[moment_param(pc.param, m) for pc in self.pieces] for m in ("exp_avg", "exp_avg_sq")]
        self._bf16_moments = [i for i, pc in enumerate(self.pieces) if pc.exp_avg.dtype == torch.bfloat16]
        self._flat = [(pc.p.view(-1), pc.exp_avg.view(-1), pc.exp_avg_sq.view(-1),
                       None if pc.out is None else pc.out.view(-1)) for pc in self.pieces]
        self._backend = []
        for pc in self.pieces:
            b = choose_backend(backend, pc.param, pc.p.device)
            self._backend.append("reference" if pc.rows is not None else b)  # strided shards: the plain path
        self._launches: dict = {}  # the Triton launches of the piece subsets stepped so far
        self._numels = [pc.p.numel() for pc in self.pieces]
        self._devices = [pc.p.device for pc in self.pieces]
        self._kind = [(pc.pure, pc.exp_avg.dtype == torch.bfloat16) for pc in self.pieces]
        self._static_groups: dict[tuple[bool, bool], list[int]] = {}
        for i, kind in enumerate(self._kind):
            self._static_groups.setdefault(kind, []).append(i)

    def keys(self, seed: int, step: int, mode: str) -> np.ndarray | None:
        """int64 ``[3, T]``: every piece's key, then its moments' keys (only where they are BF16)."""
        if mode == "nearest":
            return None
        keys = np.zeros((3, len(self.pieces)), dtype=np.int64)
        keys[0] = stream_keys(self.names, seed=seed, step=step, mode=mode)
        if self._bf16_moments:
            for row in (1, 2):
                keys[row, self._bf16_moments] = stream_keys([self._moment_names[row - 1][i] for i in self._bf16_moments],
                                                            seed=seed, step=step, mode=mode)
        return keys

    def step_(self, grads: Sequence[torch.Tensor | None], hypers: Sequence[AdamWHyper],
              slots: Sequence[int] | None = None, *, seed: int, step: int, mode: str = "stochastic",
              grad_scale: torch.Tensor | None = None, device_step=None) -> None:
        """One step. ``grads[i]``: piece ``i``'s gradient (BF16 or FP32, its numel; None skips
        the piece). ``hypers[slots[i]]`` is piece ``i``'s AdamW setting (``slots`` defaults to
        one hyper per piece). ``grad_scale``: a one-element FP32 tensor on the pieces' device that
        multiplies every gradient (read by the kernel); otherwise each hyper's ``grad_scale``.
        The key's ``step`` is shared by all pieces.

        ``device_step`` (a ``triton_launch.DeviceStep``, CUDA only): the key's step and Adam's
        bias-correction step are both ``counter + 1``, derived on the device, so the step can be
        captured in a CUDA graph and replayed (``step`` and the hypers' ``step`` are then unused)."""
        check_mode(mode)
        if len(grads) != len(self.pieces):
            raise ValueError(f"fused AdamW: {len(grads)} gradients for {len(self.pieces)} pieces")
        if slots is None:
            slots = range(len(self.pieces))
        if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32):
            raise TypeError("fused AdamW: grad_scale must be a one-element float32 tensor")
        live = [i for i, g in enumerate(grads) if g is not None]
        numels, devices = self._numels, self._devices
        for i in live:
            g = grads[i]
            if g.dtype not in _GRAD_DTYPES or g.numel() != numels[i] or g.device != devices[i]:
                raise TypeError(f"fused AdamW: grad of {self.names[i]!r} must be float32 or bfloat16 with the "
                                f"parameter's numel on {devices[i]}, got {g.dtype} x {g.numel()} on {g.device}")
        by_backend: dict[str, list[int]] = {}
        for i in live:
            by_backend.setdefault(self._backend[i], []).append(i)
        if device_step is not None:
            if set(by_backend) - {"triton"}:
                raise ValueError("fused AdamW: steps derived on the device (capturable) need CUDA tensors and the "
                                 f"Triton backend; these pieces use {sorted(set(by_backend) - {'triton'})}")
            _step_triton(self, live, grads, hypers, slots, None, grad_scale, device_step)
            return
        keys = self.keys(seed, step, mode)
        for b, idx in by_backend.items():
            _STEPPERS[b](self, idx, grads, hypers, slots, keys, grad_scale)


def _validate(pc: AdamWPiece) -> None:
    n = pc.p.numel()
    pure = pc.out is None
    if pure and pc.p.dtype != torch.bfloat16:
        raise TypeError(f"fused AdamW: {pc.param!r} has no BF16 out, so its parameter must be bfloat16 (got {pc.p.dtype})")
    if not pure and pc.p.dtype != torch.float32:
        raise TypeError(f"fused AdamW: shadow of {pc.param!r} must be float32, got {pc.p.dtype}")
    if not pure and (pc.out.dtype != torch.bfloat16 or pc.out.numel() != n):
        raise TypeError(f"fused AdamW: out of {pc.param!r} must be bfloat16 with the shadow's numel")
    moment_dtypes = (torch.float32, torch.bfloat16) if pure else (torch.float32,)
    for name, t in (("exp_avg", pc.exp_avg), ("exp_avg_sq", pc.exp_avg_sq)):
        if t.dtype not in moment_dtypes or t.numel() != n:
            raise TypeError(f"fused AdamW: {name} of {pc.param!r} must be {' or '.join(map(str, moment_dtypes))} "
                            f"with the parameter's numel, got {t.dtype} x {t.numel()}")
    if pc.exp_avg.dtype != pc.exp_avg_sq.dtype:
        raise TypeError(f"fused AdamW: the moments of {pc.param!r} must share a dtype")
    for name, t in (("parameter", pc.p), ("exp_avg", pc.exp_avg), ("exp_avg_sq", pc.exp_avg_sq), ("out", pc.out)):
        if t is not None and (not t.is_contiguous() or t.device != pc.p.device):
            raise TypeError(f"fused AdamW: {name} of {pc.param!r} must be contiguous and on {pc.p.device}")
    if not isinstance(pc.offset, int) or isinstance(pc.offset, bool) or pc.offset < 0:
        raise ValueError(f"fused AdamW: offset of {pc.param!r} must be a non-negative int, got {pc.offset!r}")


@functools.lru_cache(maxsize=4096)
def _constants(h: AdamWHyper) -> tuple[float, ...]:
    """The 8 constants a kernel reads for one piece (``CONSTANTS`` and a pad)."""
    c = h.scalars()
    return tuple(c[k] for k in CONSTANTS) + (0.0,)


_GRAD_DTYPES = (torch.float32, torch.bfloat16)


def _groups(plan: AdamWPlan, idx, hypers, slots, grad_scale) -> dict[tuple, list[int]]:
    """Pieces by (pure, BF16 moments, gradient scale): one kernel call per group (normally one)."""
    if len(idx) == len(plan.pieces):  # every piece steps: the groups fixed at construction, when one scale applies
        scales = {None} if grad_scale is not None else {h.grad_scale for h in hypers}
        if len(scales) == 1:
            scale = scales.pop()
            return {(*kind, scale): sel for kind, sel in plan._static_groups.items()}
    groups: dict[tuple, list[int]] = {}
    for i in idx:
        pc = plan.pieces[i]
        scale = None if grad_scale is not None else hypers[slots[i]].grad_scale
        groups.setdefault((pc.pure, pc.exp_avg.dtype == torch.bfloat16, scale), []).append(i)
    return groups


def _step_reference(plan, idx, grads, hypers, slots, keys, grad_scale) -> None:
    for i in idx:
        pc = plan.pieces[i]
        k = None if keys is None else [int(x) % (1 << 64) for x in keys[:, i]]
        adamw_reference_(pc.p, pc.exp_avg, pc.exp_avg_sq, grads[i], pc.out, None if k is None else k[0], pc.offset,
                         hypers[slots[i]], None if k is None else (k[1], k[2]), pc.rows, grad_scale)


def _step_cpu(plan, idx, grads, hypers, slots, keys, grad_scale) -> None:
    kernel = cpu_kernel.load()
    for (pure, _, scale), sel in _groups(plan, idx, hypers, slots, grad_scale).items():
        flat = [plan._flat[i] for i in sel]
        consts = [v for i in sel for v in _constants(hypers[slots[i]])]
        k = np.zeros(3 * len(sel), dtype=np.int64) if keys is None else keys[:, sel].T.reshape(-1)
        kernel.adamw_many([f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat],
                          [grads[i].reshape(-1) for i in sel], [] if pure else [f[3] for f in flat], keys is not None,
                          k.tolist(), [plan.pieces[i].offset for i in sel], consts,
                          float(grad_scale) if scale is None else scale)


def _step_triton(plan, idx, grads, hypers, slots, keys, grad_scale, device_step=None) -> None:
    from . import triton_launch

    for (pure, moment_bf16, scale), sel in _groups(plan, idx, hypers, slots, grad_scale).items():
        launch = plan._launches.get((pure, tuple(sel)))
        if launch is None:
            flat = [plan._flat[i] for i in sel]
            names = [[plan.names[i] for i in sel]] + [[row[i] for i in sel] for row in plan._moment_names]
            launch = triton_launch.AdamWLaunch([f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat],
                                               None if pure else [f[3] for f in flat],
                                               [plan.pieces[i].offset for i in sel], pure=pure, moment_bf16=moment_bf16,
                                               names=names)
            plan._launches[(pure, tuple(sel))] = launch
        used = list(dict.fromkeys(slots[i] for i in sel))
        row = {s: k for k, s in enumerate(used)}
        scale_t = grad_scale.reshape(1) if scale is None else _scale_tensor(scale, plan.pieces[sel[0]].p.device)
        if device_step is not None:
            hyper = np.asarray([[h.lr, h.beta1, h.beta2, h.eps, h.weight_decay] for h in (hypers[s] for s in used)],
                               dtype=np.float64)
            launch([grads[i] for i in sel], None, [row[slots[i]] for i in sel], None, scale_t,
                   device_step=device_step, hyper=hyper)
            continue
        launch([grads[i] for i in sel], None if keys is None else keys[:, sel], [row[slots[i]] for i in sel],
               np.asarray([_constants(hypers[s]) for s in used], dtype=np.float32), scale_t)


_STEPPERS = {"reference": _step_reference, "cpu": _step_cpu, "triton": _step_triton}
_SCALES: dict[tuple[float, torch.device], torch.Tensor] = {}


def _scale_tensor(value: float, device: torch.device) -> torch.Tensor:
    """A cached one-element FP32 device tensor (made once per value and device, so no per-step upload)."""
    t = _SCALES.get((value, device))
    if t is None:
        t = torch.full((1,), value, dtype=torch.float32, device=device)
        _SCALES[(value, device)] = t
    return t
