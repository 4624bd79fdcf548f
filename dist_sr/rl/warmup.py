"""Supervised warm-up of a from-config model to partial accuracy, cached on disk.

RL needs room to improve: the tiny model is trained on a mix of right answers and a wrong
"distractor" (for digit reversal: the copy) until its sampled accuracy reaches the target. The
checkpoint is saved in BF16, as released checkpoints are, so FP32 shadows start on the BF16 grid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from ..engines import training_device
from ..rollout.base import encode_prompts
from .checkpoint import SMOLLM2, bf16_start, cast_ready
from .config import ConfigError, ExperimentConfig
from .cpu_math import pinned_isa
from .evaluation import evaluate, fixed_examples
from .grpo import sequence_logits, token_logprobs
from .model import new_tiny
from .tasks import TASKS

CACHE_VERSION = "warmup-v1"


def cache_key(cfg: ExperimentConfig, device_type: str | None = None) -> str:
    """What names a cached warm-up: its settings, the kind of device it trains on (a GPU's kernels
    give other bits than the CPU's, so a GPU warm-up is not the CPU one) and the instruction set a
    CPU warm-up's kernels are pinned to, if any (``cpu_math``)."""
    w = dataclasses.asdict(cfg.warmup)
    w.pop("cache_dir")
    device_type = training_device().type if device_type is None else device_type
    parts = [CACHE_VERSION, dataclasses.asdict(cfg.model), dataclasses.asdict(cfg.task), w, cfg.grpo.max_new_tokens]
    if device_type != "cpu":  # unpinned CPU warm-ups keep the names they always had
        parts.append(device_type)
    elif (isa := pinned_isa()) is not None:
        parts.append(f"cpu-isa-{isa}")
    blob = json.dumps(parts, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def make_task(cfg: ExperimentConfig, tokenizer=None):
    """The task of ``cfg``; ``chat-add`` asks in ``tokenizer``'s chat template (the policy's own)."""
    t = cfg.task
    if t.name == "chat-add":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "task.name chat-add asks in the model's own chat template: set model.path to a chat model "
                "(a GGUF file, a Hugging Face directory, or smollm2)"
            )
        return TASKS["chat-add"](t.num_digits, tokenizer=tokenizer, question=t.question)
    if t.name == "dataset":
        return TASKS["dataset"](t.source, t.split, t.prompt_field, t.answer_field, t.answer_format)
    return TASKS[t.name](t.num_digits)


def encode_targets(tokenizer, targets: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in targets]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def cache_path(cfg: ExperimentConfig) -> Path:
    """Where ``cfg``'s warm-up checkpoint is cached (complete once it holds ``warmup.json``)."""
    return Path(cfg.warmup.cache_dir) / f"warmup-{cache_key(cfg)}"


def is_cached(cfg: ExperimentConfig) -> bool:
    return (cache_path(cfg) / "warmup.json").exists()


def warmup_checkpoint(cfg: ExperimentConfig, progress: bool = True) -> Path:
    """Path of the cached warm-up checkpoint for ``cfg``, training it first if needed. With
    ``warmup.enabled: false`` it is the freshly initialised tiny model, on the BF16 grid."""
    path = cache_path(cfg)
    if is_cached(cfg):
        return path
    w = cfg.warmup
    task = make_task(cfg)
    if w.enabled and not hasattr(task, "distractor"):
        raise ValueError(f"task {task.name!r} has no distractor answers; warm up only generated tasks")
    model, tokenizer = new_tiny(cfg.model)
    device = training_device()  # a GPU when there is one: the larger experiments warm up there too
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr)
    rng = random.Random(w.seed)
    eval_set = fixed_examples(task, w.eval_prompts, w.seed + 1)
    accuracy, step = 0.0, 0
    bar = tqdm(range(1, (w.max_steps if w.enabled else 0) + 1), desc="warm-up (SFT)", disable=not progress, leave=False)
    for step in bar:
        batch = [task.sample(rng) for _ in range(w.batch_size)]
        targets = [task.distractor(e) if rng.random() < w.distractor_fraction else e.answer for e in batch]
        ids, mask = encode_prompts(tokenizer, [e.prompt for e in batch], device=device)
        tgt, tgt_mask = (t.to(device) for t in encode_targets(tokenizer, targets))
        logp = token_logprobs(sequence_logits(model, ids, mask, tgt, tgt_mask), tgt)
        loss = -(logp * tgt_mask).sum() / tgt_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % w.eval_every == 0:
            accuracy = evaluate(
                model, tokenizer, task, eval_set, seed=w.seed + 2, max_new_tokens=cfg.grpo.max_new_tokens
            )["accuracy"]
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{accuracy:.3f}")
            if accuracy >= w.target_accuracy:
                break
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to("cpu", torch.bfloat16).save_pretrained(tmp)  # on the BF16 grid, as released checkpoints are
    tokenizer.save_pretrained(tmp)
    (tmp / "warmup.json").write_text(json.dumps({"steps": step, "accuracy": accuracy, "key": cache_key(cfg)}))
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def _hub_id(path: str) -> bool:
    local = Path(path).expanduser()
    return path != SMOLLM2 and not local.exists() and not (str(path).startswith((".", "/", "~")) or local.suffix)


def start_ready(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg``'s start checkpoint is on disk already (warm-up cached, BF16 cast written)."""
    path = cfg.model.path
    if path is None:
        return is_cached(cfg)
    return _hub_id(path) or cast_ready(path, cfg.warmup.cache_dir)


def start_checkpoint(cfg: ExperimentConfig, progress: bool = True) -> str:
    """The BF16 checkpoint a run starts from: the warmed-up tiny model (``model.path`` unset), or
    the BF16 cast of ``model.path`` (a GGUF file, a directory, ``smollm2``; ``checkpoint``), which
    the trainer and the rollout engines both load. A hub id is passed through unchanged."""
    path = cfg.model.path
    if path is None:
        return str(warmup_checkpoint(cfg, progress=progress))
    if _hub_id(path):
        return path  # a hub id: from_pretrained resolves it (where the machine has network access)
    return str(bf16_start(path, cfg.warmup.cache_dir))
