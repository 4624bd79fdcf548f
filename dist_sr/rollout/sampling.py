"""Sampling completions from a local ``transformers`` model with a KV cache."""

from __future__ import annotations

import inspect

import torch


def cache_argument(model) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` during 5.x: use what the model takes."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).clamp_min(0)


@torch.no_grad()
def sample(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator,
    eos_id: int,
    pad_id: int,
    stop_early: bool = True,
):
    """Sample completions with a KV cache; Gumbel-max with noise from ``generator``, so a fixed
    generator seed gives the same noise (and, for the same weights, the same completions).

    ``stop_early=False`` always runs ``max_new_tokens`` forwards: sharded models (FSDP2, ZeRO-3)
    gather weights inside forward, so every rank must make the same number of calls."""
    n = prompt_ids.shape[0]
    done = torch.zeros(n, dtype=torch.bool, device=prompt_ids.device)
    out_ids, out_mask = [], []
    mask = prompt_mask
    step_ids, pos = prompt_ids, positions(prompt_mask)
    cache, cache_arg = None, cache_argument(model)
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
