"""A comparison's report: ``report.md`` (the main table, per start checkpoint, the sweep, the
claim checks), ``figure.png`` / ``sweep.png`` and ``summary.json``, from the finished runs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..checkpoint import source_note
from ..config import ConfigError
from ..cpu_math import machine, resolve_isa
from .config import CompareConfig, cells, finished, label, report_steps, run_config, run_dir, run_seeds
from .matched import matched_checks, matched_kl, matched_lines
from .summary import (
    Summary,
    eval_curve,
    gain_ratio,
    goal_checks,
    learning_rates,
    load_runs,
    mean,
    off_policy,
    summarize,
)


def _fmt(v, p=3):
    return "—" if v is None else f"{v:.{p}f}"


def all_report_steps(cfg: CompareConfig) -> list[int]:
    """Every step some cell is reported at (the tables' columns)."""
    return sorted({s for lr in learning_rates(cfg) for s in report_steps(cfg, lr)})


def _main_table(cfg: CompareConfig, summary: Summary) -> list[str]:
    rs = all_report_steps(cfg)
    lines = [
        "| run | " + " | ".join(f"acc @{s}" for s in rs) + f" | steps to +{cfg.threshold} | "
        f"KL @ +{cfg.threshold} | final KL | final reward | changed/step | dead zone |",
        "|---|" + "---:|" * (len(rs) + 6),
    ]
    for cell in cells(cfg):
        s = summary[cell.label]
        accs = [
            f"{s.accuracy_at[k].mean:.3f} ± {s.accuracy_at[k].over_starts:.3f} / {_fmt(s.accuracy_at[k].over_seeds)}"
            if k in s.accuracy_at
            else "—"
            for k in rs
        ]
        hits = s.steps_to_threshold
        hit = (
            f"{s.mean_steps_to_threshold:.0f}"
            if s.mean_steps_to_threshold is not None
            else f"{sum(h is not None for h in hits)}/{len(hits)} runs reach it"
        )
        lines.append(
            f"| {cell.label} | " + " | ".join(accs) + f" | {hit} | {_fmt(s.kl_at_threshold, 5)} | "
            f"{_fmt(s.final_kl, 5)} | {_fmt(s.final_reward)} | {_fmt(s.changed_frac, 4)} | "
            f"{_fmt(s.dead_zone_frac, 4)} |"
        )
    return lines


def _per_start_table(cfg: CompareConfig, summary: Summary) -> list[str]:
    rs = all_report_steps(cfg)
    lines = [
        "| start checkpoint | run | acc @0 | "
        + " | ".join(f"acc @{s}" for s in rs)
        + f" | steps to +{cfg.threshold} |",
        "|---|---|" + "---:|" * (len(rs) + 2),
    ]
    for w in cfg.start_seeds:
        for cell in cells(cfg):
            ps = summary[cell.label].per_start[w]
            hit = (
                f"{ps.steps_to_threshold:.0f}"
                if ps.steps_to_threshold is not None
                else f"{ps.reached}/{len(run_seeds(cfg, cell))} seeds reach it"
            )
            lines.append(
                f"| {w} | {cell.label} | {ps.start_accuracy:.3f} | "
                + " | ".join(_fmt(ps.accuracy_at.get(s)) for s in rs)
                + f" | {hit} |"
            )
    return lines


def _sweep_table(cfg: CompareConfig, summary: Summary) -> list[str]:
    """Per learning rate: the dead-zone fraction of the RTN run, each run's last accuracy, and the
    RTN/SR ratios of gain and of steps to the threshold."""
    names = [spec.name for spec in cfg.runs]
    lines = [
        "| lr | dead zone (bf16) | beyond it | "
        + " | ".join(f"{n} acc, last step" for n in names)
        + " | RTN/SR gain at the report steps"
        + f" | RTN/SR steps to +{cfg.threshold} |",
        "|---:|---:|---:|" + "---:|" * (len(names) + 2),
    ]
    for lr in learning_rates(cfg):
        rtn, ref = summary.get(label("bf16", lr)), summary[label(cfg.reference, lr)]
        rs = [s for s in report_steps(cfg, lr) if s in ref.accuracy_at]
        gains = ", ".join(
            ("—" if r is None else f"{r:.2f}x") + f" @{s}"
            for s, r in ((s, gain_ratio(cfg, summary, lr, s)) for s in rs)
        )
        h_rtn, h_sr = (rtn.mean_steps_to_threshold if rtn else None), ref.mean_steps_to_threshold
        if not rtn or not h_sr:
            steps = "—"
        elif h_rtn is None:
            reached = rtn.steps_to_threshold
            steps = f"RTN: {sum(h is not None for h in reached)}/{len(reached)} runs reach it"
        else:
            steps = f"{h_rtn / h_sr:.2f}x"
        dz = rtn.dead_zone_frac if rtn else None
        dead = f"{_fmt(dz, 4)} | {'—' if dz is None else f'{100 * (1 - dz):.2f}%'}"
        accs = [
            f"{summary[label(n, lr)].accuracy_at[rs[-1]].mean:.3f} @{rs[-1]}"
            if label(n, lr) in summary and rs and rs[-1] in summary[label(n, lr)].accuracy_at
            else "—"
            for n in names
        ]
        lines.append(f"| {lr:g} | {dead} | " + " | ".join(accs) + f" | {gains} | {steps} |")
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
        if not finished(run_config(cfg, cell, start, seed))
    ]
    if unfinished:
        raise ConfigError(
            f"{len(unfinished)} runs under {out} are not finished ({', '.join(unfinished[:3])}"
            f"{', ...' if len(unfinished) > 3 else ''}); run 'dist-sr compare' with this config to "
            "finish them (finished runs are reused), then report"
        )
    summary = summarize(cfg)
    checks = [c for lr in learning_rates(cfg) for c in goal_checks(cfg, summary, lr)]
    _plot(cfg, summary, out / "figure.png")
    first = cells(cfg)[0]
    model = run_config(cfg, first, cfg.start_seeds[0], run_seeds(cfg, first)[0]).model.path
    lines = [
        "# dist-sr precision comparison",
        "",
        f"Model: {source_note(model)}.",
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
        f"Machine that wrote this report: {machine()}; the runs' CPU kernels (MKL, oneDNN, ATen) "
        + (
            f"pinned to {isa.upper()} (`cpu_isa`), so another CPU can still give other bits where a library "
            "picks kernels by the CPU itself."
            if (isa := resolve_isa(cfg.cpu_isa))
            else "not pinned (`cpu_isa: null`), so another CPU can give other bits."
        ),
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
    lines += [
        "",
        "## Rollouts on-policy: the trainer-engine gap of every run",
        "",
        "Per run, the mean over its steps of mean |log p_trainer - log p_engine| of the sampled tokens "
        "(the rollout engine serves the run's own precision); a run above on_policy_gap is not called "
        "on-policy and no claim is checked on it.",
        "",
        *_on_policy_lines(cfg, summary),
    ]
    signals = _signals_table(cfg)
    if signals:
        _plot_signals(cfg, out / "signals.png")
        lines += [
            "",
            "## Per-step training signals (means over the steps of every run)",
            "",
            "Reward: the share of this step's sampled completions that are right; KL k3: to the start "
            "checkpoint on those samples; changed: working-weight elements whose bits changed in the step; "
            "not reaching BF16: the share of the FP32 shadows' net movement since step 0 the working weights "
            "do not follow (last step; `StickingMeter.unfollowed_frac`); trainer-engine gap: mean |log p_trainer "
            "- log p_engine| of the sampled tokens (rollouts from another engine only).",
            "",
            *signals,
            "",
            "![reward, share of the update not reaching BF16, trainer-engine gap per step](signals.png)",
        ]
    matched = matched_kl(cfg)
    if matched:
        lines += ["", *matched_lines(matched)]
        checks += matched_checks(cfg, summary, matched)
    lines += [
        "",
        "## Checks of the claims on this data (each must hold at every start checkpoint)",
        "",
        "Each claim is read on the seed means and on the 95% interval over seeds (Student's t) of a quantity "
        "paired by seed (runs of one seed share their prompts and sampling noise); it holds only if both do at "
        "every start checkpoint. A claim about a run whose trainer-engine gap exceeds on_policy_gap "
        f"({cfg.on_policy_gap:g}) is refused: its rollouts did not come from its own weights.",
        "",
    ]
    lines += [f"- [{'x' if ok else ' '}] {what}: {detail}" for what, ok, detail in checks]
    lines += ["", "![accuracy, KL and changed fraction vs step; accuracy per start checkpoint](figure.png)", ""]
    (out / "report.md").write_text("\n".join(lines))
    as_json = {name: dataclasses.asdict(s) for name, s in summary.items()}
    (out / "summary.json").write_text(
        json.dumps(
            {"summary": as_json, "checks": checks, "matched_kl": [dataclasses.asdict(m) for m in matched]},
            indent=1,
            default=str,
        )
    )
    return out / "report.md"


def _on_policy_lines(cfg: CompareConfig, summary: Summary) -> list[str]:
    """Each cell's trainer-engine gap (mean over its runs, the largest run's) and whether it is
    on-policy: rollouts sampled from its own weights, within ``on_policy_gap``."""
    lines = [
        f"| run | trainer-engine gap (mean of runs) | largest run's | on-policy (gap <= {cfg.on_policy_gap:g}) |",
        "|---|---:|---:|---|",
    ]
    for cell in cells(cfg):
        s = summary[cell.label]
        why = off_policy(cfg, summary, cell.label)
        verdict = "no: " + why if why else ("yes" if s.engine_gap is not None else "yes (the trainer's own model)")
        lines.append(f"| {cell.label} | {_fmt(s.engine_gap, 4)} | {_fmt(s.engine_gap_max, 4)} | {verdict} |")
    return lines


SIGNALS = (  # (metrics key, column, format, reduce: mean over steps or the last step's value)
    ("reward", "reward", ".3f", "mean"),
    ("kl_k3", "KL k3", ".2e", "mean"),
    ("changed_frac", "changed/step", ".4f", "mean"),
    ("unfollowed_frac", "not reaching BF16 (last step)", ".3f", "last"),
    ("mismatch_abs_mean", "trainer-engine gap", ".4f", "mean"),
    ("step_time", "s/step", ".1f", "mean"),
)


def _signal(rows: list[dict], key: str, reduce: str) -> float | None:
    vals = [r[key] for r in rows if r["step"] > 0 and isinstance(r.get(key), (int, float))]
    if not vals:
        return None
    return vals[-1] if reduce == "last" else mean(vals)


def _signals_table(cfg: CompareConfig) -> list[str]:
    """Per cell: the per-step signals of the trainer, averaged over runs (rows only when a cell's
    runs logged the trainer-engine gap, i.e. rollouts came from a real engine)."""
    data = load_runs(cfg)
    runs = {c.label: [rows for seeds in data[c.label].values() for rows in seeds] for c in cells(cfg)}
    if not any(_signal(rows, "mismatch_abs_mean", "mean") is not None for rs in runs.values() for rows in rs):
        return []
    lines = ["| run | " + " | ".join(col for _, col, _, _ in SIGNALS) + " |", "|---|" + "---:|" * len(SIGNALS)]
    for name, rs in runs.items():
        cols = []
        for key, _, fmt, reduce in SIGNALS:
            vals = [v for v in (_signal(rows, key, reduce) for rows in rs) if v is not None]
            cols.append(format(mean(vals), fmt) if vals else "—")
        lines.append(f"| {name} | " + " | ".join(cols) + " |")
    return lines


def _plot_signals(cfg: CompareConfig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = signals_figure(cfg)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def signals_figure(cfg: CompareConfig):
    """The per-step signals of every run, one panel per signal, one colour per run in every panel
    (a run without a signal, as fp32 has no share not reaching BF16, leaves its colour unused)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load_runs(cfg)
    keys = (
        ("reward", "training reward (running mean of 5 steps)"),
        ("unfollowed_frac", "share of the FP32 update not reaching BF16"),
        ("changed_frac", "working-weight elements changed per step"),
        ("mismatch_abs_mean", "trainer-engine gap: mean |dlogp|"),
    )
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 4.2))
    for i, cell in enumerate(cells(cfg)):  # one colour per run in every panel, where it has data or not
        runs = [rows for seeds in data[cell.label].values() for rows in seeds]
        for ax, (key, _) in zip(axes, keys):
            per_step: dict[int, list[float]] = {}
            for rows in runs:
                for r in rows:
                    if r["step"] > 0 and isinstance(r.get(key), (int, float)):
                        per_step.setdefault(r["step"], []).append(r[key])
            steps = sorted(per_step)
            ys = [mean(per_step[s]) for s in steps]
            if key == "reward":
                ys = [mean(ys[max(0, i - 4) : i + 1]) for i in range(len(ys))]
            if steps:
                ax.plot(steps, ys, color=f"C{i}", label=cell.label)
    for ax, (key, title) in zip(axes, keys):
        ax.set(title=title, xlabel="GRPO step")
        if key == "changed_frac" and any(y > 0 for ln in ax.get_lines() for y in ln.get_ydata()):
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def _plot(cfg: CompareConfig, summary: Summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load_runs(cfg)
    starts = cfg.start_seeds[:3]  # the fourth panel of the row: the gain, averaged over all of them
    fig, axes = plt.subplots(2, 4, figsize=(22, 9.6))
    top, bottom = axes[0], axes[1]
    for cell in cells(cfg):
        runs = [rows for seeds in data[cell.label].values() for rows in seeds]
        means = {}
        for ax, key in zip(top[:2], ("eval_accuracy", "eval_kl")):
            curves = [eval_curve(rows, key) for rows in runs]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            vals = [[c[s] for c in curves] for s in steps]
            means[key] = [mean(v) for v in vals]
            (line,) = ax.plot(steps, means[key], label=cell.label)
            ax.fill_between(steps, [min(v) for v in vals], [max(v) for v in vals], color=line.get_color(), alpha=0.15)
        top[2].plot(means["eval_accuracy"], means["eval_kl"], label=cell.label)
        rows = runs[0]
        changed = [(r["step"], r["changed_frac"]) for r in rows if r.get("changed_frac") is not None]
        top[3].plot([s for s, _ in changed], [c for _, c in changed], label=cell.label)
        acc = summary[cell.label].mean_accuracy
        bottom[3].plot(list(acc), [a - acc[min(acc)] for a in acc.values()], label=cell.label)
        for ax, w in zip(bottom, starts):
            curves = [eval_curve(rows, "eval_accuracy") for rows in data[cell.label][w]]
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(steps, [mean([c[s] for c in curves]) for s in steps], label=cell.label)
    for ax, w in zip(bottom, starts):
        ref = summary[label(cfg.reference, cells(cfg)[0].lr)].per_start[w].start_accuracy
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


def _plot_sweep(cfg: CompareConfig, summary: Summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load_runs(cfg)
    lrs = [float(v) for v in cfg.lrs]
    fig, axes = plt.subplots(1, 3, figsize=(19, 4.8))
    for which, pick in (("first", 0), ("last", -1)):
        ratios = []
        for lr in lrs:
            rs = [s for s in report_steps(cfg, lr) if s in summary[label(cfg.reference, lr)].gain_at]
            ratios.append(gain_ratio(cfg, summary, lr, rs[pick]) if rs else None)
        axes[0].plot(lrs, [float("nan") if r is None else r for r in ratios], marker="o", label=f"{which} report step")
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
            beyond = [1 - mean([c[j][1] for c in curves]) for j in range(n)]
            axes[1].plot([s for s, _ in curves[0][:n]], beyond, color=color, label=f"lr {lr:g}")
        for run, style in ((label(cfg.reference, lr), "-"), (label("bf16", lr), "--")):
            if run in summary:
                acc = summary[run].mean_accuracy
                axes[2].plot(list(acc), list(acc.values()), style, color=color, label=f"{run}")
    axes[1].set(
        title="updates beyond the BF16 dead zone (1 - dead zone; bf16 run)",
        xlabel="GRPO step",
        ylabel="share of non-zero updates >= half a BF16 spacing",
        yscale="log" if axes[1].get_lines() else "linear",
    )
    if axes[1].get_legend_handles_labels()[0]:  # no bf16 run with dead-zone metrics: no curve to name
        axes[1].legend(fontsize=8)
    axes[2].set(
        title=f"eval accuracy: {cfg.reference} (solid) vs bf16 RTN (dashed)",
        xlabel="GRPO step",
        ylabel="accuracy (mean)",
    )
    if axes[2].get_legend_handles_labels()[0]:
        axes[2].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
