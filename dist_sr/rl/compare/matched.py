"""The paper's second claim on a comparison's data: raising the BF16 learning rate buys back the
speed round-to-nearest loses, but drifts further from the reference; SR at the base rate does not.
Measured as the KL to the start checkpoint gained at matched accuracy, per seed, with the spread
over seeds.

For each start checkpoint and seed, the raised-lr BF16 run (precision ``bf16``, ``lr_scale`` > 1)
and the reference (``bf16-sr`` at scale 1) each give a curve of (accuracy gain since step 0, KL)
at the evaluated steps. The matched gain is the largest both reach (the smaller of their best
gains); each run's KL there is read off its curve where it first reaches that gain (linear between
the two evaluations around it). No matched gain (either run never gains): no value for that seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import Cell, CompareConfig, cells, run_dir, run_seeds
from .summary import Summary, eval_curve, interval, mean, off_policy, std


@dataclass(frozen=True)
class MatchedKL:
    """One raised-lr BF16 cell against the reference at one learning rate of the comparison."""

    raised: str  # the raised-lr cell's label
    reference: str
    lr_scale: float
    per_run: list[tuple[int, int, float | None, float | None, float | None]]  # start, seed, gain, KL raised, KL ref
    mean_raised: float | None
    mean_reference: float | None
    std_raised: float | None  # over the runs with a matched gain
    std_reference: float | None
    higher: int  # runs where the raised-lr run's KL is the higher one
    matched: int  # runs with a matched gain


def kl_at_gain(curve: list[tuple[float, float]], target: float) -> float | None:
    """The KL where a (gain, KL) curve, in step order, first reaches ``target`` gain (linear between
    evaluations), or None if it never does."""
    prev: tuple[float, float] | None = None
    for gain, kl in curve:
        if gain >= target:
            if prev is None or gain == prev[0]:
                return kl
            frac = (target - prev[0]) / (gain - prev[0])
            return prev[1] + max(0.0, min(1.0, frac)) * (kl - prev[1])
        prev = (gain, kl)
    return None


def _curve(rows: list[dict]) -> list[tuple[float, float]]:
    """(accuracy gain, KL gain) since the first evaluation, at each evaluated step: a BF16 policy
    already differs from the FP32 reference at step 0 (its forward pass rounds), and that offset is
    the same for every BF16 run, so the drift is what is added to it."""
    acc, kl = eval_curve(rows, "eval_accuracy"), eval_curve(rows, "eval_kl")
    steps = sorted(set(acc) & set(kl))
    if not steps:
        return []
    return [(acc[s] - acc[steps[0]], kl[s] - kl[steps[0]]) for s in steps]


def _read(cfg: CompareConfig, cell: Cell, start: int, seed: int) -> list[dict]:
    from ..metrics import read_metrics

    return read_metrics(run_dir(cfg, cell, start, seed) / "metrics.jsonl")


def matched_kl(cfg: CompareConfig) -> list[MatchedKL]:
    """One ``MatchedKL`` per raised-lr BF16 cell that has a reference cell at its learning rate."""
    out = []
    by_label = {c.label: c for c in cells(cfg)}
    for cell in cells(cfg):
        spec = cell.spec
        if spec.precision != "bf16" or spec.lr_scale <= 1 or spec.shadow_jitter:
            continue
        ref = next(
            (
                c
                for c in by_label.values()
                if c.spec.name == cfg.reference and c.lr == cell.lr and c.spec.lr_scale == 1.0
            ),
            None,
        )
        if ref is None:
            continue
        seeds = sorted(set(run_seeds(cfg, cell)) & set(run_seeds(cfg, ref)))
        per_run: list[tuple[int, int, float | None, float | None, float | None]] = []
        for start in cfg.start_seeds:
            for seed in seeds:
                a, b = _curve(_read(cfg, cell, start, seed)), _curve(_read(cfg, ref, start, seed))
                gain = min(max((g for g, _ in a), default=0.0), max((g for g, _ in b), default=0.0))
                if not a or not b or gain <= 0:
                    per_run.append((start, seed, None, None, None))
                    continue
                per_run.append((start, seed, gain, kl_at_gain(a, gain), kl_at_gain(b, gain)))
        done = [(r, f) for _, _, g, r, f in per_run if g is not None and r is not None and f is not None]
        raised = [r for r, _ in done]
        refs = [f for _, f in done]
        out.append(
            MatchedKL(
                raised=cell.label,
                reference=ref.label,
                lr_scale=spec.lr_scale,
                per_run=per_run,
                mean_raised=mean(raised) if raised else None,
                mean_reference=mean(refs) if refs else None,
                std_raised=std(raised) if len(raised) > 1 else None,
                std_reference=std(refs) if len(refs) > 1 else None,
                higher=sum(r > f for r, f in done),
                matched=len(done),
            )
        )
    return out


def _fmt(v: float | None, p: int = 5) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{p}f}"


def matched_lines(results: list[MatchedKL]) -> list[str]:
    """The report's section: per run, then mean ± std over runs, and what it says."""
    if not results:
        return []
    lines = [
        "## KL to the reference at matched accuracy (the paper's second claim)",
        "",
        "Per start checkpoint and seed: the largest accuracy gain both runs reach, and the exact "
        "KL(policy || start) each run has added since step 0 where it first reaches it (linear between "
        "evaluations; a BF16 policy's KL at step 0 is its forward pass's rounding, the same for both).",
        "",
        "| raised-lr bf16 | vs | start | seed | matched gain | KL added, raised-lr bf16 | KL added, reference "
        "| ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in results:
        for start, seed, gain, r, f in m.per_run:
            ratio = f"{r / f:.2f}x" if r is not None and f else "—"
            lines.append(
                f"| {m.raised} | {m.reference} | {start} | {seed} | {_fmt(gain, 3)} | {_fmt(r)} | {_fmt(f)} | {ratio} |"
            )
    lines.append("")
    for m in results:
        if not m.matched:
            lines.append(f"- {m.raised} vs {m.reference}: no run where both gained accuracy; nothing to match.")
            continue
        spread = (
            f" (std over runs {_fmt(m.std_raised)} and {_fmt(m.std_reference)})" if m.std_raised is not None else ""
        )
        lines.append(
            f"- {m.raised} ({m.lr_scale:g}x the learning rate) vs {m.reference}: mean KL added at matched accuracy "
            f"{_fmt(m.mean_raised)} vs {_fmt(m.mean_reference)}{spread}; the raised-lr run's KL is the higher in "
            f"{m.higher} of {m.matched} runs."
        )
    return lines


def matched_checks(cfg: CompareConfig, summary: Summary, results: list[MatchedKL]) -> list[tuple[str, bool, str]]:
    """The second claim as a check, per raised-lr cell: at every start checkpoint the raised-lr run
    adds more KL than the reference at matched accuracy, on the seed means and on the 95% interval
    over seeds of the per-seed difference (raised - reference). Refused when either run is not on-policy."""
    checks = []
    for m in results:
        what = f"{m.raised} adds more KL than {m.reference} at matched accuracy"
        why = [r for r in (off_policy(cfg, summary, n) for n in (m.raised, m.reference)) if r]
        if why:
            checks.append((what, False, "refused, not checked: " + "; ".join(why)))
            continue
        per, held, iv_held, known = [], 0, 0, 0
        for start in cfg.start_seeds:
            diffs = [
                r - f for w, _, g, r, f in m.per_run if w == start and g is not None and r is not None and f is not None
            ]
            iv = interval(diffs)
            ok = bool(diffs) and mean(diffs) > 0
            held += ok
            if iv is not None:
                known += 1
                iv_held += iv[0] > 0
            shown = "no matched gain" if not diffs else f"{mean(diffs):+.5f}"
            per.append(f"{start}: {shown}, interval {'one seed' if iv is None else f'[{iv[0]:+.5f}, {iv[1]:+.5f}]'}")
        n = len(cfg.start_seeds)
        detail = (
            f"holds at {held}/{n} start checkpoints on the seed means, at {iv_held}/{known} on the 95% interval over "
            f"seeds of the KL difference (raised - reference) ({'; '.join(per)})"
        )
        checks.append((what, held == n and iv_held == known, detail))
    return checks
