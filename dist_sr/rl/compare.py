"""The precision comparison: every mode over several seeds, everything else identical, one report.

``dist-sr compare [CONFIG]`` trains each run (precision, learning-rate scale, shadow jitter) for
each seed in parallel processes, then writes ``report.md`` (a table), ``figure.png`` (eval
accuracy, KL and changed fraction vs step with seed bands) and ``summary.json``. Finished runs
are reused, so an interrupted comparison picks up where it stopped.
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


def _default_runs() -> list[RunSpec]:
    return [
        RunSpec("fp32", "fp32"),
        RunSpec("fp16", "fp16"),
        RunSpec("bf16", "bf16"),
        RunSpec("bf16-sr", "bf16-sr"),
        RunSpec("bf16-lr4x", "bf16", lr_scale=4.0),
        RunSpec("bf16-offgrid", "bf16", shadow_jitter=True),
        RunSpec("bf16-dither", "bf16-dither"),
    ]


@dataclass
class CompareConfig:
    experiment: dict[str, Any] = field(default_factory=dict)  # overrides of the experiment defaults
    experiment_file: str | None = None                          # or a YAML file (relative to this one)
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    runs: list[RunSpec] = field(default_factory=_default_runs)
    parallel: int = 2
    threshold: float = 0.05          # accuracy gain for "steps to threshold" and matched-accuracy KL
    report_steps: list[int] = field(default_factory=lambda: [100, 200, 300])
    reference: str = "bf16-sr"       # the run others are compared with in the goal checks
    output_dir: str = "runs/compare"

    def __post_init__(self):
        if not self.seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in self.seeds):
            raise ConfigError(f"seeds must be a non-empty list of ints, got {self.seeds!r}")
        if self.parallel < 1:
            raise ConfigError(f"parallel must be >= 1 (training processes at a time), got {self.parallel}")


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
    if cfg.experiment_file:
        cfg.experiment_file = str((base / cfg.experiment_file).resolve())
    names = [r.name for r in cfg.runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"runs: duplicate run names in {names}")
    if cfg.reference not in names:
        raise ConfigError(f"reference: {cfg.reference!r} is not one of the runs {names}")
    for spec in cfg.runs:  # validate every run's experiment now, not after an hour of training
        run_config(cfg, spec, cfg.seeds[0])
    return cfg


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_config(cfg: CompareConfig, spec: RunSpec, seed: int) -> ExperimentConfig:
    """The experiment of one run and seed: the shared experiment plus the run's own settings."""
    data = load_document(Path(cfg.experiment_file)) if cfg.experiment_file else {}
    data = _deep_merge(data, cfg.experiment)
    base_lr = load_experiment(data).grpo.lr
    return load_experiment(data, {
        "precision": spec.precision,
        "grpo.lr": base_lr * spec.lr_scale,
        "shadow_jitter": spec.shadow_jitter,
        "seed": seed,
        "output_dir": str(Path(cfg.output_dir) / spec.name / f"seed-{seed}"),
        "threads": 1,
    })


def _train_one(cfg: ExperimentConfig) -> str:
    from transformers.utils import logging as hf_logging

    from .trainer import train

    hf_logging.disable_progress_bar()  # one line per finished run is enough in a worker

    return str(train(cfg, progress=False, resume="auto"))  # a run cut short continues


def _finished(cfg: ExperimentConfig) -> bool:
    path = Path(cfg.output_dir) / "metrics.jsonl"
    if not path.exists():
        return False
    from .trainer import holds_a_run, read_metrics

    lines = read_metrics(path)
    return bool(lines) and lines[-1]["step"] == cfg.grpo.steps and holds_a_run(Path(cfg.output_dir))


def run_comparison(cfg: CompareConfig, progress: bool = True) -> Path:
    """Train every run x seed (skipping finished ones), then write the report; returns report.md."""
    from .warmup import warmup_checkpoint

    jobs = [(spec, seed, run_config(cfg, spec, seed)) for spec in cfg.runs for seed in cfg.seeds]
    warmup_checkpoint(jobs[0][2], progress=progress)  # once, before the workers start
    todo = [j for j in jobs if not _finished(j[2])]
    todo.sort(key=lambda j: j[2].precision.precision != "fp16")  # slowest on a CPU first: shorter makespan
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="comparison runs", disable=not progress)
    with cf.ProcessPoolExecutor(max_workers=cfg.parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_train_one, exp): (spec.name, seed) for spec, seed, exp in todo}
        for fut in cf.as_completed(futures):
            fut.result()  # a failed run fails the comparison, with its traceback
            name, seed = futures[fut]
            bar.set_postfix_str(f"done {name} seed {seed}")
            bar.update(1)
    bar.close()
    return write_report(cfg)


