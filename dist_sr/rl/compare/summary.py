"""A comparison's metrics reduced to one ``RunSummary`` per run (means and spreads over start
checkpoints and seeds, per-checkpoint values), and the paper's claims checked on them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..metrics import read_metrics
from .config import CompareConfig, cells, label, run_dir, run_seeds


class Spread(NamedTuple):
    """A value over every run of a cell: its mean, the std of the per-start-checkpoint means, and
    the mean over checkpoints of the std over seeds (None with one seed)."""

    mean: float
    over_starts: float
    over_seeds: float | None


@dataclass(frozen=True)
class StartSummary:
    """One cell from one start checkpoint (means over its seeds)."""

    start_accuracy: float
    accuracy_at: dict[int, float]  # report step -> accuracy
    gain_at: dict[int, float]  # report step -> accuracy gain since step 0
    steps_to_threshold: float | None  # None unless every seed reached the threshold
    reached: int  # seeds that reached it


@dataclass(frozen=True)
class RunSummary:
    """One cell over every start checkpoint and seed."""

    steps: list[int]  # the evaluated steps every run has
    mean_accuracy: dict[int, float]
    mean_kl: dict[int, float]
    accuracy_at: dict[int, Spread]  # report step -> accuracy
    gain_at: dict[int, float]  # report step -> mean accuracy gain since step 0
    per_start: dict[int, StartSummary]
    steps_to_threshold: list[int | None]  # per run (None: never reached)
    mean_steps_to_threshold: float | None
    kl_at_threshold: float | None  # KL when the mean accuracy first gains the threshold
    final_accuracy: float
    final_kl: float
    final_reward: float  # mean of the last 10 training steps' rewards
    changed_frac: float  # working-weight elements changed per step
    dead_zone_frac: float | None
    seed_spread_final: float | None
    start_spread_final: float


Summary = dict[str, RunSummary]  # cell label -> its summary


def load_runs(cfg: CompareConfig) -> dict[str, dict[int, list[list[dict]]]]:
    """label -> start seed -> the metrics rows of each seed's run."""
    return {
        cell.label: {
            start: [read_metrics(run_dir(cfg, cell, start, seed) / "metrics.jsonl") for seed in run_seeds(cfg, cell)]
            for start in cfg.start_seeds
        }
        for cell in cells(cfg)
    }


def mean(xs):
    return sum(xs) / len(xs)


def std(xs):
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def eval_curve(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}  # null: a non-finite value


def _spread(per_start: list[list[float]]) -> Spread:
    """The mean of every run, the std of the per-checkpoint means, the mean over checkpoints of
    the std over seeds (None with one seed)."""
    flat = [v for vals in per_start for v in vals]
    seeds = mean([std(vals) for vals in per_start]) if len(per_start[0]) > 1 else None
    return Spread(mean(flat), std([mean(vals) for vals in per_start]), seeds)


def _hit(curve: dict[int, float], steps: list[int], threshold: float) -> int | None:
    return next((s for s in steps if curve[s] - curve[steps[0]] >= threshold), None)


def _summarize_runs(cfg: CompareConfig, starts: dict[int, list[list[dict]]]) -> RunSummary:
    accs = {w: [eval_curve(rows, "eval_accuracy") for rows in seeds] for w, seeds in starts.items()}
    kls = {w: [eval_curve(rows, "eval_kl") for rows in seeds] for w, seeds in starts.items()}
    steps = sorted(set.intersection(*(set(a) for runs in accs.values() for a in runs)))
    every = [a for runs in accs.values() for a in runs]
    mean_acc = {s: mean([a[s] for a in every]) for s in steps}
    mean_kl = {s: mean([k[s] for runs in kls.values() for k in runs]) for s in steps}
    report = [s for s in cfg.report_steps if s in mean_acc]
    per_start = {}
    for w, runs in accs.items():
        hits = [_hit(a, steps, cfg.threshold) for a in runs]
        per_start[w] = StartSummary(
            start_accuracy=mean([a[steps[0]] for a in runs]),
            accuracy_at={s: mean([a[s] for a in runs]) for s in report},
            gain_at={s: mean([a[s] - a[steps[0]] for a in runs]) for s in report},
            steps_to_threshold=mean(hits) if all(h is not None for h in hits) else None,
            reached=sum(h is not None for h in hits),
        )
    hits = [_hit(a, steps, cfg.threshold) for a in every]
    mean_hit = _hit(mean_acc, steps, cfg.threshold)
    train_rows = [
        [r for r in rows if r.get("reward") is not None and r.get("changed_frac") is not None]
        for seeds in starts.values()
        for rows in seeds
    ]
    dead = [
        [r["dead_zone_frac"] for r in rows if r.get("dead_zone_frac") is not None]
        for seeds in starts.values()
        for rows in seeds
    ]
    final = _spread([[a[steps[-1]] for a in runs] for runs in accs.values()])
    return RunSummary(
        steps=steps,
        mean_accuracy=mean_acc,
        mean_kl=mean_kl,
        accuracy_at={s: _spread([[a[s] for a in runs] for runs in accs.values()]) for s in report},
        gain_at={s: mean([a[s] - a[steps[0]] for a in every]) for s in report},
        per_start=per_start,
        steps_to_threshold=hits,
        mean_steps_to_threshold=mean(hits) if all(h is not None for h in hits) else None,
        kl_at_threshold=mean_kl[mean_hit] if mean_hit is not None else None,
        final_accuracy=mean_acc[steps[-1]],
        final_kl=mean_kl[steps[-1]],
        final_reward=mean([mean([r["reward"] for r in rows[-10:]]) for rows in train_rows]),
        changed_frac=mean([mean([r["changed_frac"] for r in rows]) for rows in train_rows]),
        dead_zone_frac=mean([mean(d) for d in dead]) if all(dead) else None,
        seed_spread_final=final.over_seeds,
        start_spread_final=final.over_starts,
    )


