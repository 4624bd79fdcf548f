"""The precision comparison: every mode from several start checkpoints and seeds, one report.

``dist-sr compare [CONFIG]`` warms up one start checkpoint per ``start_seeds`` entry (the warm-up
seed: its data order and evaluation prompts), then trains each run (precision, learning-rate
scale, shadow jitter) from each checkpoint with each RL seed, optionally at each learning rate of
``lrs`` (a sweep), in parallel processes. It writes ``report.md`` (tables: mean and spread over
start checkpoints and over seeds, per-checkpoint values, the sweep), ``figure.png`` (and
``sweep.png``) and ``summary.json``. Finished runs are reused, so an interrupted comparison picks
up where it stopped.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import math
import multiprocessing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..config import load_document
from .config import ConfigError, ExperimentConfig, from_dict, load_experiment


@dataclass
class RunSpec:
    name: str
    precision: str = "bf16-sr"
    lr_scale: float = 1.0
    shadow_jitter: bool = False
    seeds: list[int] | None = None  # this run's RL seeds (None: the comparison's); fewer for a slow run


def _default_runs() -> list[RunSpec]:
    return [
        RunSpec("fp32", "fp32"),
        RunSpec("fp16", "fp16", seeds=[0]),  # ~4x the others' time on a CPU: one seed per start checkpoint
        RunSpec("bf16", "bf16"),
        RunSpec("bf16-sr", "bf16-sr"),
        RunSpec("bf16-offgrid", "bf16", shadow_jitter=True),
    ]


def _int_list(values, what: str) -> None:
    if (
        not values
        or not isinstance(values, list)
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in values)
    ):
        raise ConfigError(f"{what} must be a non-empty list of ints, got {values!r}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{what} has duplicates: {values!r}")


@dataclass
class CompareConfig:
    experiment: dict[str, Any] = field(default_factory=dict)  # overrides of the experiment defaults
    experiment_file: str | None = None  # or a YAML file (relative to this one)
    start_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # warm-up seeds: one start checkpoint each
    seeds: list[int] = field(default_factory=lambda: [0, 1])  # RL seeds, each from every start checkpoint
    lrs: list[float] = field(default_factory=list)  # a sweep: every run at each lr (x its lr_scale)
    runs: list[RunSpec] = field(default_factory=_default_runs)
    parallel: int = 2
    threshold: float = 0.05  # accuracy gain for "steps to threshold" and matched-accuracy KL
    report_steps: list[int] = field(default_factory=lambda: [100, 200, 300])
    reference: str = "bf16-sr"  # the run others are compared with in the goal checks
    output_dir: str = "runs/compare"

    def __post_init__(self):
        _int_list(self.seeds, "seeds")
        _int_list(self.start_seeds, "start_seeds")
        if not isinstance(self.lrs, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in self.lrs
        ):
            raise ConfigError(f"lrs must be a list of positive learning rates (empty: no sweep), got {self.lrs!r}")
        if len(set(self.lrs)) != len(self.lrs):
            raise ConfigError(f"lrs has duplicates: {self.lrs!r}")
        if self.parallel < 1:
            raise ConfigError(f"parallel must be >= 1 (training processes at a time), got {self.parallel}")


@dataclass(frozen=True)
class Cell:
    """One column of the comparison: a run, at one learning rate of the sweep (``lr`` None: the
    experiment's), trained from every start checkpoint with every seed."""

    label: str
    spec: RunSpec
    lr: float | None = None


def cells(cfg: CompareConfig) -> list[Cell]:
    if not cfg.lrs:
        return [Cell(spec.name, spec) for spec in cfg.runs]
    return [Cell(label(spec.name, lr), spec, float(lr)) for lr in cfg.lrs for spec in cfg.runs]


def run_seeds(cfg: CompareConfig, cell: Cell) -> list[int]:
    return cfg.seeds if cell.spec.seeds is None else cell.spec.seeds


def label(name: str, lr: float | None) -> str:
    return name if lr is None else f"{name}@{lr:g}"


def load_compare(source: str | Path | None = None, overrides: dict | None = None) -> CompareConfig:
    data: dict = {}
    base = Path(".")
    if source is not None:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"compare config {path} does not exist")
        data = load_document(path)
        base = path.parent
    for k, v in (overrides or {}).items():
        data[k] = v
    runs = data.pop("runs", None)
    cfg = from_dict(CompareConfig, data)
    if runs is not None:
        if not isinstance(runs, list) or not runs:
            raise ConfigError("runs: expected a non-empty list of {name, precision, lr_scale, shadow_jitter}")
        cfg.runs = [from_dict(RunSpec, r, f"runs[{i}]") for i, r in enumerate(runs)]
        for i, spec in enumerate(cfg.runs):
            if spec.seeds is not None:
                _int_list(spec.seeds, f"runs[{i}].seeds")
    if cfg.experiment_file:
        cfg.experiment_file = str((base / cfg.experiment_file).resolve())
    names = [r.name for r in cfg.runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"runs: duplicate run names in {names}")
    if any("@" in n or "/" in n for n in names):
        raise ConfigError(f"runs: a run name may not contain '@' or '/' (used for sweeps and paths): {names}")
    if cfg.reference not in names:
        raise ConfigError(f"reference: {cfg.reference!r} is not one of the runs {names}")
    for cell in cells(cfg):  # validate every run's experiment now, not after an hour of training
        exp = run_config(cfg, cell, cfg.start_seeds[0], cfg.seeds[0])
    if len(cfg.start_seeds) > 1 and (exp.model.path is not None or not exp.warmup.enabled):
        raise ConfigError(
            f"start_seeds={cfg.start_seeds}: start checkpoints differ by their warm-up seed, but this "
            "experiment has no warm-up (model.path is set or warmup.enabled is false); set "
            "start_seeds: [0] and vary seeds instead"
        )
    return cfg


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_dir(cfg: CompareConfig, cell: Cell, start: int, seed: int) -> Path:
    return Path(cfg.output_dir) / cell.label / f"start-{start}" / f"seed-{seed}"