# --- report -------------------------------------------------------------------------------

def _load(cfg: CompareConfig) -> dict[str, list[list[dict]]]:
    from .trainer import read_metrics

    data = {}
    for spec in cfg.runs:
        data[spec.name] = []
        for seed in cfg.seeds:
            path = Path(cfg.output_dir) / spec.name / f"seed-{seed}" / "metrics.jsonl"
            data[spec.name].append(read_metrics(path))
    return data


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def _eval_curve(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if r.get(key) is not None}  # null: a non-finite value


def summarize(cfg: CompareConfig) -> dict[str, Any]:
    data = _load(cfg)
    out: dict[str, Any] = {}
    for name, seeds in data.items():
        accs = [_eval_curve(rows, "eval_accuracy") for rows in seeds]
        kls = [_eval_curve(rows, "eval_kl") for rows in seeds]
        steps = sorted(set.intersection(*(set(a) for a in accs)))
        mean_acc = {s: _mean([a[s] for a in accs]) for s in steps}
        mean_kl = {s: _mean([k[s] for k in kls]) for s in steps}
        start = mean_acc[steps[0]]
        to_threshold = []
        for a in accs:
            hit = next((s for s in steps if a[s] - a[steps[0]] >= cfg.threshold), None)
            to_threshold.append(hit)
        mean_hit = next((s for s in steps if mean_acc[s] - start >= cfg.threshold), None)
        train_rows = [[r for r in rows if r.get("reward") is not None and r.get("changed_frac") is not None]
                      for rows in seeds]
        out[name] = {
            "steps": steps,
            "mean_accuracy": mean_acc,
            "mean_kl": mean_kl,
            "accuracy_at": {s: (_mean([a[s] for a in accs]), _std([a[s] for a in accs]))
                            for s in cfg.report_steps if s in mean_acc},
            "gain_at": {s: _mean([a[s] - a[steps[0]] for a in accs]) for s in cfg.report_steps if s in mean_acc},
            "steps_to_threshold": to_threshold,
            "mean_steps_to_threshold": (_mean(to_threshold) if all(h is not None for h in to_threshold) else None),
            "kl_at_threshold": mean_kl[mean_hit] if mean_hit is not None else None,
            "final_accuracy": mean_acc[steps[-1]],
            "final_kl": mean_kl[steps[-1]],
            "final_reward": _mean([_mean([r["reward"] for r in rows[-10:]]) for rows in train_rows]),
            "changed_frac": _mean([_mean([r["changed_frac"] for r in rows]) for rows in train_rows]),
            "seed_spread_final": _std([a[steps[-1]] for a in accs]),
        }
    return out


def goal_checks(cfg: CompareConfig, summary: dict) -> list[tuple[str, bool, str]]:
    """The paper's claims, checked on this comparison's data (reported, never tuned for)."""
    checks = []
    ref = summary.get(cfg.reference)
    for other in ("fp16", "fp32"):
        if other in summary and ref:
            diffs = [abs(ref["accuracy_at"][s][0] - summary[other]["accuracy_at"][s][0])
                     for s in ref["accuracy_at"] if s in summary[other]["accuracy_at"]]
            worst = max(diffs) if diffs else float("nan")
            checks.append((f"{cfg.reference} accuracy within 0.02 of {other} at {list(ref['accuracy_at'])}",
                           worst <= 0.02, f"largest gap {worst:.3f}"))
    if "bf16" in summary and ref:
        s100 = min(ref["gain_at"]) if ref["gain_at"] else None
        if s100 is not None:
            g_rtn, g_sr = summary["bf16"]["gain_at"][s100], ref["gain_at"][s100]
            ratio = g_rtn / g_sr if g_sr > 0 else float("nan")
            checks.append((f"bf16 (RTN) gain at step {s100} <= 0.6x {cfg.reference}'s", ratio <= 0.6,
                           f"bf16 {g_rtn:+.3f} vs {g_sr:+.3f} ({ratio:.2f}x)"))
        h_rtn, h_sr = summary["bf16"]["mean_steps_to_threshold"], ref["mean_steps_to_threshold"]
        if h_sr:
            ok = h_rtn is None or h_rtn >= 1.3 * h_sr
            checks.append((f"bf16 (RTN) needs >= 1.3x {cfg.reference}'s steps to gain +{cfg.threshold}", ok,
                           f"bf16 {h_rtn if h_rtn is not None else 'never'} vs {h_sr:.0f} steps"))
    return checks


