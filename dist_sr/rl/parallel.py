"""Training engines behind one interface: one process, DeepSpeed ZeRO, or FSDP2.

The trainer talks to an engine through ``module`` (forward and generation), ``backward``,
``step`` (clip + optimizer step, returns the pre-clip gradient norm), ``digest`` (of the BF16
working weights the forward uses; collective), ``meter`` (sticking metrics where the working
weights are local), ``save``/``load`` and ``rank``/``world``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..optim import StickingMeter
from ..precision import apply_precision
from .config import ConfigError, ExperimentConfig

ENGINES = ("single", "deepspeed", "fsdp2")


def init_distributed(engine: str, backend: str | None = None) -> None:
    """Join the process group the launcher (torchrun / deepspeed) describes in the environment:
    nccl when CUDA is present, gloo otherwise (``backend`` overrides)."""
    if engine == "single" or dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError(f"distributed.engine={engine!r} needs a launcher (torchrun or deepspeed) that sets "
                          "RANK/WORLD_SIZE/MASTER_ADDR, or the entry point launch/train.py; "
                          "or use distributed.engine=single")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def training_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


class SingleEngine:
    rank, world = 0, 1

    def __init__(self, cfg: ExperimentConfig, model):
        g = cfg.grpo
        self.precision = apply_precision(model, cfg.precision, torch.optim.AdamW, lr=g.lr, betas=g.betas, eps=g.eps,
                                         weight_decay=g.weight_decay)
        self.module, self.max_grad_norm = model, g.max_grad_norm
        self.meter = self.precision.sticking_meter()

    def backward(self, loss):
        self.precision.zero_grad()
        self.precision.backward(loss)

    def step(self) -> tuple[float, bool]:
        norm = float(self.precision.clip_grad_norm_(self.max_grad_norm))
        return norm, self.precision.step()

    def digest(self) -> str:
        return self.precision.digest()

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


class DeepSpeedEngine:
    """DeepSpeed ZeRO; the precision switch sets its bf16/fp16 sections and the SR block."""

    def __init__(self, cfg: ExperimentConfig, model):
        from ..integrations import deepspeed as dsr

        d, g = cfg.distributed, cfg.grpo
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        base = json.loads(Path(d.deepspeed_config).read_text()) if d.deepspeed_config else {
            "zero_optimization": {"stage": d.zero_stage}, "steps_per_print": 10**9}
        base.update({
            "train_micro_batch_size_per_gpu": g.prompts_per_step // self.world * g.samples_per_prompt,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": g.max_grad_norm,
            "optimizer": {"type": "AdamW", "params": {"lr": g.lr, "betas": list(g.betas), "eps": g.eps,
                                                      "weight_decay": g.weight_decay, "torch_adam": True}},
        })
        base.pop("train_batch_size", None)
        config = dsr.config_for_precision(cfg.precision, base)
        self.engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=config)
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
        from ..rollout.sources import layout_free_digest, source_for

        return layout_free_digest(source_for(self), self.world)

    def save(self, path: Path, step: int) -> None:
        """DeepSpeed's own checkpoint (it writes ``latest`` only after the tag is complete) plus
        the working weights' digest; tags beyond the newest ``KEEP_CHECKPOINTS`` are removed."""
        digest = self.digest()
        root = path / "deepspeed"
        self.engine.save_checkpoint(str(root), tag=f"step{step}",
                                    client_state={"dist_sr_step": step, "dist_sr_digest": digest})
        dist.barrier()
        if self.rank == 0:
            _prune_checkpoints(root)
        dist.barrier()

    def load(self, path: Path) -> int | None:
        if not (path / "deepspeed" / "latest").exists():
            return None
        tag, client = self.engine.load_checkpoint(str(path / "deepspeed"))  # the tag DeepSpeed's 'latest' names
        if self.meter is not None:
            self.meter.sync_previous()
        digest = self.digest()
        if "dist_sr_digest" in client and digest != client["dist_sr_digest"]:
            raise RuntimeError(f"{tag}: working weights after loading have digest {digest}, the checkpoint recorded "
                               f"{client['dist_sr_digest']}")
        return int(client["dist_sr_step"])


