"""The comparison: start checkpoints x seeds x learning rates, their spreads, and claim checks that
must hold at every start checkpoint."""

import json
import math
import shutil

import pytest
import torch

from dist_sr.rl.compare import (
    cells,
    load_compare,
    run_comparison,
    run_config,
    run_dir,
    run_seeds,
    summarize,
    write_report,
)
from dist_sr.rl.config import ConfigError

from .conftest import EASY

STEPS_20 = {"grpo": {"steps": 20}}  # the synthetic runs below end at step 20
RUNS = [
    {"name": "fp32", "precision": "fp32"},
    {"name": "bf16", "precision": "bf16"},
    {"name": "bf16-sr", "precision": "bf16-sr"},
]


def write_curves(cfg, curves: dict, dead: dict | None = None) -> None:
    """Metrics files as the trainer writes them: ``curves[(label, start, seed)]`` is the eval
    accuracy at steps 0, 10, 20; every step has a train row."""
    for cell in cells(cfg):
        for start in cfg.start_seeds:
            for seed in run_seeds(cfg, cell):
                acc = curves[(cell.label, start, seed)]
                path = run_dir(cfg, cell, start, seed)
                path.mkdir(parents=True)
                rows = [{"step": 0, "eval_accuracy": acc[0], "eval_kl": 0.0}]
                for step in range(1, 21):
                    row = {
                        "step": step,
                        "reward": 0.5,
                        "changed_frac": 0.01,
                        "dead_zone_frac": (dead or {}).get(cell.label),
                    }
                    if step % 10 == 0:
                        row.update(eval_accuracy=acc[step // 10], eval_kl=1e-3 * step)
                    rows.append(row)
                (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_spreads_and_checks_are_over_start_checkpoints(tmp_path):
    fp16 = {"name": "fp16", "precision": "fp16", "seeds": [0]}  # a slow run: one seed per start checkpoint
    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path),
            "experiment": STEPS_20,
            "start_seeds": [0, 1],
            "seeds": [0, 1],
            "runs": RUNS + [fp16],
            "report_steps": [10, 20],
            "threshold": 0.05,
        },
    )
    curves = {("fp16", 0, 0): [0.2, 0.34, 0.35], ("fp16", 1, 0): [0.3, 0.40, 0.44]}
    for seed in (0, 1):
        # start 0 (acc 0.2): SR +0.10/+0.12 at step 10 (seeds 0/1), RTN +0.02: RTN lags (0.18x)
        curves[("bf16-sr", 0, seed)] = [0.2, 0.30 + 0.02 * seed, 0.35]
        curves[("fp32", 0, seed)] = [0.2, 0.31 + 0.02 * seed, 0.35]
        curves[("bf16", 0, seed)] = [0.2, 0.22, 0.30]
        # start 1 (acc 0.3): SR +0.10, RTN +0.08 at step 10: RTN keeps up (0.8x), reaches +0.05 as early
        curves[("bf16-sr", 1, seed)] = [0.3, 0.40, 0.45]
        curves[("fp32", 1, seed)] = [0.3, 0.40, 0.44]
        curves[("bf16", 1, seed)] = [0.3, 0.38, 0.45]
    write_curves(cfg, curves, dead={"bf16": 0.99})
    summary = summarize(cfg)
    sr = summary["bf16-sr"]
    # mean of the four runs; std of the checkpoint means (0.31, 0.40); mean of the seed stds (0.01, 0)
    mean, over_starts, over_seeds = sr.accuracy_at[10]
    assert (mean, over_starts, over_seeds) == pytest.approx((0.355, 0.045, 0.005))
    assert sr.per_start[0].gain_at[10] == pytest.approx(0.11)
    assert sr.per_start[1].start_accuracy == pytest.approx(0.3)
    assert summary["bf16"].dead_zone_frac == pytest.approx(0.99) and sr.dead_zone_frac is None

    report = write_report(cfg).read_text()
    assert "| bf16-sr | 0.355 ± 0.045 / 0.005 |" in report
    assert "| fp16 | 0.370 ± 0.030 / — |" in report and "| 0 | fp16 | 0.200 | 0.340 | 0.350 | 10 |" in report
    assert "| 1 | bf16 | 0.300 | 0.380 | 0.450 | 10 |" in report  # the per-checkpoint table
    checks = {line[6:].split(":")[0]: line for line in report.splitlines() if line.startswith("- [")}
    gain = checks["bf16 (RTN) gain at step 10 <= 0.6x bf16-sr's"]
    assert gain.startswith("- [ ]") and "holds at 1/2 start checkpoints (0: 0.18x, 1: 0.80x)" in gain
    steps = checks["bf16 (RTN) needs >= 1.3x bf16-sr's steps to gain +0.05"]
    assert steps.startswith("- [ ]") and "(0: 2.00x, 1: 1.00x)" in steps
    within = checks["bf16-sr accuracy within 0.02 of fp32 at [10, 20]"]
    assert within.startswith("- [x]") and "holds at 2/2" in within
    within16 = checks["bf16-sr accuracy within 0.02 of fp16 at [10, 20]"]
    assert (
        within16.startswith("- [ ]")
        and "holds at 1/2 start checkpoints (0: largest gap 0.030, 1: largest gap 0.010)" in within16
    )
    assert (tmp_path / "figure.png").stat().st_size > 0


