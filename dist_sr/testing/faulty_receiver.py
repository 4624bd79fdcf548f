"""A faulty bare receiver for the tests: it holds, and reports, bits other than the ones the
trainer sent, so the trainer's digest checks can be exercised without vLLM.

    python -m dist_sr.testing.faulty_receiver --port P --corrupt NAME

``NAME`` flips one bit of tensor ``NAME`` (its first element) each time it loads;
``delta:NAME`` flips one bit inside the first delta received for ``NAME`` (once).
"""

from __future__ import annotations

import torch

from ..weightsync.engine import cli
from ..weightsync.engine.receiver import WeightReceiver


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


class FaultyReceiver(WeightReceiver):
    """A ``WeightReceiver`` that applies the ``BitFlip`` ``spec``."""

    def __init__(self, spec: str, **kwargs):
        super().__init__(**kwargs)
        self.fault = BitFlip(spec)

    def loaded(self, tensors):
        return self.fault.loaded(tensors)

    def delta_received(self, name, buf, at):
        self.fault.delta_received(name, buf, at)


def main() -> None:
    ap = cli.parser()
    ap.add_argument(
        "--corrupt",
        metavar="NAME",
        required=True,
        help="flip one bit of tensor NAME as it is loaded, so this receiver holds and reports wrong bits; "
        "delta:NAME flips one bit of the first delta received for NAME",
    )
    args = ap.parse_args()
    cli.run(args, lambda **kwargs: FaultyReceiver(args.corrupt, **kwargs))


if __name__ == "__main__":
    main()