def run_config(cfg: CompareConfig, cell: Cell, start: int, seed: int) -> ExperimentConfig:
    """The experiment of one run, start checkpoint and seed: the shared experiment plus the run's
    own settings."""
    data = load_document(Path(cfg.experiment_file)) if cfg.experiment_file else {}
    data = _deep_merge(data, cfg.experiment)
    base_lr = cell.lr if cell.lr is not None else load_experiment(data).grpo.lr
    return load_experiment(
        data,
        {
            "precision": cell.spec.precision,
            "grpo.lr": base_lr * cell.spec.lr_scale,
            "shadow_jitter": cell.spec.shadow_jitter,
            "seed": seed,
            "warmup.seed": start,
            "output_dir": str(run_dir(cfg, cell, start, seed)),
            "threads": 1,
        },
    )


def _warm_one(cfg: ExperimentConfig) -> str:
    import torch

    from .warmup import warmup_checkpoint

    if cfg.threads:  # as the runs do: workers sharing the cores each take their share, not all of them
        torch.set_num_threads(cfg.threads)
    return str(warmup_checkpoint(cfg, progress=False))


def _train_one(cfg: ExperimentConfig) -> str:
    from transformers.utils import logging as hf_logging

    from .trainer import train

    hf_logging.disable_progress_bar()  # one line per finished run is enough in a worker

    return str(train(cfg, progress=False, resume="auto"))  # a run cut short continues


def _finished(cfg: ExperimentConfig) -> bool:
    path = Path(cfg.output_dir) / "metrics.jsonl"
    if not path.exists():
        return False
    from .metrics import read_metrics
    from .rundir import holds_a_run

    lines = read_metrics(path)
    return bool(lines) and lines[-1]["step"] == cfg.grpo.steps and holds_a_run(Path(cfg.output_dir))