def test_a_sweep_reports_each_learning_rate_with_its_dead_zone(tmp_path):
    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path),
            "experiment": STEPS_20,
            "start_seeds": [0],
            "seeds": [0],
            "runs": RUNS,
            "lrs": [2e-6, 2e-5],
            "report_steps": [10, 20],
        },
    )
    assert [c.label for c in cells(cfg)] == [
        "fp32@2e-06",
        "bf16@2e-06",
        "bf16-sr@2e-06",
        "fp32@2e-05",
        "bf16@2e-05",
        "bf16-sr@2e-05",
    ]
    exp = run_config(cfg, cells(cfg)[4], 0, 0)
    assert exp.grpo.lr == 2e-5 and exp.precision.precision == "bf16"
    curves = {}
    for lr, rtn_gain in (("2e-06", 0.01), ("2e-05", 0.08)):
        curves[(f"fp32@{lr}", 0, 0)] = curves[(f"bf16-sr@{lr}", 0, 0)] = [0.2, 0.3, 0.4]
        curves[(f"bf16@{lr}", 0, 0)] = [0.2, 0.2 + rtn_gain, 0.4]
    write_curves(cfg, curves, dead={"bf16@2e-06": 0.999, "bf16@2e-05": 0.98})
    report = write_report(cfg).read_text()
    assert "| 2e-06 | 0.9990 | 0.10% | 0.400 @20 | 0.400 @20 | 0.400 @20 | 0.10x @10, 1.00x @20 | 2.00x |" in report
    assert "| 2e-05 | 0.9800 | 2.00% | 0.400 @20 | 0.400 @20 | 0.400 @20 | 0.80x @10, 1.00x @20 | 1.00x |" in report
    assert "at lr 2e-06: holds at 1/1" in report and (tmp_path / "sweep.png").stat().st_size > 0


def test_a_report_over_unfinished_runs_is_refused_naming_them(tmp_path):
    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path),
            "experiment": STEPS_20,
            "start_seeds": [0, 1],
            "seeds": [0],
            "runs": RUNS,
            "report_steps": [10, 20],
        },
    )
    curves = {(c.label, w, 0): [0.2, 0.3, 0.4] for c in cells(cfg) for w in (0, 1)}
    write_curves(cfg, curves)
    cut = run_dir(cfg, cells(cfg)[1], 1, 0) / "metrics.jsonl"  # bf16 from checkpoint 1 stopped at step 12
    cut.write_text("".join(line + "\n" for line in cut.read_text().splitlines()[:13]))
    (run_dir(cfg, cells(cfg)[2], 0, 0) / "metrics.jsonl").unlink()  # bf16-sr from checkpoint 0 never started
    with pytest.raises(
        ConfigError,
        match=r"2 runs under .* are not finished \(bf16/start-1/seed-0, "
        r"bf16-sr/start-0/seed-0\); run 'dist-sr compare' with this config",
    ):
        write_report(cfg)


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"start_seeds": []}, "start_seeds must be a non-empty list of ints"),
        ({"seeds": [1, 1]}, "seeds has duplicates"),
        ({"runs": [{"name": "a", "precision": "bf16", "seeds": []}], "reference": "a"}, "runs\\[0\\].seeds must be"),
        ({"lrs": [1e-5, -1.0]}, "lrs must be a list of positive learning rates"),
        ({"runs": [{"name": "a@b", "precision": "bf16"}], "reference": "a@b"}, "may not contain '@'"),
        ({"experiment": {"model": {"path": "/models/q"}}, "start_seeds": [0, 1]}, "this experiment has no warm-up"),
        ({"experiment": {"warmup": {"enabled": False}}, "start_seeds": [0, 1]}, "set start_seeds: \\[0\\]"),
    ],
)
def test_bad_sweeps_and_start_checkpoints_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_compare(None, overrides)


