"""Fused AdamW + keyed rounding over many parameter pieces at once (``AdamWPlan``), dispatched
to a backend; the arithmetic itself is defined in ``numerics.adamw``."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_
from types import EllipsisType
from typing import Sequence, cast

import numpy as np
import torch

from . import backends
from .adamw import AdamWHyper, moment_param  # noqa: F401  (part of this API)
from .key import check_mode, stream_keys

_GRAD_DTYPES = (torch.float32, torch.bfloat16)
_GRAD_DTYPE_SET = frozenset(_GRAD_DTYPES)
_DTYPE = attrgetter("dtype")


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
        backends.check_name(backend)
        for piece in pieces:
            _validate(piece)
        self.pieces = list(pieces)
        self.names = [pc.param for pc in self.pieces]
        self.moment_names = [[moment_param(pc.param, m) for pc in self.pieces] for m in ("exp_avg", "exp_avg_sq")]
        self._bf16_moments = [i for i, pc in enumerate(self.pieces) if pc.exp_avg.dtype == torch.bfloat16]
        self.flat = [
            (pc.p.view(-1), pc.exp_avg.view(-1), pc.exp_avg_sq.view(-1), None if pc.out is None else pc.out.view(-1))
            for pc in self.pieces
        ]
        self._backend = [
            backends.choose("reference" if pc.rows is not None else backend, pc.param, pc.p.device).name
            for pc in self.pieces
        ]  # strided shards (rare: FSDP2 on a non-leading dim): the plain path
        self.launches: dict = {}  # the backends' launch state for the piece subsets stepped so far
        self.grad_dtypes: set | None = None  # set by step_: its gradients' dtypes when every piece steps
        self._numels = [pc.p.numel() for pc in self.pieces]
        self._devices = [pc.p.device for pc in self.pieces]
        self._device_index = [pc.p.get_device() for pc in self.pieces]  # what Tensor.get_device gives
        self._all_by_backend: dict[str, list[int]] = {}  # a step where every piece steps
        for i, b in enumerate(self._backend):
            self._all_by_backend.setdefault(b, []).append(i)
        self.kind = [(pc.pure, pc.exp_avg.dtype == torch.bfloat16) for pc in self.pieces]
        self.static_groups: dict[tuple[bool, bool], list[int]] = {}
        for i, kind in enumerate(self.kind):
            self.static_groups.setdefault(kind, []).append(i)

    def keys(self, seed: int, step: int, mode: str) -> np.ndarray | None:
        """int64 ``[3, T]``: every piece's key, then its moments' keys (only where they are BF16)."""
        if mode == "nearest":
            return None
        keys = np.zeros((3, len(self.pieces)), dtype=np.int64)
        keys[0] = stream_keys(self.names, seed=seed, step=step, mode=mode)
        if self._bf16_moments:
            for row in (1, 2):
                keys[row, self._bf16_moments] = stream_keys(
                    [self.moment_names[row - 1][i] for i in self._bf16_moments], seed=seed, step=step, mode=mode
                )
        return keys

    def step_(
        self,
        grads: Sequence[torch.Tensor | None],
        hypers: Sequence[AdamWHyper],
        slots: Sequence[int] | np.ndarray | None = None,
        *,
        seed: int,
        step: int,
        mode: str = "stochastic",
        grad_scale: torch.Tensor | None = None,
        device_step=None,
        live: np.ndarray | Sequence[int] | None | EllipsisType = ...,
    ) -> None:
        """One step. ``grads[i]``: piece ``i``'s gradient (BF16 or FP32, its numel; None skips
        the piece). ``hypers[slots[i]]`` is piece ``i``'s AdamW setting (``slots`` defaults to
        one hyper per piece). ``grad_scale``: a one-element FP32 tensor on the pieces' device that
        multiplies every gradient (read by the kernel); otherwise each hyper's ``grad_scale``.
        The key's ``step`` is shared by all pieces. ``live``: the indices of the pieces with a
        gradient, None for all (found here when not given).

        ``device_step`` (a ``backends.base.DeviceStep``, CUDA only): the key's step and Adam's
        bias-correction step are both ``counter + 1``, derived on the device, so the step can be
        captured in a CUDA graph and replayed (``step`` and the hypers' ``step`` are then unused).

        The host work is a few passes of C-level calls over the gradients (their dtype, numel,
        device, address): no Python loop per piece on the usual step, where every piece steps."""
        check_mode(mode)
        if len(grads) != len(self.pieces):
            raise ValueError(f"fused AdamW: {len(grads)} gradients for {len(self.pieces)} pieces")
        if slots is None:
            slots = np.arange(len(self.pieces))
        if grad_scale is not None and (grad_scale.numel() != 1 or grad_scale.dtype != torch.float32):
            raise TypeError("fused AdamW: grad_scale must be a one-element float32 tensor")
        if live is ...:
            live = live_pieces(grads)
        self.grad_dtypes = None  # the dtypes of the step's gradients, when every piece steps
        if live is None:
            grads = self._check_grads(cast(Sequence[torch.Tensor], grads))
            by_backend = self._all_by_backend
        else:
            live = [int(i) for i in live]
            checked = self._check_grads([cast(torch.Tensor, grads[i]) for i in live], live)
            grads = list(grads)
            for i, g in zip(live, checked):
                grads[i] = g
            by_backend = {}
            for i in live:
                by_backend.setdefault(self._backend[i], []).append(i)
        if device_step is not None:
            odd = sorted(b for b in by_backend if not backends.get(b).device_keys)
            if odd:
                raise ValueError(
                    "fused AdamW: steps derived on the device (capturable) need CUDA tensors and a backend "
                    f"that derives keys there (Triton); these pieces use {odd}"
                )
            for b, idx in by_backend.items():
                backends.get(b).adamw_step(self, idx, grads, hypers, slots, None, grad_scale, device_step)
            return
        keys = None
        for b, idx in by_backend.items():
            backend = backends.get(b)
            if mode != "nearest" and backend.device_keys:  # hashed on the device: no per-name host work
                backend.adamw_step(self, idx, grads, hypers, slots, backends.KeyStep(seed, step, mode), grad_scale)
                continue
            if keys is None:
                keys = self.keys(seed, step, mode)
            backend.adamw_step(self, idx, grads, hypers, slots, keys, grad_scale)

    def _check_grads(self, grads: Sequence[torch.Tensor], idx: Sequence[int] | None = None) -> Sequence[torch.Tensor]:
        """``grads`` (those of pieces ``idx``, None for all), each a float32 or bfloat16 tensor of
        its piece's numel on its piece's device, as contiguous tensors (a non-contiguous one is
        copied). One C-level pass per property; a per-piece loop only to name an offender. The
        backends rely on this check."""
        numels, devices = self._numels, self._device_index
        if idx is not None:
            numels, devices = [numels[i] for i in idx], [devices[i] for i in idx]
        dtypes = set(map(_DTYPE, grads))
        if idx is None:
            self.grad_dtypes = dtypes  # the backends' launch grouping reads it (one pass fewer)
        if not (
            dtypes <= _GRAD_DTYPE_SET
            and list(map(torch.Tensor.numel, grads)) == numels
            and list(map(torch.Tensor.get_device, grads)) == devices
        ):
            for k, g in enumerate(grads):
                i = k if idx is None else idx[k]
                if g.dtype not in _GRAD_DTYPES or g.numel() != self._numels[i] or g.device != self._devices[i]:
                    raise TypeError(
                        f"fused AdamW: grad of {self.names[i]!r} must be float32 or bfloat16 with the "
                        f"parameter's numel on {self._devices[i]}, got {g.dtype} x {g.numel()} on {g.device}"
                    )
        if all(map(torch.Tensor.is_contiguous, grads)):
            return grads
        return [g if g.is_contiguous() else g.contiguous() for g in grads]

    def groups(self, idx, hypers, slots, grad_scale) -> dict[tuple, list[int]]:
        """Pieces ``idx`` by (pure, BF16 moments, gradient scale or None for ``grad_scale``): one
        kernel call per group, normally one."""
        if len(idx) == len(self.pieces):  # every piece steps: the groups fixed at construction, when one scale applies
            scales = {None} if grad_scale is not None else {h.grad_scale for h in hypers}
            if len(scales) == 1:
                scale = scales.pop()
                return {(*kind, scale): sel for kind, sel in self.static_groups.items()}
        groups: dict[tuple, list[int]] = {}
        for i in idx:
            pc = self.pieces[i]
            scale = None if grad_scale is not None else hypers[slots[i]].grad_scale
            groups.setdefault((pc.pure, pc.exp_avg.dtype == torch.bfloat16, scale), []).append(i)
        return groups


def live_pieces(grads: Sequence[torch.Tensor | None]) -> np.ndarray | None:
    """The indices of the pieces with a gradient, or None when every piece has one (one C-level
    pass on the usual step)."""
    if not any(map(is_, grads, repeat(None))):
        return None
    return np.asarray([i for i, g in enumerate(grads) if g is not None], dtype=np.int64)


def _validate(pc: AdamWPiece) -> None:
    n = pc.p.numel()
    pure = pc.out is None
    if pure and pc.p.dtype != torch.bfloat16:
        raise TypeError(
            f"fused AdamW: {pc.param!r} has no BF16 out, so its parameter must be bfloat16 (got {pc.p.dtype})"
        )
    if not pure and pc.p.dtype != torch.float32:
        raise TypeError(f"fused AdamW: shadow of {pc.param!r} must be float32, got {pc.p.dtype}")
    if pc.out is not None and (pc.out.dtype != torch.bfloat16 or pc.out.numel() != n):  # not pure
        raise TypeError(f"fused AdamW: out of {pc.param!r} must be bfloat16 with the shadow's numel")
    moment_dtypes = (torch.float32, torch.bfloat16) if pure else (torch.float32,)
    for name, t in (("exp_avg", pc.exp_avg), ("exp_avg_sq", pc.exp_avg_sq)):
        if t.dtype not in moment_dtypes or t.numel() != n:
            raise TypeError(
                f"fused AdamW: {name} of {pc.param!r} must be {' or '.join(map(str, moment_dtypes))} "
                f"with the parameter's numel, got {t.dtype} x {t.numel()}"
            )
    if pc.exp_avg.dtype != pc.exp_avg_sq.dtype:
        raise TypeError(f"fused AdamW: the moments of {pc.param!r} must share a dtype")
    for name, u in (("parameter", pc.p), ("exp_avg", pc.exp_avg), ("exp_avg_sq", pc.exp_avg_sq), ("out", pc.out)):
        if u is not None and (not u.is_contiguous() or u.device != pc.p.device):
            raise TypeError(f"fused AdamW: {name} of {pc.param!r} must be contiguous and on {pc.p.device}")
    if not isinstance(pc.offset, int) or isinstance(pc.offset, bool) or pc.offset < 0:
        raise ValueError(f"fused AdamW: offset of {pc.param!r} must be a non-negative int, got {pc.offset!r}")
