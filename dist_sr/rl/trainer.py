"""The GRPO training loop, top to bottom: rollouts, rewards, loss, step, metrics, checkpoints.

Under every precision the rollout engine generates with the trainer's working weights; every
``rollout.verify_every`` steps the digest the rollouts carry (of the weights they were generated
with) is checked against the digest of the working weights re-derived from the FP32 masters with
the rounding key: two independent paths to the same bits.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

from .. import faults
from ..config import ConfigError, Refusal
from ..engines import TrainSettings, init_distributed, training_device
from ..engines import make_engine as make_training_engine
from ..optim import ShadowOptimizer
from ..optim.metrics import bf16_spacing
from ..rollout import RolloutEngine, make_rollout_engine
from .config import ExperimentConfig, to_dict
from .evaluation import evaluate, fixed_examples
from .grpo import group_advantages, grpo_loss, sequence_logits, token_logprobs
from .mismatch import importance_weights, mismatch_metrics
from .model import load_pretrained
from .preflight import preflight
from .warmup import make_task, warmup_checkpoint


class RolloutWeightMismatch(Refusal, RuntimeError):
    """The rollouts were generated with other weights than the trainer's (digests differ)."""

    what = "rollout weights"


def step_seed(seed: int, step: int, stream: str) -> int:
    """A seed for one step's randomness: runs resume and compare without carrying RNG state."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{stream}".encode(), digest_size=8).digest(), "little")


class MetricsWriter:
    """Appends one JSON object per line (strict JSON: a NaN or Inf is written as null); mirrors
    the finite scalars to TensorBoard when it is installed. Resuming keeps the lines up to the
    checkpoint's step; a partial last line (a writer killed mid-line) is dropped with a warning."""

    def __init__(self, out_dir: Path, keep_until_step: int | None = None):
        self.path = out_dir / "metrics.jsonl"
        if keep_until_step is not None and self.path.exists():  # resuming: drop what comes after
            kept = [json.dumps(r) for r in read_metrics(self.path) if r["step"] <= keep_until_step]
            tmp = self.path.with_suffix(".jsonl.tmp")  # a crash here leaves the old file whole
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        elif keep_until_step is None:
            self.path.write_text("")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict) -> None:
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        faults.point("metrics.written")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``; a partial last line is dropped with a warning, a bad line
    before it is an error (the file was damaged, not cut short)."""
    lines = path.read_text().split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # no newline after it: the writer was killed mid-line
                warnings.warn(
                    f"dist_sr: {path}: dropping a partial last line ({line[:60]!r})", RuntimeWarning, stacklevel=2
                )
                continue
            raise ConfigError(
                f"{path}: line {i + 1} is not JSON ({line[:60]!r}); the metrics file is damaged"
            ) from None
    return records


class NonFiniteTraining(Refusal, RuntimeError):
    """Too many consecutive steps had a NaN or Inf loss: the run stops (its last good checkpoint is
    kept) instead of training on, or saving, a broken state."""

    what = "training stopped"


class TooManySkippedSteps(NonFiniteTraining):
    """More than ``grpo.max_skipped_fraction`` of the run's steps were skipped: it would finish
    without having trained."""


MAX_NONFINITE_STEPS = 3  # consecutive skipped steps before the run stops


def jitter_shadows_(optimizer: ShadowOptimizer, seed: int) -> None:
    """Move each FP32 shadow to a uniform random point within its BF16 rounding cell.

    Round-to-nearest still gives the same BF16 weights, but the shadows no longer sit on the
    grid with a full half-step dead zone: the control that shows where BF16's lag comes from.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p, s in optimizer.named_shadows():
            spacing = bf16_spacing(p.data).nan_to_num(0.0)
            u = torch.rand(s.shape, generator=g) - 0.5
            s.add_(u * 0.999 * spacing * torch.sign(s))
        optimizer.write_working()


def _all_sum(values: list[float], world: int) -> list[float]:
    """Sums over ranks (identity in one process)."""
    if world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=training_device())  # nccl reduces CUDA tensors
    dist.all_reduce(t)
    return t.tolist()


def _all_mean(values: list[float], world: int) -> list[float]:
    return values if world == 1 else [v / world for v in _all_sum(values, world)]


def settings(cfg: ExperimentConfig, world: int) -> TrainSettings:
    """What the training engine is built from, for this experiment."""
    g = cfg.grpo
    return TrainSettings(
        precision=cfg.precision,
        distributed=cfg.distributed,
        lr=g.lr,
        betas=g.betas,
        eps=g.eps,
        weight_decay=g.weight_decay,
        optimizer=g.optimizer,
        max_grad_norm=g.max_grad_norm,
        batch_per_rank=g.prompts_per_step // world * g.samples_per_prompt,
    )


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


