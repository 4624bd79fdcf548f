"""Fault injection for the bare receiver (tests): a receiver that holds, and reports, bits other
than the ones the trainer sent, so the trainer's digest checks can be exercised without vLLM.

``NAME`` flips one bit of tensor ``NAME`` (its first element) each time it loads;
``delta:NAME`` flips one bit inside the first delta received for ``NAME`` (once).
"""

from __future__ import annotations

import torch


class BitFlip:
    """One ``--corrupt`` spec (``NAME`` or ``delta:NAME``), applied by ``WeightReceiver``."""

    def __init__(self, spec: str):
        self.tensor, self.delta = (None, spec[6:]) if spec.startswith("delta:") else (spec, None)

    def loaded(self, tensors: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``tensors`` as they are loaded: the named one with one bit flipped."""
        if self.tensor is None:
            return tensors
        return [(n, flip_one_bit(t) if n == self.tensor else t) for n, t in tensors]

    def delta_received(self, name: str, buf: torch.Tensor, at: int) -> None:
        """A delta for ``name`` in ``buf`` (uint8) whose payload starts at ``at``: the first one
        for the named tensor gets one bit flipped, in place."""
        if self.delta == name and buf.numel() > at:
            buf[at] ^= 1
            self.delta = None


def flip_one_bit(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t.reshape(-1)[:1].view(torch.uint8)[0] ^= 1
    return t
