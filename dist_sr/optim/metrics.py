"""Weight-sticking metrics: does the working (BF16) copy follow the optimizer's updates?"""

from __future__ import annotations

import torch


class StickingMeter:
    """Per-step sticking metrics for a set of working weights and (optionally) their shadows.

    - ``changed_frac``: fraction of working-weight elements whose bits changed in the last step.
    - ``unfollowed_frac``: the ``unfollowed_frac`` function below over the window since the meter
      started (``dS = S_t - S_0``, ``dW = W_t - W_0``). ``None`` without shadows or before the
      shadows move.
    - ``dead_zone_frac``: fraction of this step's non-zero updates of the full-precision weights
      (the shadows, or FP32 working weights) smaller than half the BF16 spacing at the weight, the
      updates round-to-nearest from a BF16 grid point drops on arrival. ``None`` when the
      full-precision weights are not visible (pure BF16) or nothing moved.

    Memory: a copy of the working weights (their dtype) and, with shadows, two of the shadows (FP32).
    """

    def __init__(self, named_working: list[tuple[str, torch.Tensor]], shadows: list[torch.Tensor] | None = None):
        self.names = [n for n, _ in named_working]
        self.working = [w for _, w in named_working]
        self.shadows = shadows
        if shadows is not None and len(shadows) != len(self.working):
            raise ValueError("one shadow per working tensor is required")
        self._prev = [w.detach().clone() for w in self.working]
        self._w0 = [w.detach().float() for w in self.working] if shadows is not None else None
        self._s0 = [s.detach().clone() for s in shadows] if shadows is not None else None
        self._s_prev = [s.detach().clone() for s in shadows] if shadows is not None else None

    @classmethod
    def for_optimizer(cls, optimizer) -> StickingMeter:
        """A meter over a ShadowOptimizer (with shadows) or any optimizer with named groups."""
        if hasattr(optimizer, "named_shadows"):
            triples = optimizer.named_shadows()
            return cls([(n, p) for n, p, _ in triples], [s for _, _, s in triples])
        named = [(n, p) for g in optimizer.param_groups for n, p in zip(g["param_names"], g["params"])]
        return cls(named)

    @torch.no_grad()
    def sync_previous(self) -> None:
        """Take the current working weights as the last step's (after loading a checkpoint)."""
        for prev, w in zip(self._prev, self.working):
            prev.copy_(w)
        for prev, s in zip(self._s_prev or [], self.shadows or []):
            prev.copy_(s)

    @torch.no_grad()
    def update(self) -> dict[str, float | None]:
        """Metrics for the step since the last call (call once after each optimizer step)."""
        changed = total = small = moved = 0
        if self.shadows is not None:
            full = list(zip(self._s_prev, self.shadows))  # type: ignore[arg-type]  # set with shadows
        elif self.working and all(w.dtype == torch.float32 for w in self.working):
            full = list(zip(self._prev, self.working))
        else:
            full = None  # pure BF16: the updates before rounding are not visible
        for before, after in full or []:  # before the working copies below are refreshed
            s_small, s_moved = dead_zone_counts(before, after.detach())
            small, moved = small + s_small, moved + s_moved
            if self.shadows is not None:
                before.copy_(after)
        for prev, w in zip(self._prev, self.working):
            changed += int((prev.view(-1) != w.detach().view(-1)).sum())  # NaN != NaN counts as changed
            total += w.numel()
            prev.copy_(w)
        metrics: dict[str, float | None] = {
            "changed_frac": changed / max(total, 1),
            "unfollowed_frac": None,
            "dead_zone_frac": small / moved if moved else None,
        }
        if self.shadows is not None:
            dot = norm2 = 0.0  # summed in Python: the shadows may sit on any device
            for w0, s0, w, s in zip(self._w0, self._s0, self.working, self.shadows):  # type: ignore[arg-type]
                piece_dot, piece_norm2 = follow_sums(s0, s, w0, w).tolist()
                dot, norm2 = dot + piece_dot, norm2 + piece_norm2
            metrics["unfollowed_frac"] = unfollowed_frac(dot, norm2)
        return metrics


