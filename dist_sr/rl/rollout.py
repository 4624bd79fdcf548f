"""Rollout engines behind one small interface, and the sampler they share.

An engine holds a copy of the policy's working weights (or, for the embedded engine, *is* the
policy), generates completions, and tags every batch with the weight version it used and,
when asked, the digest of those weights, so the trainer can prove that rollouts and training
saw the same bits.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Protocol

import torch

from ..replica import combined_digest, weight_digests


@dataclass
class Rollouts:
    prompt_ids: torch.Tensor       # [N, P] left-padded
    prompt_mask: torch.Tensor      # [N, P] 1 for real tokens
    completion_ids: torch.Tensor   # [N, T] padded after EOS
    completion_mask: torch.Tensor  # [N, T] 1 up to and including EOS
    texts: list[str]               # decoded completions (special tokens removed)
    weight_version: int
    weight_digest: str | None


class RolloutEngine(Protocol):
    def sync_weights(self, version: int, verify: bool = True) -> None: ...

    def generate(self, prompts: list[str], *, samples_per_prompt: int, max_new_tokens: int,
                 temperature: float, generator: torch.Generator, with_digest: bool = False) -> Rollouts: ...


def encode_prompts(tokenizer, prompts: list[str], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids (with BOS where the tokenizer has one) and their mask."""
    rows = []
    for ids in tokenizer(prompts, add_special_tokens=True)["input_ids"]:
        if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
            ids = [tokenizer.bos_token_id] + ids
        rows.append(ids)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids.to(device), mask.to(device)


def _cache_argument(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` during 5.x: use what the model takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


@torch.no_grad()
def sample(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, max_new_tokens: int,
           temperature: float, generator: torch.Generator, eos_id: int, pad_id: int, stop_early: bool = True):
    """Sample completions with a KV cache; Gumbel-max with noise from ``generator``, so a fixed
    generator seed gives the same noise (and, for the same weights, the same completions).

    ``stop_early=False`` always runs ``max_new_tokens`` forwards: sharded models (FSDP2, ZeRO-3)
    gather weights inside forward, so every rank must make the same number of calls."""
    n = prompt_ids.shape[0]
    done = torch.zeros(n, dtype=torch.bool, device=prompt_ids.device)
    out_ids, out_mask = [], []
    mask = prompt_mask
    step_ids, pos = prompt_ids, positions(prompt_mask)
    cache, cache_arg = None, _cache_argument(model)
    for _ in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_arg: cache})
        cache = out[cache_arg]
        logits = out.logits[:, -1, :].float() / temperature
        u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
        token = torch.argmax(logits - torch.log(-torch.log(u)), dim=-1)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        out_ids.append(token)
        out_mask.append((~done).long())
        done |= token == eos_id
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step_ids, pos = token[:, None], pos[:, -1:] + 1
        if stop_early and bool(done.all()):
            break
    return torch.stack(out_ids, 1), torch.stack(out_mask, 1)


class EmbeddedEngine:
    """Generates in-process with the trainer's own model object (``transformers`` forward).

    Rollouts therefore use exactly the working weights the training forward pass uses; the
    digest each batch carries is computed from those weights at generation time.
    """

    def __init__(self, model, tokenizer, *, digest_fn=None, stop_early: bool = True):
        self.model, self.tokenizer = model, tokenizer
        self.digest_fn, self.stop_early = digest_fn, stop_early
        self.version = 0

    def sync_weights(self, version: int, verify: bool = True) -> None:
        self.version = version  # same module as the trainer: nothing to copy

    def weight_digest(self) -> str:
        """Digest of the weights generation uses (for sharded models, ``digest_fn`` is the engine's
        layout-free digest, summed from the shards)."""
        return self.digest_fn() if self.digest_fn else combined_digest(weight_digests(self.model))

    def generate(self, prompts, *, samples_per_prompt, max_new_tokens, temperature, generator, with_digest=False):
        ids, mask = encode_prompts(self.tokenizer, prompts, device=generator.device)
        ids = ids.repeat_interleave(samples_per_prompt, 0)
        mask = mask.repeat_interleave(samples_per_prompt, 0)
        was_training = self.model.training
        self.model.eval()
        try:
            comp, comp_mask = sample(self.model, ids, mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                     generator=generator, eos_id=self.tokenizer.eos_token_id,
                                     pad_id=self.tokenizer.pad_token_id, stop_early=self.stop_early)
        finally:
            self.model.train(was_training)
        texts = self.tokenizer.batch_decode(comp * comp_mask + self.tokenizer.pad_token_id * (1 - comp_mask),
                                            skip_special_tokens=True)
        return Rollouts(ids, mask, comp, comp_mask, texts, self.version,
                        self.weight_digest() if with_digest else None)
