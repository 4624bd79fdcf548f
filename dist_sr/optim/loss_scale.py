"""Dynamic loss scaling for FP16 working weights (FP16's narrow range needs it; BF16 does not)."""

from __future__ import annotations

from typing import Iterable

import torch


class DynamicLossScaler:
    """Multiplies the loss by ``scale``; halves it (and skips the step) on an inf/NaN gradient,
    doubles it after ``growth_interval`` clean steps. ``dynamic=False`` keeps a static scale."""

    def __init__(
        self, init_scale: float = 2.0**16, growth_interval: int = 1000, dynamic: bool = True, min_scale: float = 1.0
    ):
        if init_scale <= 0 or growth_interval < 1:
            raise ValueError("loss scale must be > 0 and growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.dynamic = dynamic
        self.min_scale = min_scale
        self._good_steps = 0
        self.skipped_steps = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, grads: Iterable[torch.Tensor]) -> bool:
        """Divide FP32 grads by the scale in place; True if any was inf/NaN."""
        found_inf = False
        for g in grads:
            g.mul_(1.0 / self.scale)
            if not found_inf and not torch.isfinite(g).all():
                found_inf = True
        return found_inf

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            self.skipped_steps += int(found_inf)
            return
        if found_inf:
            self.scale = max(self.scale / 2, self.min_scale)
            self._good_steps = 0
            self.skipped_steps += 1
        else:
            self._good_steps += 1
            if self._good_steps >= self.growth_interval:
                self.scale *= 2
                self._good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self._good_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        self.skipped_steps = int(state["skipped_steps"])
