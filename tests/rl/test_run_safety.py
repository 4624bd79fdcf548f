"""A run is never lost, relabelled, repeated or silently wrong: run directories, resume rules,
damaged metrics, non-finite steps."""

import json
import os
from pathlib import Path

import pytest

from dist_sr.config import ConfigError
from dist_sr.rl.metrics import read_metrics
from dist_sr.rl.trainer import NonFiniteTraining, train


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
    with pytest.raises(
        ConfigError, match="checkpoint in .* is at step 5, beyond grpo.steps=3; set grpo.steps to at least 5"
    ):
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
    with pytest.raises(
        NonFiniteTraining,
        match=r"steps 2\.\.4 had a non-finite loss or gradient and were skipped; "
        r"stopping \(no checkpoint was written\)",
    ):
        train(cfg, progress=False)
    records = strict_records(cfg_metrics(cfg))
    assert [(r["step"], r["nonfinite"], r["skipped"]) for r in records[1:]] == [
        (1, False, False),
        (2, True, True),
        (3, True, True),
        (4, True, True),
    ]
    assert all(r["loss"] is None and r["grad_norm"] is None for r in records[2:])  # NaN written as null
    assert not (cfg_dir(cfg) / "checkpoint.pt").exists()


def cfg_dir(cfg):
    from pathlib import Path

    return Path(cfg.output_dir)


def cfg_metrics(cfg):
    return cfg_dir(cfg) / "metrics.jsonl"


def _no_warmup(monkeypatch):
    """Fail the test if a refusal came after compute had started (the start checkpoint, warmed up
    or cast, is the first)."""
    import dist_sr.rl.trainer as trainer

    def warmup(*a, **k):
        raise AssertionError("compute started before the refusal")

    monkeypatch.setattr(trainer, "start_checkpoint", warmup)
    monkeypatch.setattr(trainer, "load_pretrained", warmup)


def test_refusals_that_can_come_before_compute_do(easy, tmp_path, monkeypatch):
    from dist_sr.rl.preflight import RunDirectoryError, TooLarge
    from dist_sr.secret import SecretMissing

    _no_warmup(monkeypatch)
    monkeypatch.setenv("DIST_SR_SYNC_SECRET", "short")  # signs checkpoint manifests: refused at the start
    with pytest.raises(SecretMissing, match="has 5 bytes; use at least 16"):
        train(easy(), progress=False)
    monkeypatch.setenv("DIST_SR_SYNC_SECRET", "a-long-enough-test-secret-0123456789")
    monkeypatch.setenv("DIST_SR_CHECKPOINT_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(SecretMissing, match="cannot read the checkpoint secret"):
        train(easy(), progress=False)
    monkeypatch.delenv("DIST_SR_CHECKPOINT_SECRET_FILE")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(RunDirectoryError, match="exists and is not a directory"):
        train(easy(output_dir=str(tmp_path / "a-file")), progress=False)
    with pytest.raises(RunDirectoryError, match="cannot be created or written"):
        train(easy(output_dir=str(tmp_path / "a-file" / "run")), progress=False)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: a read-only file system instead
        locked = Path("/proc/dist-sr-run")
    with pytest.raises(RunDirectoryError, match="cannot be created or written"):
        train(easy(output_dir=str(locked / "run")), progress=False)
    huge = {
        "model.hidden_size": 16384,
        "model.intermediate_size": 65536,
        "model.num_hidden_layers": 48,
        "model.num_attention_heads": 128,
    }
    with pytest.raises(TooLarge, match=r"the model has \d+\.\dM parameters; .* 24 bytes per parameter .* GiB"):
        train(easy(**huge), progress=False)


@pytest.mark.parametrize("scale", [".nan", "0", "-1", ".inf"])
def test_a_loss_scale_that_cannot_train_is_a_config_error(easy, scale):
    import yaml

    with pytest.raises(ConfigError, match="precision.initial_loss_scale must be a finite number in"):
        easy(precision={"precision": "fp16", "initial_loss_scale": yaml.safe_load(scale)})


def test_a_run_that_skips_its_steps_stops_instead_of_finishing_untrained(easy):
    """A static loss scale of 1e30 overflows every step (finite losses, so not the non-finite rule):
    more than grpo.max_skipped_fraction of grpo.steps skipped stops the run."""
    from dist_sr.rl.trainer import TooManySkippedSteps

    cfg = easy(precision={"precision": "fp16", "loss_scale": 1e30}, **{"grpo.steps": 8, "checkpoint_every": 0})
    with pytest.raises(
        TooManySkippedSteps,
        match=r"3 of the 3 steps run so far were skipped.*"
        r"max_skipped_fraction=0.25 of grpo.steps=8",
    ):
        train(cfg, progress=False)
    assert [r["skipped"] for r in strict_records(cfg_metrics(cfg))[1:]] == [True, True, True]


def test_the_command_line_turns_the_projects_refusals_into_one_line(easy, tmp_path):
    """A refusal is one line naming the problem and the fix, exit 2; no traceback."""
    import subprocess
    import sys

    import yaml

    from dist_sr.rl.config import to_dict

    cfg = easy(**{"grpo.steps": 2})
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    cases = [
        ({}, ["--resume"], "checkpoint refused: ", "no checkpoint verifies"),
        ({"DIST_SR_SYNC_SECRET": "short"}, [], "secret: ", "use at least 16"),
        ({}, ["--output-dir", str(path)], "run directory: ", "is not a directory"),
    ]
    for env, args, kind, words in cases:
        r = subprocess.run(
            [sys.executable, "-m", "dist_sr.launch.cli", "train", str(path), "--no-progress", *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, **env},
        )
        assert r.returncode == 2, (args, r.stderr[-2000:])
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dist-sr train: ")]
        assert len(lines) == 1 and kind in lines[0] and words in lines[0], r.stderr[-2000:]
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
