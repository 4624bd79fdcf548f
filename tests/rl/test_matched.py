"""KL at matched accuracy (the paper's second claim): read off each run's (accuracy gain, KL added)
curve where it first reaches the gain both runs reach, per seed, with the spread over seeds."""

import json

import pytest

from dist_sr.rl.compare import cells, load_compare, run_dir, run_seeds, write_report
from dist_sr.rl.compare.matched import kl_at_gain, matched_kl


def test_kl_at_a_gain_is_read_off_the_curve_where_it_is_first_reached():
    curve = [(0.0, 0.0), (0.1, 0.02), (0.3, 0.06), (0.2, 0.08)]
    assert kl_at_gain(curve, 0.2) == pytest.approx(0.04)  # halfway between the 2nd and 3rd evaluations
    assert kl_at_gain(curve, 0.1) == pytest.approx(0.02)
    assert kl_at_gain(curve, 0.4) is None


def test_the_raised_lr_run_is_matched_against_the_reference_per_seed(tmp_path):
    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path),
            "experiment": {"grpo": {"steps": 10}},
            "start_seeds": [0],
            "seeds": [0, 1],
            "runs": [
                {"name": "bf16-sr", "precision": "bf16-sr"},
                {"name": "bf16-lr4x", "precision": "bf16", "lr_scale": 4.0},
            ],
            "report_steps": [5, 10],
            "threshold": 0.05,
        },
    )
    # (accuracy, KL) at steps 0, 5, 10; a BF16 policy's KL at step 0 is its rounding (0.001)
    curves = {
        ("bf16-sr", 0): [(0.30, 0.001), (0.40, 0.011), (0.50, 0.021)],
        ("bf16-sr", 1): [(0.30, 0.001), (0.35, 0.006), (0.45, 0.016)],
        ("bf16-lr4x", 0): [(0.30, 0.001), (0.50, 0.041), (0.60, 0.061)],  # +0.2 at KL +0.04: 2x SR's
        ("bf16-lr4x", 1): [(0.30, 0.001), (0.30, 0.021), (0.40, 0.031)],  # +0.1 at KL +0.03
    }
    for cell in cells(cfg):
        for seed in run_seeds(cfg, cell):
            path = run_dir(cfg, cell, 0, seed)
            path.mkdir(parents=True)
            rows = [
                {"step": s, "reward": 0.5, "changed_frac": 0.01, "eval_accuracy": a, "eval_kl": k}
                for s, (a, k) in zip((0, 5, 10), curves[(cell.label, seed)])
            ]
            (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (m,) = matched_kl(cfg)
    assert (m.raised, m.reference, m.lr_scale) == ("bf16-lr4x", "bf16-sr", 4.0)
    (s0, seed0, gain0, r0, f0), (s1, seed1, gain1, r1, f1) = m.per_run
    assert (gain0, r0, f0) == pytest.approx((0.2, 0.04, 0.02))  # matched at SR's best gain
    assert (gain1, r1, f1) == pytest.approx((0.1, 0.03, 0.01))  # matched at the raised run's best
    assert m.higher == 2 and m.matched == 2
    assert (m.mean_raised, m.mean_reference) == pytest.approx((0.035, 0.015))
    assert (m.std_raised, m.std_reference) == pytest.approx((0.005, 0.005))
    report = write_report(cfg).read_text()
    assert "## KL to the reference at matched accuracy" in report
    assert "the raised-lr run's KL is the higher in 2 of 2 runs" in report
    check = next(line for line in report.splitlines() if "adds more KL than bf16-sr at matched accuracy" in line)
    assert check.startswith("- [x] bf16-lr4x") and "at 1/1 on the 95% interval over seeds" in check
    assert "0: +0.02000, interval [+0.02000, +0.02000]" in check  # both seeds: +0.02 more KL than SR's


def test_the_kl_claim_is_not_called_held_where_the_interval_over_seeds_crosses_zero(tmp_path):
    from dist_sr.rl.compare.matched import MatchedKL, matched_checks

    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path),
            "start_seeds": [0],
            "seeds": [0, 1, 2],
            "runs": [{"name": "bf16-sr", "precision": "bf16-sr"}, {"name": "bf16-lr4x", "precision": "bf16"}],
        },
    )
    runs = [(0, 0, 0.1, 0.05, 0.01), (0, 1, 0.1, 0.01, 0.03), (0, 2, 0.1, 0.04, 0.02)]  # +0.04, -0.02, +0.02
    m = MatchedKL("bf16-lr4x", "bf16-sr", 4.0, runs, 0.0, 0.0, None, None, 2, 3)
    summary = {name: _Gapless() for name in ("bf16-sr", "bf16-lr4x")}
    ((what, ok, detail),) = matched_checks(cfg, summary, [m])
    assert not ok and "holds at 1/1 start checkpoints on the seed means, at 0/1 on the 95% interval" in detail


class _Gapless:
    engine_gap_max = None  # rollouts from the trainer's own model: on-policy


def test_each_run_keeps_its_colour_in_every_signals_panel(tmp_path):
    """fp32 logs no share of the update not reaching BF16: the runs after it must not take its
    colour in that panel (they did: RTN's curve was drawn in fp32's colour and SR's in RTN's)."""
    import matplotlib.pyplot as plt

    from dist_sr.rl.compare.report import signals_figure

    cfg = load_compare(
        None,
        {
            "output_dir": str(tmp_path),
            "experiment": {"grpo": {"steps": 2}},
            "start_seeds": [0],
            "seeds": [0],
            "runs": [{"name": "fp32", "precision": "fp32"}, {"name": "bf16", "precision": "bf16"}],
            "reference": "bf16",
            "report_steps": [2],
        },
    )
    for cell in cells(cfg):
        path = run_dir(cfg, cell, 0, 0)
        path.mkdir(parents=True)
        rows = [{"step": s, "reward": 0.5, "changed_frac": 0.5} for s in (1, 2)]
        if cell.label == "bf16":
            rows = [{**r, "unfollowed_frac": 0.8} for r in rows]
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = signals_figure(cfg)
    colours = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            colours.setdefault(line.get_label(), set()).add(line.get_color())
    plt.close(fig)
    assert set(colours) == {"fp32", "bf16"} and all(len(c) == 1 for c in colours.values()), colours
    assert colours["fp32"] != colours["bf16"]