def summarize(cfg: CompareConfig) -> Summary:
    """Every cell's ``RunSummary``, by label."""
    return {name: _summarize_runs(cfg, starts) for name, starts in load_runs(cfg).items()}


def learning_rates(cfg: CompareConfig) -> list[float | None]:
    return [float(lr) for lr in cfg.lrs] or [None]


def gain_ratio(cfg: CompareConfig, summary: Summary, lr: float | None, step: int) -> float | None:
    """The bf16 (RTN) run's mean accuracy gain at ``step`` over the reference's; None without a
    bf16 run or when the reference gains nothing."""
    rtn, ref = summary.get(label("bf16", lr)), summary[label(cfg.reference, lr)]
    return rtn.gain_at[step] / ref.gain_at[step] if rtn and ref.gain_at[step] > 0 else None


def goal_checks(cfg: CompareConfig, summary: Summary, lr: float | None = None) -> list[tuple[str, bool, str]]:
    """The paper's claims, checked on this comparison's data (reported, never tuned for). Each is
    evaluated at every start checkpoint (seed means) and holds only if it holds at all of them."""
    checks = []
    at = f" at lr {lr:g}" if lr is not None else ""
    ref, rtn = summary.get(label(cfg.reference, lr)), summary.get(label("bf16", lr))
    starts = cfg.start_seeds

    def verdict(what: str, values: dict[int, float | None], ok, fmt) -> tuple[str, bool, str]:
        held = [w for w in starts if values[w] is not None and ok(values[w])]
        per = ", ".join(f"{w}: {fmt(values[w])}" for w in starts)
        return (what + at, len(held) == len(starts), f"holds at {len(held)}/{len(starts)} start checkpoints ({per})")

    for other_name in ("fp16", "fp32"):
        other = summary.get(label(other_name, lr))
        if other and ref:
            gaps = {
                w: max(
                    (
                        abs(ref.per_start[w].accuracy_at[s] - other.per_start[w].accuracy_at[s])
                        for s in ref.per_start[w].accuracy_at
                    ),
                    default=None,
                )
                for w in starts
            }
            checks.append(
                verdict(
                    f"{cfg.reference} accuracy within 0.02 of {other_name} at {list(ref.accuracy_at)}",
                    gaps,
                    lambda g: g <= 0.02,
                    lambda g: "—" if g is None else f"largest gap {g:.3f}",
                )
            )
    if rtn and ref and ref.gain_at:
        first = min(ref.gain_at)
        ratios = {}
        for w in starts:
            g_rtn, g_sr = rtn.per_start[w].gain_at[first], ref.per_start[w].gain_at[first]
            ratios[w] = g_rtn / g_sr if g_sr > 0 else None
        checks.append(
            verdict(
                f"bf16 (RTN) gain at step {first} <= 0.6x {cfg.reference}'s",
                ratios,
                lambda r: r <= 0.6,
                lambda r: "SR gains nothing" if r is None else f"{r:.2f}x",
            )
        )
        steps = {}
        for w in starts:
            h_rtn, h_sr = rtn.per_start[w].steps_to_threshold, ref.per_start[w].steps_to_threshold
            steps[w] = None if not h_sr else (math.inf if h_rtn is None else h_rtn / h_sr)
        checks.append(
            verdict(
                f"bf16 (RTN) needs >= 1.3x {cfg.reference}'s steps to gain +{cfg.threshold}",
                steps,
                lambda r: r >= 1.3,
                lambda r: (
                    "SR never reaches it" if r is None else ("RTN never reaches it" if r == math.inf else f"{r:.2f}x")
                ),
            )
        )
    return checks
