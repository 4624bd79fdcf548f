"""The training-inference mismatch: how far the rollout engine's log-probabilities of the tokens it
sampled are from the trainer's, and importance-sampling corrections for it.

With rollouts from another engine (vLLM), GRPO's on-policy ratio ``p_trainer / p_trainer_old`` is
taken against the trainer's own old log-probabilities, but the tokens were drawn from the engine's
distribution. The two differ by kernels and, when the weights differ (an exporter that casts FP32
masters round-to-nearest under SR), by weights. Per step, with ``r_t = log p_trainer(t) -
log p_engine(t)`` on each valid completion token:

- ``mismatch_abs_mean`` / ``mismatch_abs_max``: mean and max of ``|r_t|``;
- ``mismatch_frac_over``: share of tokens with ``|r_t| > threshold``;
- ``mismatch_seq_logratio``: mean over sequences of ``sum_t r_t`` (the log of the sequence's
  importance ratio), ``mismatch_seq_logratio_absmax`` its largest magnitude;
- ``mismatch_kl_k1`` / ``mismatch_kl_k3``: estimates of KL(engine || trainer) from the engine's
  samples, ``-r`` and ``exp(r) - 1 - r`` averaged over tokens (k3 is non-negative, lower variance).

Corrections (``grpo.is_correction``, off by default), as weights on the per-token policy-gradient
term, computed without gradient:

- ``tis``: token-level truncated IS, ``w_t = min(exp(r_t), cap)``;
- ``mis``: sequence-level masked IS: a sequence whose ratio ``exp(sum_t r_t)`` lies outside
  ``[1 / cap, cap]`` is dropped (weight 0), the rest keep weight 1.

When the engine and the trainer agree bit for bit (the embedded engine; vLLM holding the same
bits with the same kernels) every ``r_t`` is 0, every weight is 1 and nothing changes.
"""

from __future__ import annotations

import torch

CORRECTIONS = ("none", "tis", "mis")


def _valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool()


def mismatch_metrics(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, *, threshold: float = 0.1
) -> dict[str, float]:
    """The mismatch metrics above for [N, T] log-probabilities and the completion mask."""
    valid = _valid(mask)
    r = (trainer_logp.detach().float() - engine_logp.float()).masked_fill(~valid, 0.0)
    n = int(valid.sum())
    if n == 0:
        return {}
    a = r.abs()
    seq = r.sum(1)
    rows = valid.any(1)
    k3 = (torch.expm1(r) - r).masked_fill(~valid, 0.0)
    return {
        "mismatch_abs_mean": float(a.sum() / n),
        "mismatch_abs_max": float(a.max()),
        "mismatch_frac_over": float(((a > threshold) & valid).sum() / n),
        "mismatch_seq_logratio": float(seq[rows].mean()),
        "mismatch_seq_logratio_absmax": float(seq[rows].abs().max()),
        "mismatch_kl_k1": float(-r.sum() / n),
        "mismatch_kl_k3": float(k3.sum() / n),
    }


def importance_weights(
    trainer_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor, *, mode: str, cap: float
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """[N, T] weights for the per-token policy-gradient term (``None`` for ``mode="none"``) and
    what they did: ``is_clipped_frac`` (TIS: tokens at the cap) or ``is_masked_frac`` (MIS:
    sequences dropped)."""
    if mode not in CORRECTIONS:
        raise ValueError(f"unknown importance-sampling correction {mode!r}; choose one of {', '.join(CORRECTIONS)}")
    if mode == "none":
        return None, {}
    if not cap > 1.0:
        raise ValueError(f"the importance-sampling cap must be > 1, got {cap}")
    valid = _valid(mask)
    r = (trainer_logp.detach().float() - engine_logp.float()).masked_fill(~valid, 0.0)
    n = max(int(valid.sum()), 1)
    if mode == "tis":
        ratio = torch.exp(r)
        clipped = (ratio > cap) & valid
        return ratio.clamp(max=cap) * valid, {"is_clipped_frac": float(clipped.sum() / n)}
    seq = r.sum(1)
    keep = (seq <= torch.log(torch.tensor(cap))) & (seq >= -torch.log(torch.tensor(cap)))
    rows = valid.any(1)
    dropped = (~keep & rows).sum()
    return keep[:, None].float() * valid, {"is_masked_frac": float(dropped / max(int(rows.sum()), 1))}
