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

    def weight_source(self) -> WeightSource:
        return ReplicatedSource(self.module)

    def save(self, path: Path, step: int) -> None:
        tmp = path / "checkpoint.pt.tmp"
        torch.save({"step": step, "model": self.module.state_dict(), "precision": self.precision.state_dict()}, tmp)
        os.replace(tmp, path / "checkpoint.pt")  # atomic: a crash leaves the previous checkpoint

    def load(self, path: Path) -> int | None:
        ckpt = path / "checkpoint.pt"
        if not ckpt.exists():
            return None
        state = torch.load(ckpt, weights_only=False)
        self.module.load_state_dict(state["model"])
        self.precision.load_state_dict(state["precision"])  # re-derives the working weights
        if any(not torch.equal(state["model"][k], v) for k, v in self.module.state_dict().items()):
            raise RuntimeError(f"{ckpt}: working weights re-derived from the shadows differ from the saved ones")
        self.meter.sync_previous()
        return int(state["step"])