@pytest.mark.slow
def test_start_checkpoints_are_warmed_up_from_their_own_seed_and_finished_runs_are_reused(tmp_path, warmup_cache):
    easy = {k: dict(v) for k, v in EASY.items()}
    easy["grpo"].update(steps=2)
    easy["eval"].update(every=1)
    easy["warmup"].update(cache_dir=str(tmp_path / "cache"), max_steps=40)
    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path / "out"),
            "experiment": easy,
            "start_seeds": [3, 4],
            "seeds": [0],
            "runs": RUNS[1:],
            "report_steps": [1, 2],
            "parallel": 2,
        },
    )
    run_comparison(cfg, progress=False)
    from dist_sr.rl.warmup import warmup_checkpoint

    ckpts = [warmup_checkpoint(run_config(cfg, cells(cfg)[0], start, 0), progress=False) for start in (3, 4)]
    assert ckpts[0] != ckpts[1]
    from safetensors.torch import load_file

    a, b = (load_file(str(c / "model.safetensors")) for c in ckpts)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # two different start checkpoints
    for cell in cells(cfg):
        for start in (3, 4):
            recorded = (run_dir(cfg, cell, start, 0) / "config.yaml").read_text()
            assert f"seed: {start}" in recorded.split("warmup:")[1].split("grpo:")[0]
            rows = [json.loads(x) for x in (run_dir(cfg, cell, start, 0) / "metrics.jsonl").read_text().splitlines()]
            assert [r["step"] for r in rows] == [0, 1, 2]
            dead = [r["dead_zone_frac"] for r in rows[1:]]
            assert all(d is None or 0.0 <= d <= 1.0 for d in dead)
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "out").rglob("metrics.jsonl")}
    report = run_comparison(cfg, progress=False).read_text()  # nothing left to train: the runs are reused
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert "holds at" in report and not math.isnan(summarize(cfg)["bf16"].final_accuracy)


