"""The step shared by the optimizers built on one fused ``AdamWPlan`` (``ShadowAdamW``,
``AdamWSR``): one kernel call for every parameter with a gradient."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..numerics.adamw import AdamWHyper


class HyperTable:
    """The distinct AdamW settings of one step: one row per (param group, Adam step) in use."""

    def __init__(self, groups: list[dict]):
        self.groups, self.hypers = groups, []
        self._rows: dict[tuple[int, int], int] = {}

    def row(self, group: int, adam_step: int) -> int:
        key = (group, adam_step)
        if key not in self._rows:
            g = self.groups[group]
            self._rows[key] = len(self.hypers)
            self.hypers.append(AdamWHyper(g["lr"], *g["betas"], g["eps"], g["weight_decay"], adam_step))
        return self._rows[key]


class FusedAdamWSteps:
    """``step()`` for an optimizer that provides: ``_counter`` (a ``StepCounter``), ``seed``,
    ``mode``, ``_fused_groups`` (its AdamW param groups), ``_group_of`` (each piece's group),
    ``_ensure_plan()``, ``_grads()`` (each piece's gradient or None), ``_next_adam_step(i)``;
    optionally ``_grad_scale`` (a device tensor from gradient clipping, used once) and
    ``_after_step(grads)``. A capturable optimizer keys the step on its device counter, so the
    step replays from a CUDA graph; every piece then steps."""

    _grad_scale: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plan = self._ensure_plan()
        grads = self._grads()
        scale, self._grad_scale = self._grad_scale, None
        groups = self._fused_groups
        if self._counter.capturable:
            if any(g is None for g in grads):
                missing = [plan.names[i] for i, g in enumerate(grads) if g is None]
                raise ValueError(f"{type(self).__name__}(capturable=True) steps every parameter; no gradient for "
                                 f"{missing[:3]}")
            hypers = [AdamWHyper(g["lr"], *g["betas"], g["eps"], g["weight_decay"], 1) for g in groups]
            plan.step_(grads, hypers, self._group_of, seed=self.seed, step=0, mode=self.mode, grad_scale=scale,
                       device_step=self._counter.device_step(self.seed, self.mode))
            self._counter.advance()
        else:
            self.step_count += 1
            table = HyperTable(groups)
            slots = [0 if g is None else table.row(self._group_of[i], self._next_adam_step(i))
                     for i, g in enumerate(grads)]
            plan.step_(grads, table.hypers, slots, seed=self.seed, step=self.step_count, mode=self.mode,
                       grad_scale=scale)
        self._after_step(grads)
        return loss

    def _after_step(self, grads: list) -> None:
        """Called after every step (plain or capturable)."""
