"""The GRPO training loop, top to bottom: rollouts, rewards, loss, step, metrics, checkpoints.

Under every precision the rollout engine generates with the trainer's working weights; every
``rollout.verify_every`` steps the digest the rollouts carry (of the weights they were generated
with) is checked against the digest of the working weights re-derived from the FP32 masters with
the rounding key: two independent paths to the same bits.

``train`` is the loop; ``GRPORun`` holds a run's state and does each named step of it; the run
directory (claiming, resuming) is ``rundir``, the metrics file ``metrics``.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import collectives
from ..config import ConfigError, Refusal
from ..engines import TrainSettings, engine_class, init_distributed, training_device
from ..engines import make_engine as make_training_engine
from ..optim import ShadowOptimizer
from ..optim.metrics import bf16_spacing
from ..rollout import RolloutEngine, make_rollout_engine
from . import rundir
from .config import ExperimentConfig
from .cpu_math import cpu_matmul
from .evaluation import evaluate, fixed_examples
from .grpo import group_advantages, grpo_loss, sequence_logits, token_logprobs
from .metrics import MetricsWriter
from .mismatch import importance_weights, mismatch_metrics
from .model import load_pretrained
from .preflight import preflight
from .warmup import make_task, start_checkpoint


class RolloutWeightMismatch(Refusal, RuntimeError):
    """The rollouts were generated with other weights than the trainer's (digests differ)."""

    what = "rollout weights"