@pytest.mark.slow
def test_the_larger_experiment_runs_its_own_config_for_a_few_steps(tmp_path):
    from pathlib import Path

    from safetensors import safe_open

    root = Path(__file__).resolve().parents[2]
    tiny = {
        "grpo": {"steps": 2, "prompts_per_step": 4},
        "warmup": {
            "max_steps": 2,
            "eval_every": 1,
            "eval_prompts": 16,
            "batch_size": 16,
            "cache_dir": str(tmp_path / "cache"),
        },
        "eval": {"every": 1, "num_prompts": 16},
    }
    cfg = load_compare(
        root / "configs" / "compare-large.yaml",
        {"output_dir": str(tmp_path / "out"), "start_seeds": [0], "experiment": tiny, "report_steps": [1, 2]},
    )
    assert {c.spec.precision for c in cells(cfg)} == {"fp32", "fp16", "bf16", "bf16-sr"}
    exp = run_config(cfg, cells(cfg)[0], 0, 0)
    assert exp.task.name == "add" and exp.model.hidden_size == 384  # the GPU config's model and task
    run_comparison(cfg, progress=False)
    from dist_sr.rl.warmup import warmup_checkpoint

    with safe_open(str(warmup_checkpoint(exp, progress=False) / "model.safetensors"), "pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert 10e6 <= n <= 20e6  # ~100x the quickstart's 109k parameters
    for cell in cells(cfg):
        rows = [json.loads(x) for x in (run_dir(cfg, cell, 0, 0) / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert all(math.isfinite(r["loss"]) for r in rows[1:])
        # two warm-up steps leave addition unsolved: rewards (and updates) may all be zero here
        assert all(r["dead_zone_frac"] is None or 0.0 <= r["dead_zone_frac"] <= 1.0 for r in rows[1:])
    assert (tmp_path / "out" / "report.md").exists()


def test_the_larger_experiments_cpu_form_is_the_gpu_one_reduced_as_it_says():
    """configs/compare-large-cpu.yaml: the GPU comparison's model, task, warm-up recipe and GRPO
    settings, with fewer steps, one start and seed and no fp16; a lone warm-up gets both cores."""
    from pathlib import Path

    from dist_sr.rl.compare.runner import warmup_threads

    root = Path(__file__).resolve().parents[2]
    cpu = load_compare(root / "configs" / "compare-large-cpu.yaml")
    gpu = load_compare(root / "configs" / "compare-large.yaml")
    a, b = run_config(cpu, cells(cpu)[0], 0, 0), run_config(gpu, cells(gpu)[0], 0, 0)
    assert a.model == b.model and a.task == b.task and a.grpo.lr == b.grpo.lr == 2e-6
    assert (a.warmup.max_steps, b.warmup.max_steps) == (1800, 6000) and a.warmup.target_accuracy == 0.25
    assert (a.grpo.steps, b.grpo.steps) == (100, 300) and (cpu.start_seeds, cpu.seeds) == ([0], [0])
    assert {c.spec.precision for c in cells(cpu)} == {"fp32", "bf16", "bf16-sr"}
    assert warmup_threads(cpu.parallel, 1) == 2 and warmup_threads(2, 3) == 1 and warmup_threads(4, 0) == 4


def write_runs(cfg, curves: dict, gaps: dict | None = None, steps: dict | None = None) -> None:
    """Metrics files with eval rows every 5 steps: ``curves[(label, start, seed)]`` is the accuracy at
    steps 0, 5, 10, ...; every train row logs the trainer-engine gap ``gaps[label]`` (if given)."""
    for cell in cells(cfg):
        for start in cfg.start_seeds:
            for seed in run_seeds(cfg, cell):
                acc = curves[(cell.label, start, seed)]
                path = run_dir(cfg, cell, start, seed)
                path.mkdir(parents=True)
                rows = [{"step": 0, "eval_accuracy": acc[0], "eval_kl": 0.0}]
                for step in range(1, 5 * (len(acc) - 1) + 1):
                    row = {"step": step, "reward": 0.5, "changed_frac": 0.01}
                    if gaps and cell.label in gaps:
                        row["mismatch_abs_mean"] = gaps[cell.label]
                    if step % 5 == 0:
                        row.update(eval_accuracy=acc[step // 5], eval_kl=1e-3 * step)
                    rows.append(row)
                (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_run_trains_at_the_rates_it_names_and_a_rate_has_its_own_steps_and_report_steps(tmp_path):
    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path),
            "experiment": {"grpo": {"steps": 10}},
            "start_seeds": [0],
            "seeds": [0, 1],
            "lrs": [1e-6, 1e-5],
            "per_lr": [{"lr": 1e-6, "steps": 20, "report_steps": [10, 20]}],
            "report_steps": [5, 10],
            "runs": [
                {"name": "fp32", "precision": "fp32", "lrs": [1e-5]},
                {"name": "bf16", "precision": "bf16"},
                {"name": "bf16-sr", "precision": "bf16-sr"},
            ],
        },
    )
    assert [c.label for c in cells(cfg)] == ["bf16@1e-06", "bf16-sr@1e-06", "fp32@1e-05", "bf16@1e-05", "bf16-sr@1e-05"]
    steps = {c.label: run_config(cfg, c, 0, 0).grpo.steps for c in cells(cfg)}
    assert steps == {"bf16@1e-06": 20, "bf16-sr@1e-06": 20, "fp32@1e-05": 10, "bf16@1e-05": 10, "bf16-sr@1e-05": 10}
    curves = {}
    for seed in (0, 1):
        curves[("bf16-sr@1e-06", 0, seed)] = [0.2, 0.2, 0.25, 0.3, 0.4]  # steps 0..20
        curves[("bf16@1e-06", 0, seed)] = [0.2, 0.2, 0.2, 0.2, 0.21]
        for name in ("fp32", "bf16-sr", "bf16"):
            curves[(f"{name}@1e-05", 0, seed)] = [0.2, 0.4, 0.5]  # steps 0, 5, 10
    write_runs(cfg, curves)
    summary = summarize(cfg)
    assert list(summary["bf16-sr@1e-06"].accuracy_at) == [10, 20] and list(summary["fp32@1e-05"].accuracy_at) == [5, 10]
    report = write_report(cfg).read_text()
    checks = [line for line in report.splitlines() if line.startswith("- [")]
    assert any("bf16 (RTN) gain at step 10 <= 0.6x bf16-sr's at lr 1e-06" in c for c in checks)  # its own first step
    assert any("bf16 (RTN) gain at step 5 <= 0.6x bf16-sr's at lr 1e-05" in c for c in checks)
    assert "| fp32@1e-05 | 0.400 ± 0.000 / 0.000 | 0.500 ± 0.000 / 0.000 | — |" in report  # no step-20 value
    assert "| 1e-06 | — | — | — | 0.210 @20 | 0.400 @20 | 0.00x @10, 0.05x @20 | RTN: 0/2 runs reach it |" in report


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"lrs": [1e-5], "runs": [{"name": "bf16-sr", "lrs": [1e-6]}]}, "runs\\[0\\].lrs=\\[1e-06\\]: a run trains"),
        (
            {"lrs": [1e-6, 1e-5], "runs": [{"name": "bf16-sr", "lrs": [1e-5]}, {"name": "b", "precision": "bf16"}]},
            "the reference 'bf16-sr' must train at every learning rate",
        ),
        ({"lrs": [1e-5], "per_lr": [{"lr": 1e-6, "steps": 5}]}, "per_lr\\[0\\].lr=1e-06 is not one of"),
        ({"lrs": [1e-5], "per_lr": [{"lr": 1e-5, "steps": 0}]}, "per_lr\\[0\\].steps must be >= 1"),
        ({"on_policy_gap": 0}, "on_policy_gap must be > 0"),
    ],
)
def test_bad_per_rate_settings_are_refused_naming_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_compare(None, overrides)