def run_comparison(cfg: CompareConfig, progress: bool = True) -> Path:
    """Warm up every start checkpoint, train every run x start x seed (skipping finished ones),
    then write the report; returns report.md."""
    jobs = [
        (cell, start, seed, run_config(cfg, cell, start, seed))
        for cell in cells(cfg)
        for start in cfg.start_seeds
        for seed in run_seeds(cfg, cell)
    ]
    todo = [j for j in jobs if not _finished(j[3])]
    todo.sort(key=lambda j: j[3].precision.precision != "fp16")  # slowest on a CPU first: shorter makespan
    if not todo:  # every run finished: the report only, no worker processes
        return write_report(cfg)
    from .warmup import is_cached

    with cf.ProcessPoolExecutor(max_workers=cfg.parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        first = {start: next(j[3] for j in jobs if j[1] == start) for start in cfg.start_seeds}
        # the start checkpoints not cached yet, before any run needs them
        warm = [pool.submit(_warm_one, exp) for exp in first.values() if not is_cached(exp)]
        for fut in tqdm(
            cf.as_completed(warm), total=len(warm), desc="start checkpoints (warm-up)", disable=not progress
        ):
            fut.result()
        bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="comparison runs", disable=not progress)
        futures = {pool.submit(_train_one, exp): (cell.label, start, seed) for cell, start, seed, exp in todo}
        for fut in cf.as_completed(futures):
            fut.result()  # a failed run fails the comparison, with its traceback
            name, start, seed = futures[fut]
            bar.set_postfix_str(f"done {name} start {start} seed {seed}")
            bar.update(1)
        bar.close()
    return write_report(cfg)


# --- report -------------------------------------------------------------------------------


def _load(cfg: CompareConfig) -> dict[str, dict[int, list[list[dict]]]]:
    """label -> start seed -> the metrics rows of each seed's run."""
    from .metrics import read_metrics

    return {
        cell.label: {
            start: [read_metrics(run_dir(cfg, cell, start, seed) / "metrics.jsonl") for seed in run_seeds(cfg, cell)]
            for start in cfg.start_seeds
        }
        for cell in cells(cfg)
    }


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _eval_curve(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}  # null: a non-finite value


def _spread(per_start: list[list[float]]) -> tuple[float, float, float | None]:
    """(mean, spread over start checkpoints, spread over seeds): the mean of every run, the std of
    the per-checkpoint means, the mean over checkpoints of the std over seeds (None with one seed)."""
    flat = [v for vals in per_start for v in vals]
    seeds = _mean([_std(vals) for vals in per_start]) if len(per_start[0]) > 1 else None
    return _mean(flat), _std([_mean(vals) for vals in per_start]), seeds


def _hit(curve: dict[int, float], steps: list[int], threshold: float) -> int | None:
    return next((s for s in steps if curve[s] - curve[steps[0]] >= threshold), None)


