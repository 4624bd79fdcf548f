"""The GRPO training loop, top to bottom: rollouts, rewards, loss, step, metrics, checkpoints.

Under every precision the rollout engine generates with the trainer's working weights; every
``rollout.verify_every`` steps the digest the rollouts carry is checked against the trainer's
own digest of the weights its forward pass is about to use.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch
import yaml
from tqdm import tqdm

from ..optim import ShadowOptimizer
from ..precision import apply_precision
from .config import ExperimentConfig, to_dict
from .evaluation import evaluate, fixed_examples
from .grpo import group_advantages, grpo_loss, sequence_logits, token_logprobs
from .model import load_pretrained
from .rollout import EmbeddedEngine, RolloutEngine
from .warmup import make_task, warmup_checkpoint

CHECKPOINT = "checkpoint.pt"


class RolloutWeightMismatch(RuntimeError):
    pass


def step_seed(seed: int, step: int, stream: str) -> int:
    """A seed for one step's randomness: runs resume and compare without carrying RNG state."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{step}/{stream}".encode(), digest_size=8).digest(), "little")


class MetricsWriter:
    """Appends one JSON object per line; mirrors scalars to TensorBoard when it is installed."""

    def __init__(self, out_dir: Path, keep_until_step: int | None = None):
        self.path = out_dir / "metrics.jsonl"
        if keep_until_step is not None and self.path.exists():  # resuming: drop what comes after
            kept = [line for line in self.path.read_text().splitlines()
                    if line and json.loads(line)["step"] <= keep_until_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        elif keep_until_step is None:
            self.path.write_text("")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def jitter_shadows_(optimizer: ShadowOptimizer, seed: int) -> None:
    """Move each FP32 shadow to a uniform random point within its BF16 rounding cell.

    Round-to-nearest still gives the same BF16 weights, but the shadows no longer sit on the
    grid with a full half-step dead zone: the control that shows where BF16's lag comes from.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p, s in optimizer.named_shadows():
            up = (p.data.view(torch.int16) + 1).view(torch.bfloat16).float().abs()  # next value up in magnitude
            spacing = (up - p.data.float().abs()).nan_to_num(0.0)
            u = torch.rand(s.shape, generator=g) - 0.5
            s.add_(u * 0.999 * spacing * torch.sign(s))
        optimizer._write_working()


def save_checkpoint(out_dir: Path, step: int, model, precision) -> None:
    """Write the checkpoint atomically: a crash leaves the previous one intact."""
    tmp = out_dir / (CHECKPOINT + ".tmp")
    torch.save({"step": step, "model": model.state_dict(), "precision": precision.state_dict()}, tmp)
    os.replace(tmp, out_dir / CHECKPOINT)


def train(cfg: ExperimentConfig, *, progress: bool = True, resume: bool = False, stop_at: int | None = None,
          make_engine: Callable[[Any, Any], RolloutEngine] | None = None) -> Path:
    """Run GRPO for ``cfg``; returns the metrics file.

    ``resume`` continues from ``output_dir/checkpoint.pt``; ``stop_at`` ends early (with a
    checkpoint); ``make_engine(model, tokenizer)`` replaces the configured rollout engine.
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    task = make_task(cfg)
    model_path = cfg.model.path or warmup_checkpoint(cfg, progress=progress)
    model, tokenizer = load_pretrained(model_path)
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)  # FP32 copy of the start weights
    g = cfg.grpo
    precision = apply_precision(model, cfg.precision, torch.optim.AdamW, lr=g.lr, betas=g.betas, eps=g.eps,
                                weight_decay=g.weight_decay)
    if cfg.shadow_jitter:
        jitter_shadows_(precision.optimizer, step_seed(cfg.seed, 0, "jitter"))

    meter = precision.sticking_meter()  # measures from the run's start, also across a resume
    start = 0
    ckpt = out_dir / CHECKPOINT
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        precision.load_state_dict(state["precision"])  # re-derives the working weights
        saved = state["model"]
        if any(not torch.equal(saved[k], v) for k, v in model.state_dict().items()):
            raise RuntimeError(f"{ckpt}: working weights re-derived from the shadows differ from the saved ones")
        start = state["step"]
        meter.sync_previous()
    writer = MetricsWriter(out_dir, keep_until_step=start if resume else None)
    engine = (make_engine or EmbeddedEngine)(model, tokenizer)
    eval_set = fixed_examples(task, cfg.eval.num_prompts, cfg.eval.seed)

    def run_eval() -> dict:
        ev = evaluate(model, tokenizer, task, eval_set, seed=cfg.eval.seed, max_new_tokens=g.max_new_tokens,
                      temperature=g.temperature, ref_model=ref_model)
        return {"eval_accuracy": ev["accuracy"], "eval_kl": ev["kl"]}

    if start == 0:
        writer.write({"step": 0, **run_eval()})
    last = g.steps if stop_at is None else min(stop_at, g.steps)
    bar = tqdm(range(start + 1, last + 1), desc=f"GRPO {cfg.precision.precision}", disable=not progress,
               initial=start, total=g.steps)
    record: dict = {}
    for step in bar:
        t0 = time.perf_counter()
        rng = random.Random(step_seed(cfg.seed, step, "prompts"))
        examples = [task.sample(rng) for _ in range(g.prompts_per_step)]
        verify = cfg.rollout.verify_every > 0 and step % cfg.rollout.verify_every == 0
        engine.sync_weights(step - 1)
        ro = engine.generate([e.prompt for e in examples], samples_per_prompt=g.samples_per_prompt,
                             max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                             generator=torch.Generator().manual_seed(step_seed(cfg.seed, step, "sample")),
                             with_digest=verify)
        answers = [e.answer for e in examples for _ in range(g.samples_per_prompt)]
        rewards = torch.tensor([task.reward(t, a) for t, a in zip(ro.texts, answers)])
        if verify and ro.weight_digest != precision.digest():
            raise RolloutWeightMismatch(f"step {step}: rollouts were generated with weights {ro.weight_digest}, "
                                        f"but the trainer holds {precision.digest()}")
        logits = sequence_logits(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        logp = token_logprobs(logits, ro.completion_ids)
        with torch.no_grad():
            ref_logp = token_logprobs(sequence_logits(ref_model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                                      ro.completion_mask), ro.completion_ids)
        loss, stats = grpo_loss(logp, logp.detach(), group_advantages(rewards, g.samples_per_prompt),
                                ro.completion_mask, clip_eps=g.clip_eps, ref_logp=ref_logp, kl_coef=g.kl_coef)
        precision.zero_grad()
        precision.backward(loss)
        grad_norm = precision.clip_grad_norm_(g.max_grad_norm)
        stepped = precision.step()
        record = {"step": step, "reward": rewards.mean().item(), "loss": loss.item(),
                  "grad_norm": float(grad_norm), "kl_k3": stats["kl_k3"], "weight_version": ro.weight_version,
                  "skipped": not stepped, **meter.update()}
        if step % cfg.eval.every == 0 or step == g.steps:
            record.update(run_eval())
        record["step_time"] = time.perf_counter() - t0
        writer.write(record)
        bar.set_postfix(reward=f"{record['reward']:.3f}", acc=f"{record.get('eval_accuracy', float('nan')):.3f}",
                        kl=f"{record['kl_k3']:.2e}", changed=f"{record['changed_frac']:.3f}")
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save_checkpoint(out_dir, step, model, precision)
    save_checkpoint(out_dir, last, model, precision)
    writer.close()
    return writer.path
