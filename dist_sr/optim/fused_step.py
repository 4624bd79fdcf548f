"""The step shared by the optimizers built on one fused ``AdamWPlan`` (``ShadowAdamW``,
``AdamWSR``): one kernel call for every parameter with a gradient."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np
import torch

from ..numerics.adamw import AdamWHyper, distinct_rows
from ..numerics.fused import live_pieces

if TYPE_CHECKING:
    from ..numerics.fused import AdamWPlan
    from .counter import StepCounter


def hyper_slots(
    groups: list[dict], group_of: np.ndarray, steps: np.ndarray, live: np.ndarray | None
) -> tuple[np.ndarray, list[AdamWHyper]]:
    """The distinct AdamW settings of one step, one per (param group, Adam step) in use, and each
    piece's row among them (0 for a piece without a gradient). ``live``: the stepping pieces'
    indices, None for all. Array work: the host cost barely grows with the number of pieces."""
    g, s = (group_of, steps) if live is None else (group_of[live], steps[live])
    pairs, rows = distinct_rows(np.stack([g, s], axis=1))
    hypers = []
    for gi, step in pairs.tolist():
        group = groups[gi]
        hypers.append(AdamWHyper(group["lr"], *group["betas"], group["eps"], group["weight_decay"], step))  # type: ignore[call-arg]  # betas: a pair
    if live is None:
        return rows, hypers
    slots = np.zeros(len(steps), dtype=np.int64)
    slots[live] = rows
    return slots, hypers


class FusedAdamWHost(Protocol):
    """What an optimizer provides to take its steps through one fused ``AdamWPlan``
    (``FusedAdamWSteps``): the two optimizers built on it are ``ShadowAdamW`` (FP32 shadows
    behind BF16 weights) and ``AdamWSR`` (pure BF16).

    Attributes:
        seed, mode: the rounding key's seed and mode.
        step_count: the key's step of the live weights (a plain step advances it).
        _counter: the ``StepCounter`` behind ``step_count``; capturable, the step lives on the
            device, so the step replays from a CUDA graph and every piece steps.
        _group_of: each piece's param group, an int64 array in plan order.
        _grad_scale: a device tensor from gradient clipping, used once by the next step, or None.
        _fused_groups: the AdamW param groups (``lr``, ``betas``, ``eps``, ``weight_decay``).

    Methods:
        _ensure_plan(): the fused plan, rebuilt when any of its tensors was replaced.
        _grads(): each piece's gradient, or None (plan order).
        _advance_adam_steps(live): advance Adam's step of the pieces ``live`` (None: all) and
            return every piece's, an int64 array.
        _after_step(live): called after every step (``live`` as above).
    """

    seed: int
    mode: str
    step_count: int
    _counter: StepCounter
    _group_of: np.ndarray
    _grad_scale: torch.Tensor | None

    @property
    def _fused_groups(self) -> list[dict]: ...

    def _ensure_plan(self) -> AdamWPlan: ...
    def _grads(self) -> list[torch.Tensor | None]: ...
    def _advance_adam_steps(self, live: np.ndarray | None) -> np.ndarray: ...
    def _after_step(self, live: np.ndarray | None) -> None: ...


class FusedAdamWSteps:
    """``step()`` for an optimizer that is a ``FusedAdamWHost``: one kernel call for every
    parameter with a gradient."""

    _grad_scale: torch.Tensor | None = None

    @torch.no_grad()
    def step(self: FusedAdamWHost, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._ensure_plan()
        grads = self._grads()
        scale, self._grad_scale = self._grad_scale, None
        groups = self._fused_groups
        live = live_pieces(grads)
        if self._counter.capturable:
            if live is not None:
                missing = [plan.names[i] for i, g in enumerate(grads) if g is None]
                raise ValueError(
                    f"{type(self).__name__}(capturable=True) steps every parameter; no gradient for {missing[:3]}"
                )
            hypers = [AdamWHyper(g["lr"], *g["betas"], g["eps"], g["weight_decay"], 1) for g in groups]  # type: ignore[call-arg]
            plan.step_(
                grads,
                hypers,
                self._group_of,
                seed=self.seed,
                step=0,
                mode=self.mode,
                grad_scale=scale,
                device_step=self._counter.device_step(self.seed, self.mode),
                live=live,
            )
            self._counter.advance()
        else:
            self.step_count += 1
            slots, hypers = hyper_slots(groups, self._group_of, self._advance_adam_steps(live), live)
            plan.step_(
                grads, hypers, slots, seed=self.seed, step=self.step_count, mode=self.mode, grad_scale=scale, live=live
            )
        self._after_step(live)
        return loss

    def _after_step(self, live: np.ndarray | None) -> None:
        """Called after every step (plain or capturable)."""
