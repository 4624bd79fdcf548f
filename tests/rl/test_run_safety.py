"""A run is never lost, relabelled, repeated or silently wrong: run directories, resume rules,
damaged metrics, non-finite steps."""

import json

import pytest

from dist_sr.config import ConfigError
from dist_sr.rl.trainer import NonFiniteTraining, read_metrics, train


def strict_records(path):
    """Parse metrics as strict JSON (a bare NaN or Infinity is an error)."""
    def refuse(token):
        raise ValueError(f"non-standard JSON constant {token}")

    return [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]


def steps(path):
    return [r["step"] for r in strict_records(path)]


def test_a_run_directory_holding_a_run_is_not_reused_without_being_told(easy):
    cfg = easy(**{"grpo.steps": 4})
    metrics = train(cfg, progress=False)
    with pytest.raises(ConfigError, match="already holds a run .* --resume to continue it, --overwrite to replace it"):
        train(cfg, progress=False)
    assert steps(metrics) == [0, 1, 2, 3, 4]  # untouched by the refused run
    train(cfg, progress=False, overwrite=True)
    assert steps(metrics) == [0, 1, 2, 3, 4]  # replaced, step 0 once


def test_resume_needs_a_checkpoint_unless_asked_to_start_fresh(easy, capsys):
    cfg = easy(**{"grpo.steps": 3})
    with pytest.raises(ConfigError, match="nothing to resume in .*: it holds no checkpoint"):
        train(cfg, progress=False, resume=True)
    metrics = train(cfg, progress=False, resume="auto")
    out = capsys.readouterr().out
    assert "no checkpoint in" in out and "starting fresh" in out
    assert steps(metrics) == [0, 1, 2, 3]


def test_resume_refuses_a_checkpoint_beyond_the_configured_steps_and_changed_settings(easy):
    train(easy(**{"grpo.steps": 6}), progress=False, stop_at=5)
    with pytest.raises(ConfigError, match="checkpoint in .* is at step 5, beyond grpo.steps=3; set grpo.steps to at "
                                          "least 5"):
        train(easy(**{"grpo.steps": 3}), progress=False, resume=True)
    with pytest.raises(ConfigError, match=r"trained with other settings \(grpo.lr: 0.003 -> 0.001\)"):
        train(easy(**{"grpo.steps": 6, "grpo.lr": 1e-3}), progress=False, resume=True)
    metrics = train(easy(**{"grpo.steps": 8}), progress=False, resume=True)  # more steps: allowed
    assert steps(metrics) == list(range(9))


def test_a_partial_last_metrics_line_is_dropped_and_the_run_resumes(easy, tmp_path):
    straight = read_metrics(train(easy(**{"grpo.steps": 6, "output_dir": str(tmp_path / "a")}), progress=False))
    cfg = easy(**{"grpo.steps": 6})
    metrics = train(cfg, progress=False, stop_at=4)
    with metrics.open("a") as f:
        f.write('{"step": 5, "reward": 0.')  # a writer killed mid-line
    with pytest.warns(RuntimeWarning, match="dropping a partial last line"):
        train(cfg, progress=False, resume=True)
    drop = lambda rows: [{k: v for k, v in r.items() if k != "step_time"} for r in rows]  # noqa: E731
    assert drop(strict_records(metrics)) == drop(straight)


def test_a_damaged_metrics_line_before_the_end_is_an_error(easy):
    cfg = easy(**{"grpo.steps": 4})
    metrics = train(cfg, progress=False, stop_at=3)
    lines = metrics.read_text().splitlines()
    lines[1] = lines[1][:10]
    metrics.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        train(cfg, progress=False, resume=True)


def test_non_finite_steps_are_skipped_counted_and_stop_the_run_without_a_bad_checkpoint(easy):
    """lr = 1e30 blows the weights up; the next losses are NaN/Inf: skipped, recorded as null in
    strict JSON, and three in a row stop the run; nothing non-finite is ever saved."""
    cfg = easy(**{"grpo.steps": 12, "grpo.lr": 1e30, "checkpoint_every": 0})
    with pytest.raises(NonFiniteTraining, match=r"steps 2\.\.4 had a non-finite loss or gradient and were skipped; "
                                                r"stopping \(no checkpoint was written\)"):
        train(cfg, progress=False)
    records = strict_records(cfg_metrics(cfg))
    assert [(r["step"], r["nonfinite"], r["skipped"]) for r in records[1:]] == [
        (1, False, False), (2, True, True), (3, True, True), (4, True, True)]
    assert all(r["loss"] is None and r["grad_norm"] is None for r in records[2:])  # NaN written as null
    assert not (cfg_dir(cfg) / "checkpoint.pt").exists()


def cfg_dir(cfg):
    from pathlib import Path

    return Path(cfg.output_dir)


def cfg_metrics(cfg):
    return cfg_dir(cfg) / "metrics.jsonl"
