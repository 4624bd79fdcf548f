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
from .checkpoint import SMOLLM2, bf16_start, cast_ready, save_bf16, source_note
from .config import ConfigError, ExperimentConfig
from .cpu_math import pinned_isa
from .evaluation import evaluate, fixed_examples
from .grpo import sequence_logits, token_logprobs
from .model import load_pretrained, new_tiny
from .tasks import TASKS

CACHE_VERSION = "warmup-v1"


def cache_key(cfg: ExperimentConfig, device_type: str | None = None) -> str:
    """What names a cached warm-up: its settings, the kind of device it trains on (a GPU's kernels
    give other bits than the CPU's, so a GPU warm-up is not the CPU one) and the instruction set a
    CPU warm-up's kernels are pinned to, if any (``cpu_math``)."""
    w = dataclasses.asdict(cfg.warmup)
    w.pop("cache_dir")
    device_type = training_device().type if device_type is None else device_type
    task = dataclasses.asdict(cfg.task)
    for fields, name, unset in ((task, "gym", None), (w, "pretrained", False)):
        if fields[name] == unset:  # added after these caches were named: left out when unset, names kept
            del fields[name]
    parts = [CACHE_VERSION, dataclasses.asdict(cfg.model), task, w, cfg.grpo.max_new_tokens]
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
    if t.name == "reasoning-gym":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "task.name reasoning-gym asks in the model's own chat template: set model.path to a chat model "
                "(a GGUF file, a Hugging Face directory, or smollm2)"
            )
        g = t.gym
        assert g is not None  # TaskConfig fills it in for reasoning-gym
        return TASKS["reasoning-gym"](
            g.dataset,
            tokenizer=tokenizer,
            params=g.params,
            seed=g.seed,
            size=g.size,
            eval_share=g.eval_share,
            answer=g.answer,
        )
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


def pretrained_warmup(cfg: ExperimentConfig, progress: bool = True) -> Path:
    """A start checkpoint of a pretrained model (``warmup.pretrained``), cached: the BF16 cast of
    ``model.path``, trained in FP32 on the task's right answers alone (each the answer and EOS after
    the prompt: supervised, ``warmup.batch_size`` training-split examples per step in the order
    ``warmup.seed`` draws, AdamW at ``warmup.lr``) until its sampled accuracy on
    ``warmup.eval_prompts`` other training-split prompts reaches ``warmup.target_accuracy``
    (checked every ``warmup.eval_every`` steps, at ``grpo.temperature``) or ``warmup.max_steps``
    pass; saved in BF16 with the tokenizer, as a released checkpoint is. The RL evaluation's held-out
    questions are never trained on here. Each warm-up seed gives another start checkpoint."""
    path = cache_path(cfg)
    if is_cached(cfg):
        return path
    w = cfg.warmup
    if w.distractor_fraction != 0:
        raise ConfigError(
            f"warmup.distractor_fraction={w.distractor_fraction}: the warm-up of a pretrained model trains on "
            "right answers only; set it to 0"
        )
    model, tokenizer = load_pretrained(bf16_start(str(cfg.model.path), w.cache_dir))
    task = make_task(cfg, tokenizer)
    device = training_device()
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=w.lr, weight_decay=0.0)
    rng = random.Random(w.seed)
    held = random.Random(w.seed + 1)
    eval_set = [task.sample(held) for _ in range(w.eval_prompts)]  # training split: RL's eval stays unseen

    def accuracy_now() -> float:
        return evaluate(
            model,
            tokenizer,
            task,
            eval_set,
            seed=w.seed + 2,
            max_new_tokens=cfg.grpo.max_new_tokens,
            temperature=cfg.grpo.temperature,
        )["accuracy"]

    accuracy, step = accuracy_now(), 0
    history = [(0, accuracy)]
    bar = tqdm(range(1, w.max_steps + 1), desc="warm-up (SFT)", disable=not progress, leave=False)
    for step in bar:
        if accuracy >= w.target_accuracy:
            step -= 1
            break
        batch = [task.sample(rng) for _ in range(w.batch_size)]
        ids, mask = encode_prompts(tokenizer, [e.prompt for e in batch], device=device)
        tgt, tgt_mask = (t.to(device) for t in encode_targets(tokenizer, [e.answer for e in batch]))
        logp = token_logprobs(sequence_logits(model, ids, mask, tgt, tgt_mask), tgt)
        loss = -(logp * tgt_mask).sum() / tgt_mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % w.eval_every == 0:
            accuracy = accuracy_now()
            history.append((step, accuracy))
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{accuracy:.3f}")
    out = save_bf16(model.to("cpu"), tokenizer, path, f"{source_note(cfg.model.path)}, warmed up (seed {w.seed})")
    record = {"steps": step, "accuracy": accuracy, "history": history, "key": cache_key(cfg)}
    (out / "warmup.json").write_text(json.dumps(record))
    return out


def _hub_id(path: str) -> bool:
    local = Path(path).expanduser()
    return path != SMOLLM2 and not local.exists() and not (str(path).startswith((".", "/", "~")) or local.suffix)


def start_ready(cfg: ExperimentConfig) -> bool:
    """Whether ``cfg``'s start checkpoint is on disk already (warm-up cached, BF16 cast written)."""
    path = cfg.model.path
    if path is None or cfg.warmup.pretrained:
        return is_cached(cfg)
    return _hub_id(path) or cast_ready(path, cfg.warmup.cache_dir)


def start_checkpoint(cfg: ExperimentConfig, progress: bool = True) -> str:
    """The BF16 checkpoint a run starts from: the warmed-up tiny model (``model.path`` unset), the
    BF16 cast of ``model.path`` (a GGUF file, a directory, ``smollm2``; ``checkpoint``), or with
    ``warmup.pretrained`` that cast after its warm-up (``pretrained_warmup``); the trainer and the
    rollout engines both load it. A hub id is passed through unchanged."""
    path = cfg.model.path
    if path is None:
        return str(warmup_checkpoint(cfg, progress=progress))
    if cfg.warmup.pretrained:
        return str(pretrained_warmup(cfg, progress=progress))
    if _hub_id(path):
        return path  # a hub id: from_pretrained resolves it (where the machine has network access)
    return str(bf16_start(path, cfg.warmup.cache_dir))