class FSDP2Engine:
    """FSDP2 with the precision switch applied through ``apply_fsdp2`` (SR in the all-gather)."""

    def __init__(self, cfg: ExperimentConfig, model):
        from ..integrations import fsdp2

        g = cfg.grpo
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ctx = fsdp2.apply_fsdp2(model, cfg.precision, cfg.distributed.fsdp2)
        self.module, self.max_grad_norm = model, g.max_grad_norm
        hyper = dict(lr=g.lr, betas=g.betas, eps=g.eps, weight_decay=g.weight_decay)
        if cfg.precision.precision == "bf16-pure-sr":  # BF16 shards, no master: AdamWSR per shard
            self.optimizer = fsdp2.pure_bf16_optimizer(model, cfg.precision, **hyper)
        else:
            self.optimizer = torch.optim.AdamW(model.parameters(), foreach=True, **hyper)
        if self.ctx is not None:
            self.ctx.track(self.optimizer)
        self.meter = None  # the working weights exist only inside forward

    def backward(self, loss):
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()

    def step(self) -> tuple[float, bool]:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        self.optimizer.step()
        return float(norm), True

    def digest(self) -> str:
        """Layout-free digest of the working weights: with SR, the keyed rounding of each local FP32
        shard (the bits the next all-gather sends); otherwise the local shards as they are (FP32
        masters, or bf16-pure-sr's BF16 parameters). Nothing is gathered; collective."""
        from ..rollout.sources import FSDP2Source, layout_free_digest

        return layout_free_digest(FSDP2Source(self.module, self.ctx, self.rank, self.world, as_bf16=False), self.world)

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        from ..integrations import fsdp2

        return {"model": fsdp2.sharded_state_dict(self.module),
                "optimizer": get_optimizer_state_dict(self.module, self.optimizer)}

    def save(self, path: Path, step: int) -> None:
        """Sharded checkpoint of the FP32 masters, the optimizer state and the rounding key's step
        (``torch.distributed.checkpoint``: every rank writes its shards, any world size reads them).

        Written to ``fsdp2/step<N>.tmp`` and renamed by rank 0 once every rank has finished; then
        ``fsdp2/latest`` is replaced atomically. A crash at any point leaves the previous
        checkpoint as the one ``load`` finds. ``path`` must be shared by all ranks (a multi-node
        run puts the run directory on a shared volume).
        """
        import torch.distributed.checkpoint as dcp

        root = path / "fsdp2"
        final, tmp = root / f"step{step}", root / f"step{step}.tmp"
        if (root / "latest").exists() and (root / "latest").read_text().strip() == final.name:
            raise RuntimeError(f"{final} is the latest checkpoint; saving step {step} again would replace it in "
                               "place (no step has run since it was written)")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=str(tmp))
        digest = self.digest()  # collective: every rank takes part
        dist.barrier()  # every rank's shards are on disk
        if self.rank == 0:
            meta = {"step": step, "world": self.world, "digest": digest, "sr": self.ctx.state_dict() if self.ctx else None,
                    "optimizer": getattr(self.optimizer, "dist_sr_meta", lambda: None)()}
            _write_atomic(tmp / "dist_sr.json", json.dumps(meta, indent=1))
            shutil.rmtree(final, ignore_errors=True)  # a leftover of a run that crashed after its rename
            os.replace(tmp, final)
            _write_atomic(root / "latest", final.name)
            _prune_checkpoints(root)
        dist.barrier()  # nobody returns (or reads 'latest') before the rename

    def load(self, path: Path) -> int | None:
        """Resume from ``fsdp2/latest`` (written at any world size); checks that the working
        weights re-derived from the loaded masters have the digest recorded at save time."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        latest = path / "fsdp2" / "latest"
        if not latest.exists():
            return None
        ckpt = path / "fsdp2" / latest.read_text().strip()
        meta = json.loads((ckpt / "dist_sr.json").read_text())
        if (meta["sr"] is None) != (self.ctx is None):
            raise ConfigError(f"{ckpt} was saved {'without' if meta['sr'] is None else 'with'} SR; resume it with "
                              "the precision it was trained with")
        state = self._state()
        dcp.load(state, checkpoint_id=str(ckpt))  # in place into the masters, resharded if the world changed
        set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"])
        if self.ctx is not None:
            self.ctx.load_state_dict(meta["sr"])  # the key's step; invalidates cached rounded shards
        digest = self.digest()
        if digest != meta["digest"]:
            raise RuntimeError(f"{ckpt}: working weights re-derived from the loaded masters have digest {digest}, "
                               f"the checkpoint recorded {meta['digest']} (saved by {meta['world']} ranks)")
        return int(meta["step"])


KEEP_CHECKPOINTS = 2  # step directories kept under <run>/deepspeed/ and <run>/fsdp2/


def _prune_checkpoints(root: Path) -> None:
    """Remove all but the newest ``KEEP_CHECKPOINTS`` complete ``step<N>`` directories."""
    done = sorted((d for d in root.glob("step*") if d.is_dir() and d.name[4:].isdigit()),
                  key=lambda d: int(d.name[4:]))
    for old in done[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make_engine(cfg: ExperimentConfig, model):
    kind = cfg.distributed.engine
    init_distributed(kind)
    if kind == "single":
        return SingleEngine(cfg, model)
    world = dist.get_world_size()
    if cfg.grpo.prompts_per_step % world:
        raise ConfigError(f"grpo.prompts_per_step={cfg.grpo.prompts_per_step} must be a multiple of the world size "
                          f"{world}: each rank samples an equal share")
    return DeepSpeedEngine(cfg, model) if kind == "deepspeed" else FSDP2Engine(cfg, model)