def follow_sums(
    shadow_before: torch.Tensor, shadow: torch.Tensor, working_before: torch.Tensor, working: torch.Tensor
) -> torch.Tensor:
    """``[<dW, dS>, <dS, dS>]`` (float64, shape ``(2,)``, on the tensors' device) for one tensor's
    move over a window: ``dS = shadow - shadow_before`` (the full-precision weights, subtracted in
    their dtype), ``dW = working - working_before`` (the rounded working weights, in float64). Add
    it up over tensors (and ranks) and pass the sums to ``unfollowed_frac``."""
    ds = (shadow - shadow_before).double()
    dw = working.double() - working_before.double()
    return torch.stack([(dw * ds).sum(), (ds * ds).sum()])


def unfollowed_frac(dot: float, norm2: float) -> float | None:
    """The share of the full-precision weights' movement ``dS`` over a window that the working
    weights' movement ``dW`` did not follow: ``1 - <dW, dS> / <dS, dS>``, from ``follow_sums``
    added up over every tensor. Round-to-nearest that sticks gives ~1; unbiased rounding gives ~0,
    since ``E[dW] = dS``. ``None`` when nothing moved (``<dS, dS> = 0``); NaN when a weight is not
    finite. The window is the caller's: ``StickingMeter`` measures since the meter started, the
    TRL callback (``dist_sr/unfollowed_frac``) since its previous log."""
    return None if norm2 == 0.0 else 1.0 - dot / norm2


def bf16_spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance (FP32) from ``bf16(x)`` (round to nearest) to the next BF16 value away from
    zero; NaN or Inf at Inf, NaN and the largest finite value. Half of it is the largest update
    round-to-nearest can drop at a weight on the BF16 grid."""
    b = x.to(torch.bfloat16)
    up = (b.view(torch.int16) + 1).view(torch.bfloat16).float().abs()  # next magnitude up (sign kept)
    return up - b.float().abs()


def dead_zone_counts(before: torch.Tensor, after: torch.Tensor) -> tuple[int, int]:
    """(updates smaller than half the BF16 spacing at ``before``, non-zero updates), finite ones only."""
    step = (after.float() - before.float()).view(-1)
    half = bf16_spacing(before.float()).view(-1) / 2
    moved = (step != 0) & torch.isfinite(step) & torch.isfinite(half)
    return int((moved & (step.abs() < half)).sum()), int(moved.sum())


class ChangedShare:
    """The share of working-weight elements whose bits changed since the last observation,
    estimated on a fixed sample: the elements whose index in the full parameter is a multiple of
    ``stride``. The sample depends on global indices only, so every rank of any layout (FSDP2
    shards, ZeRO partitions, a replica's slice) samples its own part of one set, and the ranks'
    counts add up. Memory: 2 bytes per ``stride`` local elements (a copy of the sample), against
    a full copy for an exact count; the estimate's standard error is ``sqrt(p (1 - p) / n)`` for
    ``n`` sampled elements (0.0014 at p = 0.26, a 135M-parameter model and the default stride)."""

    def __init__(self, stride: int = 1009):  # a prime: no alignment with row lengths
        if stride < 1:
            raise ValueError(f"stride must be at least 1, got {stride}")
        self.stride = stride
        self._previous: dict[tuple[str, int], torch.Tensor] = {}

    @torch.no_grad()
    def observe(self, pieces) -> tuple[int, int]:
        """``(changed, sampled)`` on this rank since the previous call, over ``pieces`` (each with
        ``name``, ``start`` (the global index of its first element) and flat ``bits``: a
        ``WeightSource``'s ``LocalPiece``s); ``(0, n)`` for a piece seen for the first time. Sum
        both over ranks for the share."""
        changed = sampled = 0
        for piece in pieces:
            name, start = piece.name, int(piece.start)
            first = (-start) % self.stride
            sample = piece.bits.reshape(-1)[first :: self.stride]
            words = sample.view({2: torch.int16, 4: torch.int32, 1: torch.uint8, 8: torch.int64}[sample.element_size()])
            key = (name, start)
            before = self._previous.get(key)
            if before is not None and before.shape == words.shape:
                changed += int((before != words).sum())
                before.copy_(words)
            else:
                self._previous[key] = words.clone()
            sampled += words.numel()
        return changed, sampled
