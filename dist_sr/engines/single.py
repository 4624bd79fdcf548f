"""One process: the precision switch applied to a plain module (``apply_precision``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..optim import optimizer_class
from ..precision import apply_precision
from ..sources import ReplicatedSource, WeightSource
from .base import TrainSettings


class SingleEngine:
    needs_process_group = False
    rank, world = 0, 1

    def __init__(self, settings: TrainSettings, model: torch.nn.Module):
        self.precision = apply_precision(model, settings.precision, optimizer_class(settings.optimizer),
                                         **settings.hyper)
        self.module, self.max_grad_norm = model, settings.max_grad_norm
        self.meter = self.precision.sticking_meter()

    def backward(self, loss):
        self.precision.zero_grad()
        self.precision.backward(loss)

    def step(self) -> tuple[float, bool]:
        norm = float(self.precision.clip_grad_norm_(self.max_grad_norm))
        return norm, self.precision.step()

    def digest(self) -> str:
        return self.precision.digest()

    def expected_digest(self) -> str:
        return self.precision.expected_digest()

    def weight_source(self) -> WeightSource:
        return ReplicatedSource(self.module)

    def save(self, path: Path, step: int) -> None:
        """``checkpoint.pt``: the working weights, the precision's state (shadows, optimizer, key
        step) and the weights' digest. Written to a temporary file, flushed to disk and renamed, so
        a crash leaves the previous checkpoint; refused when the working weights are not the keyed
        rounding of the shadows (a bad state never replaces a good one)."""
        digest, expected = self.digest(), self.expected_digest()
        if digest != expected:
            raise RuntimeError(f"not saving step {step}: the working weights (digest {digest}) are not the keyed "
                               f"rounding of the FP32 shadows ({expected}); the previous checkpoint is kept")
        tmp = path / "checkpoint.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save({"step": step, "model": self.module.state_dict(), "precision": self.precision.state_dict(),
                        "digest": digest}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path / "checkpoint.pt")

    def load(self, path: Path) -> int | None:
        """The run's checkpoint, read without unpickling code (``weights_only``) and verified: the
        working weights re-derived from the loaded shadows must be the saved ones, with the saved
        digest."""
        ckpt = path / "checkpoint.pt"
        if not ckpt.exists():
            return None
        state = torch.load(ckpt, weights_only=True)
        self.module.load_state_dict(state["model"])
        self.precision.load_state_dict(state["precision"])  # re-derives the working weights
        if any(not torch.equal(state["model"][k], v) for k, v in self.module.state_dict().items()):
            raise RuntimeError(f"{ckpt}: working weights re-derived from the shadows differ from the saved ones "
                               "(a corrupted checkpoint)")
        digest = self.digest()
        if "digest" in state and digest != state["digest"]:
            raise RuntimeError(f"{ckpt}: working weights after loading have digest {digest}, the checkpoint recorded "
                               f"{state['digest']} (a corrupted checkpoint)")
        self.meter.sync_previous()
        return int(state["step"])