def _summarize_runs(cfg: CompareConfig, starts: dict[int, list[list[dict]]]) -> dict[str, Any]:
    accs = {w: [_eval_curve(rows, "eval_accuracy") for rows in seeds] for w, seeds in starts.items()}
    kls = {w: [_eval_curve(rows, "eval_kl") for rows in seeds] for w, seeds in starts.items()}
    steps = sorted(set.intersection(*(set(a) for runs in accs.values() for a in runs)))
    every = [a for runs in accs.values() for a in runs]
    mean_acc = {s: _mean([a[s] for a in every]) for s in steps}
    mean_kl = {s: _mean([k[s] for runs in kls.values() for k in runs]) for s in steps}
    report = [s for s in cfg.report_steps if s in mean_acc]
    per_start = {}
    for w, runs in accs.items():
        hits = [_hit(a, steps, cfg.threshold) for a in runs]
        per_start[w] = {
            "start_accuracy": _mean([a[steps[0]] for a in runs]),
            "accuracy_at": {s: _mean([a[s] for a in runs]) for s in report},
            "gain_at": {s: _mean([a[s] - a[steps[0]] for a in runs]) for s in report},
            "steps_to_threshold": _mean(hits) if all(h is not None for h in hits) else None,
            "reached": sum(h is not None for h in hits),
        }
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
    return {
        "steps": steps,
        "mean_accuracy": mean_acc,
        "mean_kl": mean_kl,
        "accuracy_at": {s: _spread([[a[s] for a in runs] for runs in accs.values()]) for s in report},
        "gain_at": {s: _mean([a[s] - a[steps[0]] for a in every]) for s in report},
        "per_start": per_start,
        "steps_to_threshold": hits,
        "mean_steps_to_threshold": _mean(hits) if all(h is not None for h in hits) else None,
        "kl_at_threshold": mean_kl[mean_hit] if mean_hit is not None else None,
        "final_accuracy": mean_acc[steps[-1]],
        "final_kl": mean_kl[steps[-1]],
        "final_reward": _mean([_mean([r["reward"] for r in rows[-10:]]) for rows in train_rows]),
        "changed_frac": _mean([_mean([r["changed_frac"] for r in rows]) for rows in train_rows]),
        "dead_zone_frac": _mean([_mean(d) for d in dead]) if all(dead) else None,
        "seed_spread_final": final[2],
        "start_spread_final": final[1],
    }


def summarize(cfg: CompareConfig) -> dict[str, Any]:
    return {name: _summarize_runs(cfg, starts) for name, starts in _load(cfg).items()}


def _lrs(cfg: CompareConfig) -> list[float | None]:
    return [float(lr) for lr in cfg.lrs] or [None]


def _gain_ratio(cfg: CompareConfig, summary: dict, lr: float | None, step: int) -> float | None:
    """The bf16 (RTN) run's mean accuracy gain at ``step`` over the reference's; None without a
    bf16 run or when the reference gains nothing."""
    rtn, ref = summary.get(label("bf16", lr)), summary[label(cfg.reference, lr)]
    return rtn["gain_at"][step] / ref["gain_at"][step] if rtn and ref["gain_at"][step] > 0 else None


def goal_checks(cfg: CompareConfig, summary: dict, lr: float | None = None) -> list[tuple[str, bool, str]]:
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
                        abs(ref["per_start"][w]["accuracy_at"][s] - other["per_start"][w]["accuracy_at"][s])
                        for s in ref["per_start"][w]["accuracy_at"]
                    ),
                    default=None,
                )
                for w in starts
            }
            checks.append(
                verdict(
                    f"{cfg.reference} accuracy within 0.02 of {other_name} at {list(ref['accuracy_at'])}",
                    gaps,
                    lambda g: g <= 0.02,
                    lambda g: "—" if g is None else f"largest gap {g:.3f}",
                )
            )
    if rtn and ref and ref["gain_at"]:
        first = min(ref["gain_at"])
        ratios = {}
        for w in starts:
            g_rtn, g_sr = rtn["per_start"][w]["gain_at"][first], ref["per_start"][w]["gain_at"][first]
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
            h_rtn, h_sr = rtn["per_start"][w]["steps_to_threshold"], ref["per_start"][w]["steps_to_threshold"]
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


def _fmt(v, p=3):
    return "—" if v is None else f"{v:.{p}f}"


def _main_table(cfg: CompareConfig, summary: dict) -> list[str]:
    rs = cfg.report_steps
    lines = [
        "| run | " + " | ".join(f"acc @{s}" for s in rs) + f" | steps to +{cfg.threshold} | "
        f"KL @ +{cfg.threshold} | final KL | final reward | changed/step | dead zone |",
        "|---|" + "---:|" * (len(rs) + 6),
    ]
    for cell in cells(cfg):
        s = summary[cell.label]
        accs = [
            f"{s['accuracy_at'][k][0]:.3f} ± {s['accuracy_at'][k][1]:.3f} / {_fmt(s['accuracy_at'][k][2])}"
            if k in s["accuracy_at"]
            else "—"
            for k in rs
        ]
        hits = s["steps_to_threshold"]
        hit = (
            f"{s['mean_steps_to_threshold']:.0f}"
            if s["mean_steps_to_threshold"] is not None
            else f"{sum(h is not None for h in hits)}/{len(hits)} runs reach it"
        )
        lines.append(
            f"| {cell.label} | " + " | ".join(accs) + f" | {hit} | {_fmt(s['kl_at_threshold'], 5)} | "
            f"{_fmt(s['final_kl'], 5)} | {_fmt(s['final_reward'])} | {_fmt(s['changed_frac'], 4)} | "
            f"{_fmt(s['dead_zone_frac'], 4)} |"
        )
    return lines