def step_seed(seed: int, step: int, stream: str) -> int:
    """A seed for one step's randomness: runs resume and compare without carrying RNG state."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{stream}".encode(), digest_size=8).digest(), "little")


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


def _all_mean(values: list[float], world: int) -> list[float]:
    return values if world == 1 else [v / world for v in collectives.summed(values, device=training_device())]


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


def check_world(cfg: ExperimentConfig, world: int) -> None:
    """What ``world`` ranks need of ``cfg``, refused by name: the engine's own check
    (``check_world``), the prompts each rank samples, the evaluation prompts each rank scores. The
    planner asks it before anything starts, the trainer again on the world it joined."""
    engine_class(cfg.distributed.engine).check_world(cfg.distributed, world)
    g = cfg.grpo
    if g.prompts_per_step % world:
        raise ConfigError(
            f"grpo.prompts_per_step={g.prompts_per_step} does not split over world size {world}; "
            f"use a multiple of {world} (each rank samples prompts_per_step / world prompts)"
        )
    if cfg.eval.num_prompts < world:
        raise ConfigError(f"eval.num_prompts={cfg.eval.num_prompts} is smaller than world size {world}")


class GRPORun:
    """One GRPO run between its steps: the trainer, the rollout engine, the reference model, the
    evaluation slice, the metrics writer and the counters the health checks read. Built by
    ``train`` (which documents the arguments); each method is one named part of a step."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        progress: bool,
        resume: bool | str,
        overwrite: bool,
        make_engine: Callable[[Any, Any], RolloutEngine] | None,
        backend: str | None = None,
    ):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.out_dir = out_dir = Path(cfg.output_dir)
        preflight(cfg, out_dir)  # secrets, run directory, memory: before any compute
        init_distributed(cfg.distributed.engine, backend)
        self.sharded = engine_class(cfg.distributed.engine).needs_process_group
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if self.sharded else (0, 1)
        rank, world = self.rank, self.world
        rundir.claim(out_dir, cfg, resume=resume, overwrite=overwrite, rank=rank, world=world)
        if rank == 0:
            start_checkpoint(cfg, progress=progress)  # rank 0 warms up or casts it; the others read the cache
        if world > 1:
            dist.barrier()
        model, self.tokenizer = load_pretrained(start_checkpoint(cfg, progress=False))
        self.task = make_task(cfg, self.tokenizer)
        self.device = training_device()
        model.to(self.device)
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # FP32 copy of the start weights
        g = cfg.grpo
        check_world(cfg, world)
        self.trainer = make_training_engine(settings(cfg, world), model)
        if cfg.shadow_jitter:
            jitter_shadows_(self.trainer.precision.optimizer, step_seed(cfg.seed, 0, "jitter"))
        self.start = 0  # the step this process starts after
        if resume:
            loaded = rundir.resume_step(self.trainer.load(out_dir), out_dir, resume=resume, steps=g.steps, rank=rank)
            if loaded is None:
                resume = False
            else:
                self.start = loaded
        if rank == 0:
            rundir.record_config(out_dir, cfg)
        if make_engine is not None:
            self.rollout = make_engine(self.trainer.module, self.tokenizer)
        else:
            rollout_cfg = cfg.rollout
            if rollout_cfg.vllm.local_python and not rollout_cfg.vllm.local_log_dir:  # engines started here log here
                vllm = dataclasses.replace(rollout_cfg.vllm, local_log_dir=str(out_dir / "engines"))
                rollout_cfg = dataclasses.replace(rollout_cfg, vllm=vllm)
            self.rollout = make_rollout_engine(
                rollout_cfg, self.trainer, self.tokenizer, device=self.device, sharded=self.sharded
            )
        # what the rollouts' weights must be: re-derived from the masters, unless the engine's digest is
        # of another kind (it then supplies the trainer's digest in that kind)
        self.own_digest = lambda: self.rollout.trainer_digest() or self.trainer.expected_digest()
        self.writer = MetricsWriter(out_dir, keep_until_step=self.start if resume else None) if rank == 0 else None
        eval_set = fixed_examples(self.task, cfg.eval.num_prompts, cfg.eval.seed)
        per_rank = len(eval_set) // world
        self.eval_slice = eval_set[rank * per_rank : (rank + 1) * per_rank]  # equal slices: equal forward calls
        self.saved_at = self.start if self.start else None  # the step of the newest checkpoint on disk
        self.bad_run = 0  # consecutive steps skipped for a non-finite loss or gradient
        self.skipped = 0  # steps this process skipped (non-finite, loss-scale overflow)

    def stream(self, name: str) -> str:
        """The name of a per-rank random stream."""
        return name if self.world == 1 else f"{name}/{self.rank}"

    def evaluate(self) -> dict:
        """Accuracy and KL to the start weights on the fixed evaluation prompts (over every rank)."""
        g = self.cfg.grpo
        ev = evaluate(
            self.trainer.module,
            self.tokenizer,
            self.task,
            self.eval_slice,
            seed=self.cfg.eval.seed + self.rank,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            ref_model=self.ref_model,
            stop_early=not self.sharded,
        )
        correct, n, kl_sum, kl_tokens = collectives.summed(
            [ev["correct"], ev["n"], ev["kl_sum"], ev["kl_tokens"]], device=self.device
        )
        return {"eval_accuracy": correct / n, "eval_kl": kl_sum / max(kl_tokens, 1)}

    def write(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def rollouts(self, step: int):
        """Sync the engine to the trainer's weights, sample this step's prompts and generate; with
        verification due, refuse rollouts made with other weights. Returns (rollouts, rewards)."""
        cfg, g = self.cfg, self.cfg.grpo
        rng = random.Random(step_seed(cfg.seed, step, self.stream("prompts")))
        examples = [self.task.sample(rng) for _ in range(g.prompts_per_step // self.world)]
        verify = cfg.rollout.verify_every > 0 and step % cfg.rollout.verify_every == 0
        self.rollout.sync_weights(step - 1, verify=verify)
        ro = self.rollout.generate(
            [e.prompt for e in examples],
            samples_per_prompt=g.samples_per_prompt,
            max_new_tokens=g.max_new_tokens,
            temperature=g.temperature,
            generator=torch.Generator(device=self.device).manual_seed(step_seed(cfg.seed, step, self.stream("sample"))),
            with_digest=verify,
        )
        per_sample = [e for e in examples for _ in range(g.samples_per_prompt)]
        rewards = torch.tensor([self.task.score(t, e) for t, e in zip(ro.texts, per_sample)], device=self.device)
        if verify:
            trainer_digest = self.own_digest()
            if ro.weight_digest != trainer_digest:
                raise RolloutWeightMismatch(
                    f"step {step}: rollouts were generated with weights {ro.weight_digest}, "
                    f"but the trainer holds {trainer_digest}"
                )
        return ro, rewards

    def logprobs(self, ro) -> tuple[torch.Tensor, torch.Tensor]:
        """The completions' token log-probabilities under the trainer (with gradient) and the
        reference model."""
        logits = sequence_logits(
            self.trainer.module, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask
        )
        logp = token_logprobs(logits, ro.completion_ids)
        with torch.no_grad():
            ref_logp = token_logprobs(
                sequence_logits(self.ref_model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask),
                ro.completion_ids,
            )
        return logp, ref_logp

    def mismatch(self, logp: torch.Tensor, ro) -> tuple[dict, torch.Tensor | None]:
        """Rollouts from another engine: the training-inference mismatch metrics, and the
        importance weights of the configured correction (None: no correction)."""
        g = self.cfg.grpo
        if ro.engine_logprobs is None:
            return {}, None
        mismatch = mismatch_metrics(logp, ro.engine_logprobs, ro.completion_mask, threshold=g.mismatch_threshold)
        is_weights, done = importance_weights(
            logp, ro.engine_logprobs, ro.completion_mask, mode=g.is_correction, cap=g.is_cap
        )
        mismatch.update(done)
        return mismatch, is_weights

    def update(self, loss: torch.Tensor) -> tuple[float, bool, bool]:
        """Backward and optimizer step, unless the loss is non-finite on any rank (every rank
        skips together: backward holds collectives). Returns (grad norm, stepped, non-finite)."""
        nonfinite = collectives.summed([0.0 if bool(torch.isfinite(loss.detach())) else 1.0], device=self.device)[0] > 0
        if nonfinite:
            grad_norm, stepped = float("nan"), False
        else:
            self.trainer.backward(loss)
            grad_norm, stepped = self.trainer.step()
            nonfinite = not math.isfinite(grad_norm) and not self.cfg.precision.spec.loss_scaling
        self.bad_run = self.bad_run + 1 if nonfinite else 0
        self.skipped += not stepped
        return grad_norm, stepped, nonfinite

    def step(self, step: int) -> dict:
        """One GRPO step: rollouts, rewards, loss, update; returns its metrics record."""
        g = self.cfg.grpo
        t0 = time.perf_counter()
        ro, rewards = self.rollouts(step)
        logp, ref_logp = self.logprobs(ro)
        mismatch, is_weights = self.mismatch(logp, ro)
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
        grad_norm, stepped, nonfinite = self.update(loss)
        reward, loss_mean, kl_k3 = _all_mean([rewards.mean().item(), loss.item(), stats["kl_k3"]], self.world)
        record = {
            "step": step,
            "reward": reward,
            "loss": loss_mean,
            "grad_norm": grad_norm,
            "kl_k3": kl_k3,
            "weight_version": ro.weight_version,
            "skipped": not stepped,
            "nonfinite": nonfinite,
            **(self.trainer.meter.update() if self.trainer.meter is not None else {}),
        }
        record.update(self.rollout.sync_metrics())  # rank 0's view of the weight sync
        if mismatch:  # every rank has them (same engine kind); means over ranks
            record.update(zip(sorted(mismatch), _all_mean([mismatch[k] for k in sorted(mismatch)], self.world)))
        if step % self.cfg.eval.every == 0 or step == g.steps:
            record.update(self.evaluate())
        record["step_time"] = time.perf_counter() - t0
        return record

    def stop_if_unhealthy(self, step: int) -> None:
        """Stop a run whose last steps were all non-finite, or that skipped too many to train."""
        g = self.cfg.grpo
        if self.bad_run >= MAX_NONFINITE_STEPS:
            saved_at = self.saved_at
            kept = f"the newest checkpoint, step {saved_at}, is kept" if saved_at else "no checkpoint was written"
            raise NonFiniteTraining(
                f"steps {step - self.bad_run + 1}..{step} had a non-finite loss or gradient and were "
                f"skipped; stopping ({kept}). Lower grpo.lr (now {g.lr}) or check the data and "
                "the model"
            )
        if self.skipped > g.max_skipped_fraction * g.steps:
            raise TooManySkippedSteps(
                f"{self.skipped} of the {step - self.start} steps run so far were skipped (a loss scaler "
                "that never finds a finite scale, or gradients that are never finite), more than "
                f"grpo.max_skipped_fraction={g.max_skipped_fraction} of grpo.steps={g.steps}; "
                "stopping instead of finishing untrained. Check precision.initial_loss_scale, "
                f"grpo.lr (now {g.lr}) and the data"
            )

    def save(self, step: int) -> None:
        self.trainer.save(self.out_dir, step)
        self.saved_at = step

    def finish(self, last: int) -> None:
        """The final checkpoint (never rewriting the one 'latest' points at), the writer closed."""
        if self.saved_at != last:
            self.save(last)
        if self.writer is not None:
            self.writer.close()

    def close(self) -> None:
        """Stop what the run started (local rollout engines)."""
        self.rollout.close()


def train(
    cfg: ExperimentConfig,
    *,
    progress: bool = True,
    resume: bool | str = False,
    overwrite: bool = False,
    stop_at: int | None = None,
    make_engine: Callable[[Any, Any], RolloutEngine] | None = None,
    backend: str | None = None,
) -> Path:
    """Run GRPO for ``cfg``; returns the metrics file.

    Runs in one process or, with ``distributed.engine`` deepspeed/fsdp2, on every rank of a
    launcher's process group (each rank samples ``prompts_per_step / world`` prompts; rank 0
    writes metrics). ``resume=True`` continues from the run's checkpoint (an error if there is
    none, if its step is beyond ``grpo.steps``, or if the settings that shape the run changed);
    ``resume="auto"`` does that when a checkpoint exists and otherwise starts fresh, saying so.
    Without resume, an ``output_dir`` that already holds a run is refused unless ``overwrite``
    (which removes its metrics and checkpoints first). ``stop_at`` ends early (with a checkpoint);
    ``make_engine(model, tokenizer)`` replaces the configured rollout engine. ``backend``: the
    process group's (nccl | gloo; default nccl with CUDA) for an engine that joins one.

    A step whose loss is NaN or Inf (or, without loss scaling, whose gradient is) is skipped and
    counted (``nonfinite`` in the metrics); ``MAX_NONFINITE_STEPS`` in a row stop the run with
    ``NonFiniteTraining``, keeping the last good checkpoint.
    """
    if resume not in (False, True, "auto"):
        raise ValueError(f"resume must be False, True or 'auto', got {resume!r}")
    with cpu_matmul(cfg.cpu_matmul):
        run = GRPORun(
            cfg, progress=progress, resume=resume, overwrite=overwrite, make_engine=make_engine, backend=backend
        )
        try:
            return _train_loop(run, cfg, progress=progress, stop_at=stop_at)
        finally:
            run.close()


def _train_loop(run: GRPORun, cfg: ExperimentConfig, *, progress: bool, stop_at: int | None) -> Path:
    g = cfg.grpo
    if run.start == 0:
        run.write({"step": 0, **run.evaluate()})
    last = g.steps if stop_at is None else min(stop_at, g.steps)
    bar = tqdm(
        range(run.start + 1, last + 1),
        desc=f"GRPO {cfg.precision.precision}",
        disable=not progress or run.rank != 0,
        initial=run.start,
        total=g.steps,
    )
    for step in bar:
        record = run.step(step)
        run.write(record)
        run.stop_if_unhealthy(step)
        bar.set_postfix(
            reward=f"{record['reward']:.3f}",
            acc=f"{record.get('eval_accuracy', float('nan')):.3f}",
            kl=f"{record['kl_k3']:.2e}",
        )
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            run.save(step)
    run.finish(last)
    return run.out_dir / "metrics.jsonl"
