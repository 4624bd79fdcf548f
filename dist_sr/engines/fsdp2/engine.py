"""FSDP2 (``torch.distributed.fsdp.fully_shard``) as a training engine: the model sharded by
``apply_fsdp2``, SR in the all-gather, sharded checkpoints."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from ...config import ConfigError
from ...numerics.digest import combine
from ...optim import optimizer_class
from ...sources import add_rank_sums, layout_free_digest
from ..base import TrainSettings
from ..checkpoints import choose_verified, prune_checkpoints, write_atomic, write_manifest
from .apply import apply_fsdp2, pure_bf16_optimizer
from .hook import plain, sharded_state_dict
from .source import FSDP2Source, sent_sums


class FSDP2Engine:
    """FSDP2 with the precision switch applied through ``apply_fsdp2`` (SR in the all-gather)."""

    needs_process_group = True
    reads_deepspeed_json = False
    trains_pure_bf16 = True  # BF16 shards stepped by AdamWSR

    @classmethod
    def check_world(cls, distributed, world: int) -> None:
        try:
            distributed.fsdp2.check_world(world)
        except ValueError as exc:
            raise ConfigError(f"distributed.{exc}") from None

    def __init__(self, settings: TrainSettings, model):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ctx = apply_fsdp2(model, settings.precision, settings.distributed.fsdp2)
        self.module, self.max_grad_norm = model, settings.max_grad_norm
        if settings.precision.spec.pure:  # BF16 shards, no master: AdamWSR per shard
            self.optimizer = pure_bf16_optimizer(model, settings.precision, **settings.hyper)
        else:
            self.optimizer = optimizer_class(settings.optimizer)(model.parameters(), foreach=True, **settings.hyper)
        if self.ctx is not None:
            self.ctx.track(self.optimizer)
        self.meter = None  # the working weights exist only inside forward

    def backward(self, loss):
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()

    def step(self) -> tuple[float, bool]:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # the same on every rank
        if not math.isfinite(norm):  # NaN never reaches the masters
            self.optimizer.zero_grad(set_to_none=True)
            return norm, False
        self.optimizer.step()
        return norm, True

    def digest(self) -> str:
        """Layout-free digest of the working weights as the forward used them: with SR, the BF16
        shards this rank handed to the all-gathers at the current key (a parameter not gathered
        since its update makes the digest differ); otherwise the local shards as they are.
        Nothing is gathered; collective."""
        if self.ctx is None or not self.ctx.cache_rounded:
            return self.expected_digest()
        source = FSDP2Source(self.module, self.ctx, self.rank, self.world, as_bf16=False)
        return combine(add_rank_sums(sent_sums(self.module, self.ctx), source.metadata(), self.world))

    def expected_digest(self) -> str:
        """The same digest of the working weights re-derived from the local FP32 shards with the
        rounding key (FP32 masters or bf16-pure-sr's BF16 parameters as they are without SR)."""
        return layout_free_digest(FSDP2Source(self.module, self.ctx, self.rank, self.world, as_bf16=False), self.world)

    def weight_source(self) -> FSDP2Source:
        return FSDP2Source(self.module, self.ctx, self.rank, self.world)

    def _state(self) -> dict:
        return {
            "model": sharded_state_dict(self.module),
            "optimizer": get_optimizer_state_dict(self.module, self.optimizer),
        }

    def save(self, path: Path, step: int) -> None:
        """Sharded checkpoint of the FP32 masters, the optimizer state and the rounding key's step
        (``torch.distributed.checkpoint``: every rank writes its shards, any world size reads them).

        Written to ``fsdp2/step<N>.tmp`` and renamed by rank 0 once every rank has finished; then
        ``fsdp2/latest`` is replaced atomically. A crash at any point leaves the previous
        checkpoint as the one ``load`` finds. ``path`` must be shared by all ranks (a multi-node
        run puts the run directory on a shared volume).
        """
        root = path / "fsdp2"
        final, tmp = root / f"step{step}", root / f"step{step}.tmp"
        if (root / "latest").exists() and (root / "latest").read_text().strip() == final.name:
            raise RuntimeError(
                f"{final} is the latest checkpoint; saving step {step} again would replace it in "
                "place (no step has run since it was written)"
            )
        bad = torch.tensor([float(not _all_finite(self._state()))])
        dist.all_reduce(bad)
        if bad.item():
            raise RuntimeError(
                f"not saving step {step}: the masters or the optimizer state hold NaN or Inf on "
                f"{int(bad.item())} rank(s); the previous checkpoint is kept"
            )
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=str(tmp))
        digest = self.expected_digest()  # collective: every rank takes part
        dist.barrier()  # every rank's shards are on disk
        if self.rank == 0:
            meta = {
                "step": step,
                "world": self.world,
                "digest": digest,
                "sr": self.ctx.state_dict() if self.ctx else None,
                "optimizer": getattr(self.optimizer, "dist_sr_meta", lambda: None)(),
            }
            write_atomic(tmp / "dist_sr.json", json.dumps(meta, indent=1))
            write_manifest(tmp)  # SHA-256 of every shard file, checked before loading
            shutil.rmtree(final, ignore_errors=True)  # a leftover of a run that crashed after its rename
            os.replace(tmp, final)
            write_atomic(root / "latest", final.name)
            prune_checkpoints(root)
        dist.barrier()  # nobody returns (or reads 'latest') before the rename

    def load(self, path: Path) -> int | None:
        """Resume from ``fsdp2/latest`` (written at any world size), or, if its files do not match
        their manifest, from the previous complete checkpoint (with a warning naming why). Checks
        that the working weights re-derived from the loaded masters have the digest recorded at
        save time."""
        root = path / "fsdp2"
        latest = root / "latest"
        if not latest.exists():
            return None
        named = root / latest.read_text().strip()
        ckpt = choose_verified(root, named, self.rank)
        meta = json.loads((ckpt / "dist_sr.json").read_text())
        if (meta["sr"] is None) != (self.ctx is None):
            raise ConfigError(
                f"{ckpt} was saved {'without' if meta['sr'] is None else 'with'} SR; resume it with "
                "the precision it was trained with"
            )
        state = self._state()
        dcp.load(state, checkpoint_id=str(ckpt))  # in place into the masters, resharded if the world changed
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        if self.ctx is not None:
            self.ctx.load_state_dict(meta["sr"])  # the key's step; invalidates cached rounded shards
        digest = self.expected_digest()
        if digest != meta["digest"]:
            raise RuntimeError(
                f"{ckpt}: working weights re-derived from the loaded masters have digest {digest}, "
                f"the checkpoint recorded {meta['digest']} (saved by {meta['world']} ranks)"
            )
        return int(meta["step"])


def _all_finite(state) -> bool:
    """Whether every floating-point tensor (local shards of DTensors) in ``state`` is finite."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return all(_all_finite(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return all(_all_finite(v) for v in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if isinstance(state, DTensor) else state
        local = plain(local)  # an SR shadow's FP32 storage
        return not local.is_floating_point() or bool(torch.isfinite(local).all())
    return True
