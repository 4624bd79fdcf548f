"""A comparison's metrics reduced to one ``RunSummary`` per run (means and spreads over start
checkpoints and seeds, per-checkpoint values), and the paper's claims checked on them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from ..metrics import read_metrics
from .config import CompareConfig, cells, label, report_steps, run_dir, run_seeds


class Spread(NamedTuple):
    """A value over every run of a cell: its mean, the std of the per-start-checkpoint means, and
    the mean over checkpoints of the std over seeds (None with one seed)."""

    mean: float
    over_starts: float
    over_seeds: float | None


@dataclass(frozen=True)
class StartSummary:
    """One cell from one start checkpoint (means over its seeds, and each seed's value)."""

    start_accuracy: float
    accuracy_at: dict[int, float]  # report step -> accuracy
    gain_at: dict[int, float]  # report step -> accuracy gain since step 0
    steps_to_threshold: float | None  # None unless every seed reached the threshold
    reached: int  # seeds that reached it
    seeds: list[int]  # the RL seeds, in the order of the per-seed lists below
    accuracy_by_seed: dict[int, list[float]]  # report step -> each seed's accuracy
    gain_by_seed: dict[int, list[float]]  # report step -> each seed's gain since step 0
    hits_by_seed: list[int | None]  # each seed's steps to the threshold (None: never)


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
    engine_gap: float | None  # mean over runs of each run's mean trainer-engine gap (None: no engine logprobs)
    engine_gap_max: float | None  # the largest run's


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


def _t95(n: int) -> float:
    """Student's t at 97.5% with ``n - 1`` degrees of freedom (a two-sided 95% interval of a mean)."""
    table = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}
    return table.get(n, 1.96 + 2.5 / n)


def interval(values: list[float]) -> tuple[float, float] | None:
    """The 95% interval of the mean of ``values`` (one per seed; Student's t, sample std), or None
    with fewer than two."""
    n = len(values)
    if n < 2:
        return None
    m = mean(values)
    half = _t95(n) * math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1)) / math.sqrt(n)
    return (m - half, m + half)


def engine_gap(rows: list[dict]) -> float | None:
    """A run's trainer-engine gap: its mean over steps of ``mismatch_abs_mean`` (mean |log p_trainer
    - log p_engine| per sampled token); None when its rollouts carried no engine logprobs."""
    vals = [r["mismatch_abs_mean"] for r in rows if isinstance(r.get("mismatch_abs_mean"), (int, float))]
    return mean(vals) if vals else None


def _summarize_runs(
    cfg: CompareConfig, starts: dict[int, list[list[dict]]], seeds: list[int], steps_reported: list[int]
) -> RunSummary:
    accs = {w: [eval_curve(rows, "eval_accuracy") for rows in seeds] for w, seeds in starts.items()}
    kls = {w: [eval_curve(rows, "eval_kl") for rows in seeds] for w, seeds in starts.items()}
    steps = sorted(set.intersection(*(set(a) for runs in accs.values() for a in runs)))
    every = [a for runs in accs.values() for a in runs]
    mean_acc = {s: mean([a[s] for a in every]) for s in steps}
    mean_kl = {s: mean([k[s] for runs in kls.values() for k in runs]) for s in steps}
    report = [s for s in steps_reported if s in mean_acc]
    per_start = {}
    for w, runs in accs.items():
        hits = [_hit(a, steps, cfg.threshold) for a in runs]
        per_start[w] = StartSummary(
            start_accuracy=mean([a[steps[0]] for a in runs]),
            accuracy_at={s: mean([a[s] for a in runs]) for s in report},
            gain_at={s: mean([a[s] - a[steps[0]] for a in runs]) for s in report},
            steps_to_threshold=mean(hits) if all(h is not None for h in hits) else None,
            reached=sum(h is not None for h in hits),
            seeds=list(seeds),
            accuracy_by_seed={s: [a[s] for a in runs] for s in report},
            gain_by_seed={s: [a[s] - a[steps[0]] for a in runs] for s in report},
            hits_by_seed=hits,
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
    gaps = [g for g in (engine_gap(rows) for seeds_rows in starts.values() for rows in seeds_rows) if g is not None]
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
        engine_gap=mean(gaps) if gaps else None,
        engine_gap_max=max(gaps) if gaps else None,
    )


