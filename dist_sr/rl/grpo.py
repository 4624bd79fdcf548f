"""GRPO's arithmetic as pure functions: group advantages, token log-probs, clipped loss, KL."""

from __future__ import annotations

import torch

from ..rollout.sampling import positions


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)`` for rewards laid out group after group.

    The standard deviation is the population one (divide by the group size); a group whose
    rewards are all equal gets zero advantages.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size).float()
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + eps)
    return adv.view(-1)


def sequence_logits(model, prompt_ids, prompt_mask, comp_ids, comp_mask) -> torch.Tensor:
    """FP32 logits at the positions that predict each completion token: ``[N, T, V]``."""
    ids = torch.cat([prompt_ids, comp_ids], 1)
    mask = torch.cat([prompt_mask, comp_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
    p = prompt_ids.shape[1]
    return logits[:, p - 1 : -1, :].float()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference) on tokens sampled from the policy."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def masked_mean_per_sequence(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's valid tokens, then over sequences."""
    m = mask.float()
    return ((x * m).sum(1) / m.sum(1).clamp_min(1)).mean()


def grpo_loss(
    logp, old_logp, advantages, mask, *, clip_eps: float, ref_logp=None, kl_coef: float = 0.0, is_weights=None
):
    """Clipped policy-gradient loss with an optional k3 KL penalty; returns (loss, stats).
    ``is_weights`` ([N, T], no gradient) multiply the policy-gradient term per token: an
    importance-sampling correction for rollouts from another engine (``rl.mismatch``)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if is_weights is not None:
        pg = pg * is_weights.detach()
    per_token = pg
    stats = {}
    if ref_logp is not None:
        kl = k3_kl(logp, ref_logp)
        stats["kl_k3"] = masked_mean_per_sequence(kl.detach(), mask).item()
        if kl_coef:
            per_token = per_token + kl_coef * kl
    loss = masked_mean_per_sequence(per_token, mask)
    clipped = ((ratio - 1).abs() > clip_eps).float()
    stats["clip_frac"] = masked_mean_per_sequence(clipped, mask).item()
    return loss, stats


def exact_kl(policy_logits: torch.Tensor, ref_logits: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(policy || reference) summed over the vocabulary, averaged over valid positions."""
    lp, lq = torch.log_softmax(policy_logits, -1), torch.log_softmax(ref_logits, -1)
    per_pos = (lp.exp() * (lp - lq)).sum(-1)
    m = mask.float()
    return float((per_pos * m).sum() / m.sum().clamp_min(1))