def train(
    cfg: ExperimentConfig,
    *,
    progress: bool = True,
    resume: bool | str = False,
    overwrite: bool = False,
    stop_at: int | None = None,
    make_engine: Callable[[Any, Any], RolloutEngine] | None = None,
) -> Path:
    """Run GRPO for ``cfg``; returns the metrics file.

    Runs in one process or, with ``distributed.engine`` deepspeed/fsdp2, on every rank of a
    launcher's process group (each rank samples ``prompts_per_step / world`` prompts; rank 0
    writes metrics). ``resume=True`` continues from the run's checkpoint (an error if there is
    none, if its step is beyond ``grpo.steps``, or if the settings that shape the run changed);
    ``resume="auto"`` does that when a checkpoint exists and otherwise starts fresh, saying so.
    Without resume, an ``output_dir`` that already holds a run is refused unless ``overwrite``
    (which removes its metrics and checkpoints first). ``stop_at`` ends early (with a checkpoint);
    ``make_engine(model, tokenizer)`` replaces the configured rollout engine.

    A step whose loss is NaN or Inf (or, without loss scaling, whose gradient is) is skipped and
    counted (``nonfinite`` in the metrics); ``MAX_NONFINITE_STEPS`` in a row stop the run with
    ``NonFiniteTraining``, keeping the last good checkpoint.
    """
    if resume not in (False, True, "auto"):
        raise ValueError(f"resume must be False, True or 'auto', got {resume!r}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = Path(cfg.output_dir)
    preflight(cfg, out_dir)  # secrets, run directory, memory: before any compute
    init_distributed(cfg.distributed.engine)
    sharded = cfg.distributed.engine != "single"
    rank, world = (dist.get_rank(), dist.get_world_size()) if sharded else (0, 1)
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
    task = make_task(cfg)
    if cfg.model.path is None and rank == 0:
        warmup_checkpoint(cfg, progress=progress)  # rank 0 trains it; the others then read the cache
    if world > 1:
        dist.barrier()
    model_path = cfg.model.path or warmup_checkpoint(cfg, progress=False)
    model, tokenizer = load_pretrained(model_path)
    device = training_device()
    model.to(device)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # FP32 copy of the start weights
    g = cfg.grpo
    if g.prompts_per_step % world:
        raise ConfigError(
            f"grpo.prompts_per_step={g.prompts_per_step} must be a multiple of the world size "
            f"{world}: each rank samples an equal share"
        )
    trainer = make_training_engine(settings(cfg, world), model)
    if cfg.shadow_jitter:
        jitter_shadows_(trainer.precision.optimizer, step_seed(cfg.seed, 0, "jitter"))
    start = 0
    if resume:
        loaded = trainer.load(out_dir)
        if loaded is None and resume is True:
            raise ConfigError(
                f"nothing to resume in {out_dir}: it holds no checkpoint; run without --resume to start "
                "fresh (or with --resume-or-start)"
            )
        if loaded is None:
            if rank == 0:
                print(f"dist-sr: no checkpoint in {out_dir}; starting fresh", flush=True)
            resume = False
        elif loaded > g.steps:
            raise ConfigError(
                f"the checkpoint in {out_dir} is at step {loaded}, beyond grpo.steps={g.steps}; set "
                f"grpo.steps to at least {loaded} to continue this run"
            )
        else:
            start = loaded
            if rank == 0:
                print(f"dist-sr: resuming {out_dir} from step {loaded}", flush=True)
    if rank == 0:
        (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    if make_engine is not None:
        rollout = make_engine(trainer.module, tokenizer)
    else:
        rollout = make_rollout_engine(cfg.rollout, trainer, tokenizer, device=device, sharded=sharded)
    # what the rollouts' weights must be: re-derived from the masters (an engine whose digest is of
    # another kind supplies the trainer's digest in that kind)
    own_digest = getattr(rollout, "trainer_digest", trainer.expected_digest)
    writer = MetricsWriter(out_dir, keep_until_step=start if resume else None) if rank == 0 else None
    eval_set = fixed_examples(task, cfg.eval.num_prompts, cfg.eval.seed)
    per_rank = len(eval_set) // world
    eval_slice = eval_set[rank * per_rank : (rank + 1) * per_rank]  # equal slices: equal forward calls

    def stream(name: str) -> str:
        return name if world == 1 else f"{name}/{rank}"

    def run_eval() -> dict:
        ev = evaluate(
            trainer.module,
            tokenizer,
            task,
            eval_slice,
            seed=cfg.eval.seed + rank,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            ref_model=ref_model,
            stop_early=not sharded,
        )
        correct, n, kl_sum, kl_tokens = _all_sum([ev["correct"], ev["n"], ev["kl_sum"], ev["kl_tokens"]], world)
        return {"eval_accuracy": correct / n, "eval_kl": kl_sum / max(kl_tokens, 1)}

    def write(record: dict) -> None:
        if writer is not None:
            writer.write(record)

    saved_at = start if start else None  # the step of the newest checkpoint on disk
    bad_run = 0  # consecutive steps skipped for a non-finite loss or gradient
    skipped = 0  # steps this process skipped (non-finite, loss-scale overflow)
    if start == 0:
        write({"step": 0, **run_eval()})
    last = g.steps if stop_at is None else min(stop_at, g.steps)
    bar = tqdm(
        range(start + 1, last + 1),
        desc=f"GRPO {cfg.precision.precision}",
        disable=not progress or rank != 0,
        initial=start,
        total=g.steps,
    )
    for step in bar:
        t0 = time.perf_counter()
        rng = random.Random(step_seed(cfg.seed, step, stream("prompts")))
        examples = [task.sample(rng) for _ in range(g.prompts_per_step // world)]
        verify = cfg.rollout.verify_every > 0 and step % cfg.rollout.verify_every == 0
        rollout.sync_weights(step - 1, verify=verify)
        ro = rollout.generate(
            [e.prompt for e in examples],
            samples_per_prompt=g.samples_per_prompt,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            generator=torch.Generator(device=device).manual_seed(step_seed(cfg.seed, step, stream("sample"))),
            with_digest=verify,
        )
        answers = [e.answer for e in examples for _ in range(g.samples_per_prompt)]
        rewards = torch.tensor([task.reward(t, a) for t, a in zip(ro.texts, answers)], device=device)
        if verify:
            trainer_digest = own_digest()
            if ro.weight_digest != trainer_digest:
                raise RolloutWeightMismatch(
                    f"step {step}: rollouts were generated with weights {ro.weight_digest}, "
                    f"but the trainer holds {trainer_digest}"
                )
        logits = sequence_logits(trainer.module, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        logp = token_logprobs(logits, ro.completion_ids)
        with torch.no_grad():
            ref_logp = token_logprobs(
                sequence_logits(ref_model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask),
                ro.completion_ids,
            )
        mismatch, is_weights = {}, None
        if ro.engine_logprobs is not None:  # rollouts from another engine: measure, and correct if asked
            mismatch = mismatch_metrics(logp, ro.engine_logprobs, ro.completion_mask, threshold=g.mismatch_threshold)
            is_weights, done = importance_weights(
                logp, ro.engine_logprobs, ro.completion_mask, mode=g.is_correction, cap=g.is_cap
            )
            mismatch.update(done)
        loss, stats = grpo_loss(
            logp,
            logp.detach(),
            group_advantages(rewards, g.samples_per_prompt),
            ro.completion_mask,
            clip_eps=g.clip_eps,
            ref_logp=ref_logp,
            kl_coef=g.kl_coef,
            is_weights=is_weights,
        )
        nonfinite = _all_sum([0.0 if bool(torch.isfinite(loss.detach())) else 1.0], world)[0] > 0
        if nonfinite:  # every rank skips together (backward holds collectives)
            grad_norm, stepped = float("nan"), False
        else:
            trainer.backward(loss)
            grad_norm, stepped = trainer.step()
            nonfinite = not math.isfinite(grad_norm) and not cfg.precision.spec.loss_scaling
        bad_run = bad_run + 1 if nonfinite else 0
        skipped += not stepped
        reward, loss_mean, kl_k3 = _all_mean([rewards.mean().item(), loss.item(), stats["kl_k3"]], world)
        record = {
            "step": step,
            "reward": reward,
            "loss": loss_mean,
            "grad_norm": grad_norm,
            "kl_k3": kl_k3,
            "weight_version": ro.weight_version,
            "skipped": not stepped,
            "nonfinite": nonfinite,
            **(trainer.meter.update() if trainer.meter is not None else {}),
        }
        record.update(getattr(rollout, "sync_metrics", dict)())  # rank 0's view of the weight sync
        if mismatch:  # every rank has them (same engine kind); means over ranks
            record.update(zip(sorted(mismatch), _all_mean([mismatch[k] for k in sorted(mismatch)], world)))
        if step % cfg.eval.every == 0 or step == g.steps:
            record.update(run_eval())
        record["step_time"] = time.perf_counter() - t0
        write(record)
        if bad_run >= MAX_NONFINITE_STEPS:
            kept = f"the newest checkpoint, step {saved_at}, is kept" if saved_at else "no checkpoint was written"
            raise NonFiniteTraining(
                f"steps {step - bad_run + 1}..{step} had a non-finite loss or gradient and were "
                f"skipped; stopping ({kept}). Lower grpo.lr (now {g.lr}) or check the data and "
                "the model"
            )
        if skipped > g.max_skipped_fraction * g.steps:
            raise TooManySkippedSteps(
                f"{skipped} of the {step - start} steps run so far were skipped (a loss scaler "
                "that never finds a finite scale, or gradients that are never finite), more than "
                f"grpo.max_skipped_fraction={g.max_skipped_fraction} of grpo.steps={g.steps}; "
                "stopping instead of finishing untrained. Check precision.initial_loss_scale, "
                f"grpo.lr (now {g.lr}) and the data"
            )
        bar.set_postfix(
            reward=f"{reward:.3f}", acc=f"{record.get('eval_accuracy', float('nan')):.3f}", kl=f"{kl_k3:.2e}"
        )
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            trainer.save(out_dir, step)
            saved_at = step
    if saved_at != last:  # never rewrite the checkpoint 'latest' points at
        trainer.save(out_dir, last)
    if writer is not None:
        writer.close()
    return out_dir / "metrics.jsonl"