def summarize(cfg: CompareConfig) -> Summary:
    """Every cell's ``RunSummary``, by label."""
    data = load_runs(cfg)
    return {
        cell.label: _summarize_runs(cfg, data[cell.label], run_seeds(cfg, cell), report_steps(cfg, cell.lr))
        for cell in cells(cfg)
    }


def off_policy(cfg: CompareConfig, summary: Summary, name: str) -> str | None:
    """Why cell ``name`` is not on-policy (a run's trainer-engine gap above ``on_policy_gap``), or
    None when every run of it is within it (or sampled from the trainer's own model)."""
    gap = summary[name].engine_gap_max
    if gap is None or gap <= cfg.on_policy_gap:
        return None
    return f"{name} is off-policy (a run's trainer-engine gap {gap:.4f} > on_policy_gap {cfg.on_policy_gap:g})"


def learning_rates(cfg: CompareConfig) -> list[float | None]:
    return [float(lr) for lr in cfg.lrs] or [None]


def gain_ratio(cfg: CompareConfig, summary: Summary, lr: float | None, step: int) -> float | None:
    """The bf16 (RTN) run's mean accuracy gain at ``step`` over the reference's; None without a
    bf16 run or when the reference gains nothing."""
    rtn, ref = summary.get(label("bf16", lr)), summary[label(cfg.reference, lr)]
    if not rtn or step not in rtn.gain_at or step not in ref.gain_at:
        return None
    return rtn.gain_at[step] / ref.gain_at[step] if ref.gain_at[step] > 0 else None


def _paired(a: StartSummary, b: StartSummary, f) -> list[float]:
    """``f(i, j)`` for every seed both cells ran from this start checkpoint (``i``, ``j``: its index in
    each): paired by seed, the runs that share prompts and sampling noise."""
    return [f(a.seeds.index(seed), b.seeds.index(seed)) for seed in a.seeds if seed in b.seeds]


def _fmt_interval(iv: tuple[float, float] | None, p: int = 3) -> str:
    return "one seed: no interval" if iv is None else f"[{iv[0]:.{p}f}, {iv[1]:.{p}f}]"