def test_claims_are_checked_on_intervals_over_seeds_and_refused_for_a_run_that_is_not_on_policy(tmp_path):
    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path),
            "experiment": {"grpo": {"steps": 10}},
            "start_seeds": [0, 1],
            "seeds": [0, 1, 2],
            "report_steps": [5, 10],
            "runs": [*RUNS, {"name": "fp16", "precision": "fp16"}],
            "on_policy_gap": 0.05,
        },
    )
    curves = {}
    for start in (0, 1):
        for seed in (0, 1, 2):
            # SR +0.2 at step 5 at every seed; RTN +0.02 at start 0 (a lag at every seed), and at
            # start 1 +0.04 on the mean but +0.12 at seed 1: its mean lags, its interval does not show it
            curves[("bf16-sr", start, seed)] = [0.2, 0.4, 0.5]
            curves[("fp16", start, seed)] = [0.2, 0.4, 0.5]
            curves[("fp32", start, seed)] = [0.2, 0.4, 0.5]
            rtn = [[0.02, 0.02, 0.02], [0.0, 0.12, 0.0]][start][seed]
            curves[("bf16", start, seed)] = [0.2, 0.2 + rtn, 0.5]
    write_runs(cfg, curves, gaps={"fp32": 0.28, "fp16": 0.001, "bf16": 0.02, "bf16-sr": 0.02})
    report = write_report(cfg).read_text()
    checks = {line[6:].split(":")[0]: line for line in report.splitlines() if line.startswith("- [")}
    fp32 = checks["bf16-sr accuracy within 0.02 of fp32 at [5, 10]"]
    assert fp32.startswith("- [ ]") and "refused, not checked: fp32 is off-policy" in fp32 and "0.2800 > " in fp32
    fp16 = checks["bf16-sr accuracy within 0.02 of fp16 at [5, 10]"]
    assert fp16.startswith("- [x]") and "on the 95% interval over seeds at 2/2" in fp16
    gain = checks["bf16 (RTN) gain at step 5 <= 0.6x bf16-sr's"]
    assert "holds at 2/2 start checkpoints (0: 0.10x, 1: 0.20x)" in gain and "over seeds at 1/2" in gain
    assert gain.startswith("- [ ]")  # the means hold everywhere, the interval does not: not called held
    assert "| fp32 | 0.2800 | 0.2800 | no: fp32 is off-policy" in report
    assert "| bf16-sr | 0.0200 | 0.0200 | yes |" in report