def _per_start_table(cfg: CompareConfig, summary: dict) -> list[str]:
    rs = cfg.report_steps
    lines = [
        "| start checkpoint | run | acc @0 | "
        + " | ".join(f"acc @{s}" for s in rs)
        + f" | steps to +{cfg.threshold} |",
        "|---|---|" + "---:|" * (len(rs) + 2),
    ]
    for w in cfg.start_seeds:
        for cell in cells(cfg):
            ps = summary[cell.label]["per_start"][w]
            hit = (
                f"{ps['steps_to_threshold']:.0f}"
                if ps["steps_to_threshold"] is not None
                else f"{ps['reached']}/{len(run_seeds(cfg, cell))} seeds reach it"
            )
            lines.append(
                f"| {w} | {cell.label} | {ps['start_accuracy']:.3f} | "
                + " | ".join(_fmt(ps["accuracy_at"].get(s)) for s in rs)
                + f" | {hit} |"
            )
    return lines


def _sweep_table(cfg: CompareConfig, summary: dict) -> list[str]:
    """Per learning rate: the dead-zone fraction of the RTN run, each run's last accuracy, and the
    RTN/SR ratios of gain and of steps to the threshold."""
    rs = [s for s in cfg.report_steps if s in summary[cells(cfg)[0].label]["accuracy_at"]]
    names = [spec.name for spec in cfg.runs]
    lines = [
        "| lr | dead zone (bf16) | beyond it | "
        + " | ".join(f"{n} acc @{rs[-1]}" for n in names)
        + " | "
        + " | ".join(f"RTN/SR gain @{s}" for s in rs)
        + f" | RTN/SR steps to +{cfg.threshold} |",
        "|---:|---:|---:|" + "---:|" * (len(names) + len(rs) + 1),
    ]
    for lr in _lrs(cfg):
        rtn, ref = summary.get(label("bf16", lr)), summary[label(cfg.reference, lr)]
        gains = ["—" if r is None else f"{r:.2f}x" for r in (_gain_ratio(cfg, summary, lr, s) for s in rs)]
        h_rtn, h_sr = (rtn or {}).get("mean_steps_to_threshold"), ref["mean_steps_to_threshold"]
        if not rtn or not h_sr:
            steps = "—"
        elif h_rtn is None:
            reached = rtn["steps_to_threshold"]
            steps = f"RTN: {sum(h is not None for h in reached)}/{len(reached)} runs reach it"
        else:
            steps = f"{h_rtn / h_sr:.2f}x"
        dz = rtn["dead_zone_frac"] if rtn else None
        dead = f"{_fmt(dz, 4)} | {'—' if dz is None else f'{100 * (1 - dz):.2f}%'}"
        lines.append(
            f"| {lr:g} | {dead} | "
            + " | ".join(_fmt(summary[label(n, lr)]["accuracy_at"][rs[-1]][0]) for n in names)
            + " | "
            + " | ".join(gains)
            + f" | {steps} |"
        )
    return lines


