"""A run's directory: whether it holds a run, claiming it for a fresh run or a resume (never
reusing one unasked, never resuming with settings that change the run's math), the step a
resume starts from, and the config recorded beside the metrics."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist
import yaml

from ..config import ConfigError
from .config import ExperimentConfig, to_dict

# Settings a resumed run may change; any other difference from the run's config.yaml is refused.
RESUMABLE_CHANGES = (
    "grpo.steps",
    "checkpoint_every",
    "threads",
    "output_dir",
    "rollout.",
    "cluster.",
    "eval.every",
    "warmup.cache_dir",
    "grpo.max_skipped_fraction",
)
RUN_FILES = ("metrics.jsonl", "checkpoint.pt", "checkpoint.prev.pt", "deepspeed", "fsdp2", "tensorboard", "refused")


def _flatten(d: dict, prefix: str = "") -> dict:
    return {
        k2: v2
        for k, v in d.items()
        for k2, v2 in (_flatten(v, f"{prefix}{k}.").items() if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    }


def check_resume_config(out_dir: Path, cfg: ExperimentConfig) -> None:
    """Refuse to resume with settings that change the run's math (learning rate, precision, model,
    data, seeds...): the checkpoint's state was made with the recorded ones."""
    recorded = out_dir / "config.yaml"
    if not recorded.exists():
        return
    old = _flatten(yaml.safe_load(recorded.read_text()) or {})
    new = _flatten(yaml.safe_load(yaml.safe_dump(to_dict(cfg))))
    changed = sorted(
        k
        for k in set(old) | set(new)
        if old.get(k) != new.get(k)
        and not any(k == c or (c.endswith(".") and k.startswith(c)) for c in RESUMABLE_CHANGES)
    )
    if changed:
        detail = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:6])
        raise ConfigError(
            f"{out_dir} was trained with other settings ({detail}); resume it with its own "
            f"config ({recorded}), or start a new run in another output_dir (or with --overwrite)"
        )


def holds_a_run(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds metrics or a checkpoint of a run."""
    metrics = out_dir / "metrics.jsonl"
    return (metrics.exists() and metrics.stat().st_size > 0) or any((out_dir / n).exists() for n in RUN_FILES[1:5])


def claim(out_dir: Path, cfg: ExperimentConfig, *, resume: bool | str, overwrite: bool, rank: int, world: int) -> None:
    """Make ``out_dir`` ready for this run on every rank: a fresh run refuses a directory holding
    a run unless ``overwrite`` (then rank 0 removes its metrics and checkpoints); a resume refuses
    changed settings."""
    if not resume and holds_a_run(out_dir):
        if not overwrite:
            raise ConfigError(
                f"{out_dir} already holds a run (metrics or checkpoints); pass --resume to continue "
                "it, --overwrite to replace it, or choose another output_dir"
            )
        if world > 1:
            dist.barrier()  # every rank has looked before rank 0 removes anything
        if rank == 0:
            for name in RUN_FILES:
                target = out_dir / name
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    if resume:
        check_resume_config(out_dir, cfg)
    if world > 1:
        dist.barrier()


def resume_step(loaded: int | None, out_dir: Path, *, resume: bool | str, steps: int, rank: int) -> int | None:
    """The step a run starts after, given the checkpoint step ``loaded`` (None: none on disk);
    None when it starts fresh. ``resume=True`` without a checkpoint, or a checkpoint beyond
    ``grpo.steps``, is refused; ``resume="auto"`` without one starts fresh, saying so."""
    if loaded is None and resume is True:
        raise ConfigError(
            f"nothing to resume in {out_dir}: it holds no checkpoint; run without --resume to start "
            "fresh (or with --resume-or-start)"
        )
    if loaded is None:
        if rank == 0:
            print(f"dist-sr: no checkpoint in {out_dir}; starting fresh", flush=True)
        return None
    if loaded > steps:
        raise ConfigError(
            f"the checkpoint in {out_dir} is at step {loaded}, beyond grpo.steps={steps}; set "
            f"grpo.steps to at least {loaded} to continue this run"
        )
    if rank == 0:
        print(f"dist-sr: resuming {out_dir} from step {loaded}", flush=True)
    return loaded


def record_config(out_dir: Path, cfg: ExperimentConfig) -> None:
    """The run's settings beside its metrics (what a resume is checked against)."""
    (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