def goal_checks(cfg: CompareConfig, summary: Summary, lr: float | None = None) -> list[tuple[str, bool, str]]:
    """The paper's claims, checked on this comparison's data (reported, never tuned for). Each is
    evaluated at every start checkpoint, on the seed means and on the 95% interval over seeds (of a
    quantity paired by seed), and holds only if both do at all of them (the interval where there are
    two seeds or more). A claim about a run that is not on-policy (``off_policy``) is refused."""
    checks: list[tuple[str, bool, str]] = []
    at = f" at lr {lr:g}" if lr is not None else ""
    ref, rtn = summary.get(label(cfg.reference, lr)), summary.get(label("bf16", lr))
    starts = cfg.start_seeds

    def verdict(what, values, ok, fmt, intervals=None, iv_ok=None, iv_fmt=_fmt_interval):
        held = [w for w in starts if values[w] is not None and ok(values[w])]
        per = ", ".join(f"{w}: {fmt(values[w])}" for w in starts)
        detail = f"holds at {len(held)}/{len(starts)} start checkpoints ({per})"
        passed = len(held) == len(starts)
        if intervals is not None:
            known = [w for w in starts if intervals[w] is not None]
            iv_held = [w for w in known if iv_ok(intervals[w])]
            detail += (
                f"; on the 95% interval over seeds at {len(iv_held)}/{len(known)} "
                f"({', '.join(f'{w}: {iv_fmt(intervals[w])}' for w in starts)})"
            )
            passed = passed and len(iv_held) == len(known)
        return (what + at, passed, detail)

    def refused(what: str, *names: str) -> tuple[str, bool, str] | None:
        why = [r for r in (off_policy(cfg, summary, n) for n in names) if r]
        return (what + at, False, "refused, not checked: " + "; ".join(why)) if why else None

    for other_name in ("fp16", "fp32"):
        other = summary.get(label(other_name, lr))
        if not (other and ref):
            continue
        what = f"{cfg.reference} accuracy within 0.02 of {other_name} at {list(ref.accuracy_at)}"
        no = refused(what, label(cfg.reference, lr), label(other_name, lr))
        if no:
            checks.append(no)
            continue
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
        # per step, the interval of (reference - other) paired by seed; the claim needs every one inside +-0.02
        spans: dict[int, tuple[float, float] | None] = {}
        for w in starts:
            a, b = ref.per_start[w], other.per_start[w]
            found = [
                interval(_paired(a, b, lambda i, j: a.accuracy_by_seed[s][i] - b.accuracy_by_seed[s][j]))
                for s in a.accuracy_at
            ]
            ivs = [iv for iv in found if iv is not None]
            spans[w] = (min(lo for lo, _ in ivs), max(hi for _, hi in ivs)) if ivs and len(ivs) == len(found) else None
        checks.append(
            verdict(
                what,
                gaps,
                lambda g: g <= 0.02,
                lambda g: "—" if g is None else f"largest gap {g:.3f}",
                spans,
                lambda iv: -0.02 <= iv[0] and iv[1] <= 0.02,
                lambda iv: _fmt_interval(iv) if iv is None else f"difference within {_fmt_interval(iv)}",
            )
        )
    if rtn and ref and ref.gain_at:
        first = min(ref.gain_at)
        what = f"bf16 (RTN) gain at step {first} <= 0.6x {cfg.reference}'s"
        no = refused(what, label(cfg.reference, lr), label("bf16", lr))
        if no:
            checks.append(no)
        else:
            ratios, margins = {}, {}
            for w in starts:
                r, f = rtn.per_start[w], ref.per_start[w]
                g_rtn, g_sr = r.gain_at[first], f.gain_at[first]
                ratios[w] = g_rtn / g_sr if g_sr > 0 else None
                # 0.6 x SR's gain - RTN's, per seed: the claim is that it is >= 0
                margins[w] = interval(
                    _paired(f, r, lambda i, j: 0.6 * f.gain_by_seed[first][i] - r.gain_by_seed[first][j])
                )
            checks.append(
                verdict(
                    what,
                    ratios,
                    lambda x: x <= 0.6,
                    lambda x: "SR gains nothing" if x is None else f"{x:.2f}x",
                    margins,
                    lambda iv: iv[0] >= 0,
                    lambda iv: _fmt_interval(iv) if iv is None else f"0.6 SR - RTN gain in {_fmt_interval(iv)}",
                )
            )
        what = f"bf16 (RTN) needs >= 1.3x {cfg.reference}'s steps to gain +{cfg.threshold}"
        no = refused(what, label(cfg.reference, lr), label("bf16", lr))
        if no:
            checks.append(no)
        else:
            steps, every_seed = {}, {}
            for w in starts:
                r, f = rtn.per_start[w], ref.per_start[w]
                h_rtn, h_sr = r.steps_to_threshold, f.steps_to_threshold
                steps[w] = None if not h_sr else (math.inf if h_rtn is None else h_rtn / h_sr)
                # steps are discrete (the evaluations): instead of an interval, the claim must hold for each seed
                per_seed = _paired(
                    f,
                    r,
                    lambda i, j: (
                        math.nan
                        if f.hits_by_seed[i] is None
                        else math.inf
                        if r.hits_by_seed[j] is None
                        else r.hits_by_seed[j] / f.hits_by_seed[i]  # type: ignore[operator]
                    ),
                )
                every_seed[w] = per_seed if len(per_seed) > 1 else None
            checks.append(
                verdict(
                    what,
                    steps,
                    lambda x: x >= 1.3,
                    lambda x: (
                        "SR never reaches it"
                        if x is None
                        else ("RTN never reaches it" if x == math.inf else f"{x:.2f}x")
                    ),
                    every_seed,
                    lambda xs: all(x >= 1.3 for x in xs),
                    lambda xs: (
                        "one seed"
                        if xs is None
                        else "each seed "
                        + "/".join("—" if math.isnan(x) else "never" if x == math.inf else f"{x:.1f}x" for x in xs)
                    ),
                )
            )
    return checks