def test_the_chain_sum_comparisons_cpu_form_is_the_gpu_one_reduced_as_it_says():
    """configs/compare-smollm2-chain_sum-cpu.yaml: the GPU comparison's model, task, start checkpoints
    and seeds, every run on-policy-checked, with fewer steps and prompts; no seed cut."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cpu = load_compare(root / "configs" / "compare-smollm2-chain_sum-cpu.yaml")
    gpu = load_compare(root / "configs" / "compare-smollm2-chain_sum.yaml")
    a, b = run_config(cpu, cells(cpu)[0], 0, 0), run_config(gpu, cells(gpu)[0], 0, 0)
    assert a.model == b.model and a.task == b.task and a.warmup == b.warmup and a.warmup.pretrained
    assert a.task.name == "reasoning-gym" and a.task.gym.dataset == "chain_sum"
    assert (cpu.start_seeds, cpu.seeds) == (gpu.start_seeds, gpu.seeds) == ([0, 1], [0, 1, 2])
    assert all(spec.seeds is None for spec in cpu.runs)  # every run: every seed
    assert (
        {c.spec.precision for c in cells(cpu)}
        == {c.spec.precision for c in cells(gpu)}
        == {
            "fp32",
            "fp16",
            "bf16",
            "bf16-sr",
        }
    )
    steps = {c.label: run_config(cpu, c, 0, 0).grpo.steps for c in cells(cpu)}
    assert steps["bf16-sr@1e-05"] == 15 and steps["bf16-sr@1e-06"] == steps["bf16@1e-06"] == 30
    assert b.grpo.steps == 200 and (a.grpo.prompts_per_step, b.grpo.prompts_per_step) == (8, 32)
    assert cpu.threads == 1 and cpu.parallel == 1 and cpu.on_policy_gap == gpu.on_policy_gap == 0.05


def test_runs_one_at_a_time_go_cheapest_first_each_start_checkpoints_seeds_together_and_in_parallel_longest_first():
    from dist_sr.rl.compare.runner import queue_order, run_cost

    cfg = load_compare(
        None,
        {
            "start_seeds": [0, 1],
            "seeds": [0, 1],
            "lrs": [1e-5, 1e-6],
            "per_lr": [{"lr": 1e-6, "steps": 30}],
            "experiment": {"grpo": {"steps": 15}},
            "runs": [
                {"name": "fp16", "precision": "fp16", "lrs": [1e-5]},
                {"name": "fp32", "precision": "fp32", "lrs": [1e-5]},
                {"name": "bf16", "precision": "bf16"},
                {"name": "bf16-sr", "precision": "bf16-sr"},
            ],
        },
    )
    jobs = [
        (cell, start, seed, run_config(cfg, cell, start, seed))
        for cell in cells(cfg)
        for start in cfg.start_seeds
        for seed in run_seeds(cfg, cell)
    ]
    one = queue_order(jobs, parallel=1)
    assert [run_cost(j[3]) for j in one] == sorted(run_cost(j[3]) for j in jobs)
    assert [(j[0].label, j[1], j[2]) for j in one[:8]] == [
        (label, start, seed) for start in (0, 1) for seed in (0, 1) for label in ("bf16@1e-05", "bf16-sr@1e-05")
    ]  # bf16 against bf16-sr at every start checkpoint and seed before anything slower
    assert {j[0].label for j in one[-4:]} == {"fp16@1e-05"}  # ~14x a BF16 step on a CPU: last
    many = queue_order(jobs, parallel=2)
    assert {j[0].label for j in many[:4]} == {"fp16@1e-05"}


def _archived_comparison(tmp_path, warmup_cache, out: str, lr: float = 3e-3):
    easy = {k: dict(v) for k, v in EASY.items()}
    easy["grpo"].update(steps=2, lr=lr)
    easy["eval"].update(every=1)
    easy["warmup"].update(cache_dir=warmup_cache)
    return load_compare(
        None,
        {
            "output_dir": str(tmp_path / out),
            "archive_dir": str(tmp_path / "archive"),
            "experiment": easy,
            "start_seeds": [0],
            "seeds": [0],
            "runs": RUNS[1:],
            "report_steps": [1, 2],
            "parallel": 1,
        },
    )


def test_finished_runs_are_archived_and_a_new_session_restores_them_instead_of_training_again(tmp_path, warmup_cache):
    cfg = _archived_comparison(tmp_path, warmup_cache, "session-1")
    run_comparison(cfg, progress=False)
    archive = tmp_path / "archive"
    starts = json.loads((archive / "start-0.json").read_text())
    assert starts["start_seed"] == 0 and starts["digest"].startswith("sha256:") and starts["machine"]
    kept = {p.relative_to(archive).as_posix() for p in archive.rglob("*") if p.is_file()}
    assert kept == {"start-0.json"} | {
        f"{c.label}/start-0/seed-0/{name}" for c in cells(cfg) for name in ("metrics.jsonl", "config.yaml")
    }  # metrics and settings only: no checkpoint in the archive

    # the next session: a fresh output_dir and no warm-up cache, the archive carried over
    fresh = _archived_comparison(tmp_path, str(tmp_path / "empty-cache"), "session-2")
    report = run_comparison(fresh, progress=False).read_text()
    assert not (tmp_path / "empty-cache").exists()  # nothing warmed up, nothing trained
    for cell in cells(cfg):
        a, b = (run_dir(c, cell, 0, 0) / "metrics.jsonl" for c in (cfg, fresh))
        assert a.read_bytes() == b.read_bytes()
    assert "holds at" in report or "does not hold" in report
    from dist_sr.rl.compare import report_comparison

    third = _archived_comparison(tmp_path, str(tmp_path / "empty-cache"), "session-3")
    assert report_comparison(third).read_text() == report  # --report-only restores the archive too


def test_an_archived_run_with_other_settings_or_from_other_start_weights_is_refused_by_name(tmp_path, warmup_cache):
    cfg = _archived_comparison(tmp_path, warmup_cache, "session-1")
    run_comparison(cfg, progress=False)
    for out in ("session-1", "session-2"):  # finished in output_dir, or only in the archive
        other_lr = _archived_comparison(tmp_path, warmup_cache, out, lr=1e-3)
        with pytest.raises(ConfigError, match=r"grpo\.lr: 0\.003 -> 0\.001.*another output_dir"):
            run_comparison(other_lr, progress=False)

    # one run left to train, and the archive says its start checkpoint had other weights
    archive = tmp_path / "archive"
    gone = archive / cells(cfg)[0].label
    shutil.rmtree(gone)
    (archive / "start-0.json").write_text(json.dumps({"start_seed": 0, "digest": "sha256:" + "0" * 64}))
    again = _archived_comparison(tmp_path, warmup_cache, "session-3")
    refusal = r"start checkpoint 0 here has weights sha256:[0-9a-f]{64}, but the runs archived.*this machine: "
    with pytest.raises(ConfigError, match=refusal):
        run_comparison(again, progress=False)
    assert not gone.exists()  # nothing trained from the other weights was archived