def write_report(cfg: CompareConfig) -> Path:
    out = Path(cfg.output_dir)
    if not any((Path(run_config(cfg, spec, seed).output_dir) / "metrics.jsonl").exists()
               for spec in cfg.runs for seed in cfg.seeds):
        raise ConfigError(f"no finished runs under {out} to report on; run 'dist-sr compare' without --report-only")
    summary = summarize(cfg)
    checks = goal_checks(cfg, summary)
    _plot(cfg, out / "figure.png")
    fmt = lambda v, p=3: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
    rs = cfg.report_steps
    lines = [
        "# dist-sr precision comparison",
        "",
        f"Seeds: {cfg.seeds}. Eval accuracy is sampled accuracy on fixed prompts with fixed sampling noise "
        f"(mean ± std over seeds); KL is exact KL(policy || start checkpoint) at answer positions; "
        f"'steps to +{cfg.threshold}' is per seed, then averaged; 'KL @ +{cfg.threshold}' is the KL when "
        "the seed-mean accuracy first gains that much (matched accuracy).",
        "",
        "| run | " + " | ".join(f"acc @{s}" for s in rs) + f" | steps to +{cfg.threshold} | KL @ +{cfg.threshold} "
        "| final KL | final reward | changed/step |",
        "|---|" + "---:|" * (len(rs) + 5),
    ]
    for spec in cfg.runs:
        s = summary[spec.name]
        accs = [f"{s['accuracy_at'][k][0]:.3f} ± {s['accuracy_at'][k][1]:.3f}" if k in s["accuracy_at"] else "—"
                for k in rs]
        hits = s["steps_to_threshold"]
        hit = f"{s['mean_steps_to_threshold']:.0f}" if s["mean_steps_to_threshold"] is not None else \
            f"{sum(h is not None for h in hits)}/{len(hits)} seeds reach it"
        lines.append(f"| {spec.name} | " + " | ".join(accs) + f" | {hit} | {fmt(s['kl_at_threshold'], 5)} | "
                     f"{fmt(s['final_kl'], 5)} | {fmt(s['final_reward'])} | {fmt(s['changed_frac'], 4)} |")
    lines += ["", "## Checks of the claims on this data", ""]
    lines += [f"- [{'x' if ok else ' '}] {what}: {detail}" for what, ok, detail in checks]
    lines += ["", "![accuracy, KL and changed fraction vs step](figure.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps({"summary": summary, "checks": checks}, indent=1, default=str))
    return out / "report.md"


def _plot(cfg: CompareConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = _load(cfg)
    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    for spec in cfg.runs:
        seeds = data[spec.name]
        means = {}
        for ax, key in zip(axes[:2], ("eval_accuracy", "eval_kl")):
            curves = [_eval_curve(rows, key) for rows in seeds]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            vals = [[c[s] for c in curves] for s in steps]
            means[key] = [_mean(v) for v in vals]
            line, = ax.plot(steps, means[key], label=spec.name)
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
        axes[2].plot(means["eval_accuracy"], means["eval_kl"], label=spec.name)
        rows = seeds[0]
        steps = [r["step"] for r in rows if r.get("changed_frac") is not None]
        changed = [r["changed_frac"] for r in rows if r.get("changed_frac") is not None]
        axes[3].plot(steps, changed, label=spec.name)
    axes[0].set(title="eval accuracy (band: min-max over seeds)", xlabel="GRPO step", ylabel="accuracy")
    axes[1].set(title="KL(policy || start) at answer positions", xlabel="GRPO step", ylabel="KL (nats/token)")
    axes[2].set(title="KL vs accuracy (seed means): drift paid per gain", xlabel="eval accuracy",
                ylabel="KL (nats/token)")
    axes[3].set(title="working-weight elements changed per step (seed 0)", xlabel="GRPO step", yscale="log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
