"""One process: the precision switch applied to a plain module (``apply_precision``)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import torch

from .. import faults
from ..config import ConfigError
from ..optim import optimizer_class
from ..precision import apply_precision
from ..sources import ReplicatedSource, WeightSource
from .base import TrainSettings
from .checkpoints import REFUSED, CheckpointCorrupt, quarantine, state_digest
from .registry import engine_class, engine_names


class SingleEngine:
    """One process: the precision switch applied to the model and its optimizer in place."""

    needs_process_group = False
    reads_deepspeed_json = False
    trains_pure_bf16 = True
    rank, world = 0, 1

    @classmethod
    def check_world(cls, distributed, world: int) -> None:
        if world > 1:
            sharded = ", ".join(n for n in engine_names() if engine_class(n).needs_process_group)
            raise ConfigError(
                f"the launcher started {world} processes but the engine is 'single', which would train "
                f"{world} independent copies; set distributed.engine ({sharded}) or pass --engine"
            )

    def __init__(self, settings: TrainSettings, model: torch.nn.Module):
        self.precision = apply_precision(
            model, settings.precision, optimizer_class(settings.optimizer), **settings.hyper
        )
        self.module, self.max_grad_norm = model, settings.max_grad_norm
        self.meter = self.precision.sticking_meter()

    def backward(self, loss):
        self.precision.zero_grad()
        self.precision.backward(loss)

    def step(self) -> tuple[float, bool]:
        """Clip and step; a non-finite gradient skips the step (the loss scaler's own rule under
        FP16), so NaN never reaches the weights."""
        norm = float(self.precision.clip_grad_norm_(self.max_grad_norm))
        if not math.isfinite(norm) and not self.precision.config.spec.loss_scaling:
            self.precision.zero_grad()
            return norm, False
        return norm, self.precision.step()

    def digest(self) -> str:
        return self.precision.digest()

    def expected_digest(self) -> str:
        return self.precision.expected_digest()

    def weight_source(self) -> WeightSource:
        return ReplicatedSource(self.module)

    def save(self, path: Path, step: int) -> None:
        """``checkpoint.pt``: the working weights, the precision's state (shadows, optimizer moments,
        key step, loss scale) and a SHA-256 of all of it; the previous one becomes
        ``checkpoint.prev.pt``. Written to a temporary file, flushed and renamed, so a crash leaves
        the previous checkpoints; refused when the working weights are not the keyed rounding of
        the shadows or any of the state is not finite (a bad state never replaces a good one)."""
        digest, expected = self.digest(), self.expected_digest()
        if digest != expected:
            raise RuntimeError(
                f"not saving step {step}: the working weights (digest {digest}) are not the keyed "
                f"rounding of the FP32 shadows ({expected}); the previous checkpoint is kept"
            )
        state = {
            "step": step,
            "model": self.module.state_dict(),
            "precision": self.precision.state_dict(),
            "digest": digest,
        }
        bad = _non_finite(state)
        if bad:
            raise RuntimeError(
                f"not saving step {step}: non-finite values in {bad[:5]}; the previous checkpoint is kept"
            )
        state["content_sha256"] = state_digest(state)
        tmp = path / "checkpoint.pt.tmp"
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        faults.point("checkpoint.written")
        if (path / CHECKPOINT).exists():
            os.replace(path / CHECKPOINT, path / PREVIOUS)
        faults.point("checkpoint.rotated")
        os.replace(tmp, path / CHECKPOINT)
        faults.point("checkpoint.done")

    def load(self, path: Path) -> int | None:
        """The newest checkpoint that verifies (``checkpoint.pt``, else ``checkpoint.prev.pt`` with
        a warning naming why the newer one was refused); None if there is none. Read without
        unpickling code (``weights_only``); its content digest must match, and the working weights
        re-derived from the loaded shadows must be the saved ones."""
        found = [path / n for n in (CHECKPOINT, PREVIOUS) if (path / n).exists()]
        if not found:
            return None
        refused = []
        for ckpt in found:
            try:
                step = self._load_one(ckpt)
            except Exception as exc:  # any failure to read or verify (a damaged pickle fails in any way): refused
                reason = f"{ckpt.name}: {exc if isinstance(exc, CheckpointCorrupt) else repr(exc)}"
                refused.append((ckpt, reason))
                continue
            for bad, reason in refused:  # never rotated over the good one, kept for inspection
                quarantine(bad, path, reason)
            if refused:
                warnings.warn(
                    f"dist_sr: resuming from {ckpt} (step {step}); refused newer (moved to {path / REFUSED}): "
                    f"{'; '.join(r for _, r in refused)}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return step
        raise CheckpointCorrupt(f"{path}: no checkpoint verifies: {'; '.join(r for _, r in refused)}")

    def _load_one(self, ckpt: Path) -> int:
        state = torch.load(ckpt, weights_only=True)
        recorded = state.pop("content_sha256", None)
        if recorded is None or state_digest(state) != recorded:
            raise CheckpointCorrupt(
                f"{ckpt}: content digest {'missing' if recorded is None else 'differs'} "
                "(a corrupted or foreign checkpoint)"
            )
        self.module.load_state_dict(state["model"])
        self.precision.load_state_dict(state["precision"])  # re-derives the working weights
        if any(not torch.equal(state["model"][k], v) for k, v in self.module.state_dict().items()):
            raise RuntimeError(
                f"{ckpt}: working weights re-derived from the shadows differ from the saved ones "
                "(a corrupted checkpoint)"
            )
        digest = self.digest()
        if digest != state["digest"]:
            raise RuntimeError(
                f"{ckpt}: working weights after loading have digest {digest}, the checkpoint recorded "
                f"{state['digest']} (a corrupted checkpoint)"
            )
        if self.meter is not None:
            self.meter.sync_previous()
        return int(state["step"])


CHECKPOINT, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"


def _non_finite(state, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors in ``state`` holding NaN or Inf."""
    if isinstance(state, dict):
        return [n for k, v in state.items() for n in _non_finite(v, f"{prefix}{k}.")]
    if isinstance(state, (list, tuple)):
        return [n for i, v in enumerate(state) for n in _non_finite(v, f"{prefix}{i}.")]
    if isinstance(state, torch.Tensor) and state.is_floating_point() and not torch.isfinite(state).all():
        return [prefix.rstrip(".")]
    return []
