"""DeepSpeed ZeRO as a training engine: the precision switch sets its bf16/fp16 sections and the
SR block, and the hook (``hook``) rounds where DeepSpeed copies its masters."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ...config import ConfigError
from ...numerics.digest import combine
from ...optim import StickingMeter, optimizer_class
from ...sources import ReplicatedSource, WeightSource, add_rank_sums, layout_free_digest
from ..base import TrainSettings
from ..checkpoints import choose_verified, prune_checkpoints, write_manifest
from .config import config_for_precision, hyperparameter_conflicts
from .hook import initialize
from .source import ZeRO3Source


class DeepSpeedEngine:
    """DeepSpeed ZeRO; the precision switch sets its bf16/fp16 sections and the SR block."""

    needs_process_group = True
    reads_deepspeed_json = True
    trains_pure_bf16 = False  # DeepSpeed always keeps (and shards) an FP32 master

    @classmethod
    def check_world(cls, distributed, world: int) -> None:
        """Any world: DeepSpeed pads its partitions to it."""

    def __init__(self, settings: TrainSettings, model):
        d = settings.distributed
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        base = (
            json.loads(Path(d.deepspeed_config).read_text())
            if d.deepspeed_config
            else {"zero_optimization": {"stage": d.zero_stage}, "steps_per_print": 10**9}
        )
        try:  # the launcher adopts the JSON's values; a caller that bypassed it must not disagree
            conflicts = hyperparameter_conflicts(
                base,
                {
                    "lr": settings.lr,
                    "betas": settings.betas,
                    "eps": settings.eps,
                    "weight_decay": settings.weight_decay,
                    "max_grad_norm": settings.max_grad_norm,
                },
                settings.optimizer,
            )
        except ValueError as exc:
            raise ConfigError(f"{d.deepspeed_config}: {exc}") from None
        if conflicts:
            raise ConfigError(
                f"the trainer's settings and {d.deepspeed_config} disagree: {'; '.join(conflicts)}; "
                "make them equal (dist-sr's launcher adopts the JSON's where the experiment is silent)"
            )
        base.update(
            {
                "train_micro_batch_size_per_gpu": settings.batch_per_rank,
                "gradient_accumulation_steps": 1,
                "gradient_clipping": settings.max_grad_norm,
            }
        )
        base.pop("train_batch_size", None)
        client_optimizer = None
        if settings.optimizer == "adamw":  # DeepSpeed's own AdamW on its FP32 partitions
            base["optimizer"] = {
                "type": "AdamW",
                "params": {
                    "lr": settings.lr,
                    "betas": list(settings.betas),
                    "eps": settings.eps,
                    "weight_decay": settings.weight_decay,
                    "torch_adam": True,
                },
            }
        else:  # any other registered torch optimizer, which ZeRO wraps
            base.pop("optimizer", None)
            client_optimizer = optimizer_class(settings.optimizer)(model.parameters(), **settings.hyper)
        config = config_for_precision(settings.precision, base)
        self.engine, *_ = initialize(
            model=model, model_parameters=model.parameters(), config=config, optimizer=client_optimizer
        )
        self.module = self.engine.module
        self.zero3 = self.engine.zero_optimization_stage() == 3
        self.meter = None if self.zero3 else StickingMeter([(n, p) for n, p in self.module.named_parameters()])

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self) -> tuple[float, bool]:
        skipped = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan"), self.engine.skipped_steps == skipped

    def digest(self) -> str:
        """Layout-free digest of the BF16 working weights (each rank sums what it holds: a slice
        of the replicas, or its ZeRO-3 partitions; nothing is gathered); collective."""
        return layout_free_digest(self.weight_source(), self.world)

    def expected_digest(self) -> str:
        """The same digest of the working weights re-derived from the FP32 master partitions with the
        rounding key (each rank rounds its share; nothing is gathered); without SR, ``digest``."""
        sr = getattr(self.engine, "dist_sr", None)
        if sr is None:
            return self.digest()
        return combine(add_rank_sums(sr.master_sums(), self.weight_source().metadata(), self.world))

    def weight_source(self) -> WeightSource:
        if self.zero3:
            return ZeRO3Source(self.module, self.rank, self.world)
        return ReplicatedSource(self.module, self.rank, self.world)

    def save(self, path: Path, step: int) -> None:
        """DeepSpeed's own checkpoint (it writes ``latest`` only after the tag is complete) plus
        the working weights' digest; tags beyond the newest ``KEEP_CHECKPOINTS`` are removed.

        Refused (before anything is written, so the previous checkpoint stays the one ``load``
        finds) when the BF16 working weights are not the keyed rounding of the FP32 masters."""
        digest, expected = self.digest(), self.expected_digest()  # collective
        if digest != expected:
            raise RuntimeError(
                f"not saving step {step}: the BF16 working weights (digest {digest}) are not the keyed "
                f"rounding of the FP32 masters ({expected}); the previous checkpoint is kept"
            )
        bad = torch.tensor([float(not self._finite())])
        dist.all_reduce(bad)
        if bad.item():
            raise RuntimeError(
                f"not saving step {step}: the weights or FP32 masters hold NaN or Inf on "
                f"{int(bad.item())} rank(s); the previous checkpoint is kept"
            )
        root = path / "deepspeed"
        self.engine.save_checkpoint(
            str(root), tag=f"step{step}", client_state={"dist_sr_step": step, "dist_sr_digest": digest}
        )
        dist.barrier()
        if self.rank == 0:
            write_manifest(root / f"step{step}")  # SHA-256 of every file, checked before loading
            prune_checkpoints(root)
        dist.barrier()

    def _finite(self) -> bool:
        tensors = [p.data for p in self.module.parameters()]
        sr = getattr(self.engine, "dist_sr", None)
        if sr is not None:
            tensors += [hp for _, hp, _ in sr.layout.master_pieces()]
        return all(bool(torch.isfinite(t).all()) for t in tensors if t.numel())

    def load(self, path: Path) -> int | None:
        """The checkpoint DeepSpeed's ``latest`` names, or, if its files do not match their manifest,
        the previous complete one (with a warning naming why); refused unless the loaded working
        weights and the rounding of the loaded masters both have the digest recorded at save time."""
        root = path / "deepspeed"
        if not (root / "latest").exists():
            return None
        named = root / (root / "latest").read_text().strip()
        chosen = choose_verified(root, named, self.rank).name
        tag, client = self.engine.load_checkpoint(str(root), tag=chosen)
        if tag is None:
            raise RuntimeError(
                f"{path / 'deepspeed'}: DeepSpeed found no loadable checkpoint at the tag 'latest' names"
            )
        if self.meter is not None:
            self.meter.sync_previous()
        if "dist_sr_digest" not in client:
            raise RuntimeError(
                f"{tag}: the checkpoint records no dist_sr_digest; it was not written by dist-sr's "
                "DeepSpeed engine, so its weights cannot be verified"
            )
        digest, expected = self.digest(), self.expected_digest()
        if digest != client["dist_sr_digest"] or expected != client["dist_sr_digest"]:
            raise RuntimeError(
                f"{tag}: after loading, the working weights have digest {digest} and the rounding of the "
                f"FP32 masters {expected}; the checkpoint recorded {client['dist_sr_digest']} "
                "(a corrupted or foreign checkpoint)"
            )
        return int(client["dist_sr_step"])
