"""Evaluation on fixed prompts with fixed sampling noise: accuracy and exact KL to a reference."""

from __future__ import annotations

import random

import torch

from ..rollout.base import encode_prompts
from ..rollout.sampling import sample
from .grpo import exact_kl, sequence_logits
from .tasks import Example, Task


def fixed_examples(task: Task, n: int, seed: int) -> list[Example]:
    """``n`` evaluation examples drawn with ``seed`` (from the task's held-out split, if it has one)."""
    rng = random.Random(seed)
    return [task.sample_eval(rng) for _ in range(n)]


@torch.no_grad()
def evaluate(
    model,
    tokenizer,
    task: Task,
    examples: list[Example],
    *,
    seed: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    ref_model=None,
    batch_size: int = 512,
    stop_early: bool = True,
) -> dict[str, float]:
    """Sampled accuracy (the share of completions the task scores 1.0, i.e. solved) and exact KL to
    ``ref_model`` at the answer positions, on ``examples``.

    The sampling noise comes from a generator seeded with ``seed``: every evaluation of every run
    draws the same noise, so differences between runs come from the weights alone.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    correct, kl_sum, kl_n = 0.0, 0.0, 0
    try:
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            ids, mask = encode_prompts(tokenizer, [e.prompt for e in chunk], device=device)
            comp, comp_mask = sample(
                model,
                ids,
                mask,
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                generator=generator,
                eos_id=tokenizer.eos_token_id,
                pad_id=tokenizer.pad_token_id,
                stop_early=stop_early,
            )
            texts = tokenizer.batch_decode(
                comp * comp_mask + tokenizer.pad_token_id * (1 - comp_mask), skip_special_tokens=True
            )
            correct += sum(float(task.score(t, e) >= 1.0) for t, e in zip(texts, chunk))
            if ref_model is not None:
                lp = sequence_logits(model, ids, mask, comp, comp_mask)
                lq = sequence_logits(ref_model, ids, mask, comp, comp_mask)
                n_tok = int(comp_mask.sum())
                kl_sum += exact_kl(lp, lq, comp_mask) * n_tok
                kl_n += n_tok
    finally:
        model.train(was_training)
    out = {"accuracy": correct / len(examples), "correct": correct, "n": len(examples)}
    if ref_model is not None:
        out.update(kl=kl_sum / max(kl_n, 1), kl_sum=kl_sum, kl_tokens=kl_n)
    return out
