"""The rounding key's step as optimizers keep it: a host int, or a device counter (capturable)."""

from __future__ import annotations

import torch

from ..numerics.backends import DeviceStep


class StepCounter:
    """The step of the live rounding (0 before the first update).

    Plain: a Python int. Capturable: an int64 tensor on the parameters' device, advanced by the
    step itself (``advance`` is a device op), so a step captured in a CUDA graph keeps counting
    when replayed. Reading ``value`` then costs one device synchronisation: do it at checkpoint
    time, not per step.
    """

    def __init__(self, value: int = 0, device: torch.device | None = None):
        self.tensor = None if device is None else torch.full((1,), value, dtype=torch.int64, device=device)
        self._value = value

    @property
    def capturable(self) -> bool:
        return self.tensor is not None

    @property
    def value(self) -> int:
        return int(self.tensor.item()) if self.tensor is not None else self._value

    @value.setter
    def value(self, v: int) -> None:
        if self.tensor is not None:
            self.tensor.fill_(v)
        self._value = v

    def advance(self) -> None:
        if self.tensor is not None:
            self.tensor.add_(1)
        else:
            self._value += 1

    def device_step(self, seed: int, mode: str) -> DeviceStep:
        """The ``DeviceStep`` that derives the next step's keys from this counter on the device."""
        return DeviceStep(self.tensor, seed, mode)  # type: ignore[arg-type]  # asked only of a capturable counter


class CountsSteps:
    """``step_count``, the key's step of the live weights, kept by ``self._counter`` (a read is a
    device synchronisation when the counter is capturable)."""

    _counter: StepCounter

    @property
    def step_count(self) -> int:
        return self._counter.value

    @step_count.setter
    def step_count(self, value: int) -> None:
        self._counter.value = value