def write_report(cfg: CompareConfig) -> Path:
    out = Path(cfg.output_dir)
    if not any(
        (run_dir(cfg, cell, start, seed) / "metrics.jsonl").exists()
        for cell in cells(cfg)
        for start in cfg.start_seeds
        for seed in run_seeds(cfg, cell)
    ):
        raise ConfigError(f"no finished runs under {out} to report on; run 'dist-sr compare' without --report-only")
    unfinished = [
        f"{cell.label}/start-{start}/seed-{seed}"
        for cell in cells(cfg)
        for start in cfg.start_seeds
        for seed in run_seeds(cfg, cell)
        if not _finished(run_config(cfg, cell, start, seed))
    ]
    if unfinished:
        raise ConfigError(
            f"{len(unfinished)} runs under {out} are not finished ({', '.join(unfinished[:3])}"
            f"{', ...' if len(unfinished) > 3 else ''}); run 'dist-sr compare' with this config to "
            "finish them (finished runs are reused), then report"
        )
    summary = summarize(cfg)
    checks = [c for lr in _lrs(cfg) for c in goal_checks(cfg, summary, lr)]
    _plot(cfg, summary, out / "figure.png")
    lines = [
        "# dist-sr precision comparison",
        "",
        f"Start checkpoints (warm-up seeds): {cfg.start_seeds}; RL seeds from each: {cfg.seeds}"
        + "".join(f" ({cell.label}: {cell.spec.seeds})" for cell in cells(cfg) if cell.spec.seeds is not None)
        + (f"; learning rates: {[float(v) for v in cfg.lrs]}" if cfg.lrs else "")
        + ". "
        "Eval accuracy is sampled accuracy on fixed prompts with fixed sampling noise, shown as mean ± spread over "
        "start checkpoints / spread over seeds (std of the per-checkpoint means / mean std over seeds within a "
        f"checkpoint); KL is exact KL(policy || start checkpoint) at answer positions; 'steps to +{cfg.threshold}' "
        f"is per run, then averaged; 'KL @ +{cfg.threshold}' is the KL when the mean accuracy first gains that "
        "much (matched accuracy); 'dead zone' is the mean per-step fraction of non-zero updates of the FP32 weights "
        "smaller than half the BF16 spacing at the weight (what round-to-nearest from the BF16 grid drops).",
        "",
        *_main_table(cfg, summary),
        "",
        "## Per start checkpoint (means over seeds)",
        "",
        *_per_start_table(cfg, summary),
    ]
    if cfg.lrs:
        _plot_sweep(cfg, summary, out / "sweep.png")
        lines += [
            "",
            "## Learning-rate sweep",
            "",
            *_sweep_table(cfg, summary),
            "",
            "![RTN/SR gain ratio and dead-zone fraction vs learning rate](sweep.png)",
        ]
    lines += ["", "## Checks of the claims on this data (each must hold at every start checkpoint)", ""]
    lines += [f"- [{'x' if ok else ' '}] {what}: {detail}" for what, ok, detail in checks]
    lines += ["", "![accuracy, KL and changed fraction vs step; accuracy per start checkpoint](figure.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps({"summary": summary, "checks": checks}, indent=1, default=str))
    return out / "report.md"


def _plot(cfg: CompareConfig, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = _load(cfg)
    starts = cfg.start_seeds[:3]  # the fourth panel of the row: the gain, averaged over all of them
    fig, axes = plt.subplots(2, 4, figsize=(22, 9.6))
    top, bottom = axes[0], axes[1]
    for cell in cells(cfg):
        runs = [rows for seeds in data[cell.label].values() for rows in seeds]
        means = {}
        for ax, key in zip(top[:2], ("eval_accuracy", "eval_kl")):
            curves = [_eval_curve(rows, key) for rows in runs]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            vals = [[c[s] for c in curves] for s in steps]
            means[key] = [_mean(v) for v in vals]
            (line,) = ax.plot(steps, means[key], label=cell.label)
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
        top[2].plot(means["eval_accuracy"], means["eval_kl"], label=cell.label)
        rows = runs[0]
        changed = [(r["step"], r["changed_frac"]) for r in rows if r.get("changed_frac") is not None]
        top[3].plot([s for s, _ in changed], [c for _, c in changed], label=cell.label)
        acc = summary[cell.label]["mean_accuracy"]
        bottom[3].plot(list(acc), [a - acc[min(acc)] for a in acc.values()], label=cell.label)
        for ax, w in zip(bottom, starts):
            curves = [_eval_curve(rows, "eval_accuracy") for rows in data[cell.label][w]]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(steps, [_mean([c[s] for c in curves]) for s in steps], label=cell.label)
    for ax, w in zip(bottom, starts):
        ref = summary[label(cfg.reference, cells(cfg)[0].lr)]["per_start"][w]["start_accuracy"]
        ax.set(
            title=f"start checkpoint {w} (warm-up seed {w}; {cfg.reference} acc @0 {ref:.3f})",
            xlabel="GRPO step",
            ylabel="eval accuracy (mean over seeds)",
        )
    for ax in bottom[len(starts) : 3]:
        ax.axis("off")
    bottom[3].set(
        title="accuracy gain since step 0 (mean of every run)", xlabel="GRPO step", ylabel="eval accuracy - accuracy @0"
    )
    top[0].set(
        title="eval accuracy (band: min-max over start checkpoints and seeds)", xlabel="GRPO step", ylabel="accuracy"
    )
    top[1].set(title="KL(policy || start) at answer positions", xlabel="GRPO step", ylabel="KL (nats/token)")
    top[2].set(title="KL vs accuracy (means): drift paid per gain", xlabel="eval accuracy", ylabel="KL (nats/token)")
    top[3].set(
        title="working-weight elements changed per step (first run)",
        xlabel="GRPO step",
        yscale="log" if any(y > 0 for ln in top[3].get_lines() for y in ln.get_ydata()) else "linear",
    )
    top[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_sweep(cfg: CompareConfig, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = _load(cfg)
    lrs = [float(v) for v in cfg.lrs]
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.8))
    rs = [s for s in cfg.report_steps if s in summary[label(cfg.reference, lrs[0])]["gain_at"]]
    for s in rs:
        ratios = [_gain_ratio(cfg, summary, lr, s) for lr in lrs]
        axes[0].plot(lrs, [float("nan") if r is None else r for r in ratios], marker="o", label=f"step {s}")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(
        xscale="log",
        xlim=(min(lrs) / 1.5, max(lrs) * 1.5),  # limits even if every ratio is undefined
        title=f"accuracy gain of bf16 (RTN) / {cfg.reference}",
        xlabel="learning rate",
        ylabel="gain ratio (1 = no lag)",
    )
    axes[0].set_xticks(lrs, [f"{v:g}" for v in lrs])
    axes[0].minorticks_off()
    axes[0].legend(fontsize=8)
    for i, lr in enumerate(lrs):
        color = f"C{i}"
        name = label("bf16", lr) if label("bf16", lr) in data else label(cfg.reference, lr)
        curves = [
            [(r["step"], r["dead_zone_frac"]) for r in rows if r.get("dead_zone_frac") is not None]
            for seeds in data[name].values()
            for rows in seeds
        ]
        if curves and all(curves):
            n = min(len(c) for c in curves)
            beyond = [1 - _mean([c[j][1] for c in curves]) for j in range(n)]
            axes[1].plot([s for s, _ in curves[0][:n]], beyond, color=color, label=f"lr {lr:g}")
        for run, style in ((label(cfg.reference, lr), "-"), (label("bf16", lr), "--")):
            if run in summary:
                acc = summary[run]["mean_accuracy"]
                axes[2].plot(list(acc), list(acc.values()), style, color=color, label=f"{run}")
    axes[1].set(
        title="updates beyond the BF16 dead zone (1 - dead zone; bf16 run)",
        xlabel="GRPO step",
        ylabel="share of non-zero updates >= half a BF16 spacing",
        yscale="log" if axes[1].get_lines() else "linear",
    )
    axes[1].legend(fontsize=8)
    axes[2].set(
        title=f"eval accuracy: {cfg.reference} (solid) vs bf16 RTN (dashed)",
        xlabel="GRPO step",
        ylabel="accuracy (mean)",
    )
    axes[2].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
