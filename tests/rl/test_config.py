"""Experiment configs fail at load time with messages that name the field and the fix."""

import os

import pytest

from dist_sr.config import ConfigError
from dist_sr.rl.compare import load_compare
from dist_sr.rl.config import load_experiment
from dist_sr.rl.model import load_pretrained


@pytest.mark.parametrize(
    "data,match",
    [
        ({"task": {"name": "sorting"}}, "task.name: unknown task 'sorting'; choose one of reverse, add, dataset"),
        ({"precision": "bf17"}, "precision: unknown precision 'bf17'; choose one of fp32, fp16, bf16"),
        ({"precision": {"precision": "bf16", "loss_scale": 8}}, "loss_scale applies only to precision fp16"),
        ({"grpo": {"lr_rate": 1}}, r"unknown field\(s\) \['grpo.lr_rate'\]"),
        ({"grpo": {"samples_per_prompt": 1}}, "samples_per_prompt must be >= 2"),
        ({"grpo": {"lr": "fast"}}, "grpo.lr: expected float"),
        ({"task": {"name": "dataset"}}, "task.source"),
        ({"precision": "fp32", "shadow_jitter": True}, "shadow_jitter needs FP32 shadows"),
        ({"rollout": {"engine": "sglang"}}, "rollout.engine: unknown engine 'sglang'"),
        ({"distributed": {"engine": "megatron"}}, "distributed.engine: unknown engine 'megatron'"),
        ({"distributed": {"engine": "deepspeed"}, "precision": "bf16-pure-sr"}, "keeps no FP32 master"),
        ({"distributed": {"engine": "fsdp2"}, "shadow_jitter": True}, "single-process control run"),
        ({"distributed": {"deepspeed_config": "/nope.json"}}, "does not exist"),
        ({"grpo": {"max_grad_norm": -1.0}}, r"grpo.max_grad_norm must be > 0"),
        ({"grpo": {"betas": [0.9]}}, r"grpo.betas: expected a list of 2 values, got \[0.9\]"),
        ({"grpo": {"betas": [0.9, 0.999, 0.5]}}, r"grpo.betas: expected a list of 2 values"),
        ({"grpo": {"betas": [0.9, 1.5]}}, r"grpo.betas must be two numbers in \[0, 1\)"),
        ({"grpo": {"lr": float("nan")}}, "grpo.lr: expected a finite number, got nan"),
        ({"eval": {"every": 0}}, "eval.every and eval.num_prompts must be >= 1"),
        ({"eval": {"num_prompts": 0}}, "eval.every and eval.num_prompts must be >= 1"),
        ({"model": {"hidden_size": 0}}, "model.hidden_size must be >= 1"),
        ({"model": {"hidden_size": 30, "num_attention_heads": 4}}, "must be a multiple of model.num_attention_heads"),
        ({"threads": -2}, "threads must be >= 1"),
        ({"checkpoint_every": -1}, "checkpoint_every must be >= 0"),
    ],
)
def test_bad_experiment_configs_are_refused(data, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment(data)


def test_missing_config_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_experiment(tmp_path / "nope.yaml")


def test_floats_in_exponent_notation_are_floats_also_from_the_command_line():
    """YAML 1.1 reads 2e-5 (no dot) as a string; the README's own --set grpo.lr=2e-5 must work."""
    from dist_sr.config import parse_overrides

    assert load_experiment({}, parse_overrides(["grpo.lr=2e-5", "grpo.eps=1E-8"])).grpo.lr == 2e-5
    assert load_experiment("grpo:\n  lr: 3e-6\n").grpo.lr == 3e-6
    with pytest.raises(ConfigError, match="grpo.lr: expected float, got '2e-5x'"):
        load_experiment({}, parse_overrides(["grpo.lr=2e-5x"]))


def test_a_yaml_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text("grpo:\n  lr: 1.0e-5\n  steps: [3\n")
    with pytest.raises(ConfigError, match=rf"{path}: line 4, column 1: YAML syntax error"):
        load_experiment(path)
    with pytest.raises(ConfigError, match="--set grpo.betas: line 1, column 5: YAML syntax error"):
        from dist_sr.config import parse_overrides

        parse_overrides(["grpo.betas=[0.9"])


@pytest.mark.parametrize(
    "name,match",
    [
        ("tiny.cfg", r"tiny.cfg: not a YAML file \(expected one of .yaml, .yml, .json\)"),
        ("missing.json", "config file missing.json does not exist"),
    ],
)
def test_a_config_path_that_is_not_yaml_or_missing_is_refused(name, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment(name)


@pytest.mark.parametrize(
    "overrides,match",
    [({"seeds": []}, "seeds must be a non-empty list of ints"), ({"parallel": 0}, "parallel must be >= 1")],
)
def test_bad_comparison_settings_are_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_compare(None, overrides)


def test_a_report_of_nothing_is_refused_with_the_fix(tmp_path):
    from dist_sr.rl.compare import write_report

    cfg = load_compare(None, {"output_dir": str(tmp_path / "none"), "seeds": [0]})
    with pytest.raises(ConfigError, match="no finished runs under .* without --report-only"):
        write_report(cfg)


def test_missing_model_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_pretrained(str(tmp_path / "no-model"))


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_repo_experiment_configs_load_and_the_default_is_the_quickstart():
    quick = load_experiment(ROOT / "configs" / "quickstart.yaml")
    assert quick.precision.precision == "bf16-sr" and quick.grpo.lr == 5e-6
    default = load_experiment({})
    assert (default.model, default.task, default.warmup, default.grpo, default.eval) == (
        quick.model,
        quick.task,
        quick.warmup,
        quick.grpo,
        quick.eval,
    )
    for path in sorted((ROOT / "configs").glob("precision-*.yaml")):
        cfg = load_experiment(path)
        assert path.stem == f"precision-{cfg.precision.precision}"
    cwd = os.getcwd()
    os.chdir(ROOT)  # the GRPO configs name DeepSpeed JSON paths relative to the repository root
    try:
        engines = {load_experiment(p).distributed.engine for p in sorted((ROOT / "configs").glob("grpo-*.yaml"))}
    finally:
        os.chdir(cwd)
    assert engines == {"deepspeed", "fsdp2"}


def test_repo_compare_config_is_the_embedded_default():
    from dataclasses import asdict

    file_cfg = load_compare(ROOT / "configs" / "compare-quickstart.yaml")
    default = load_compare(None)
    assert [asdict(r) for r in file_cfg.runs] == [asdict(r) for r in default.runs]
    assert (file_cfg.seeds, file_cfg.start_seeds, file_cfg.threshold, file_cfg.reference, file_cfg.lrs) == (
        default.seeds,
        default.start_seeds,
        default.threshold,
        default.reference,
        default.lrs,
    )
    for name in ("compare-lr-sweep", "compare-controls", "compare-large"):
        load_compare(ROOT / "configs" / f"{name}.yaml")  # every shipped comparison loads


def test_compare_config_validates_every_run(tmp_path):
    path = tmp_path / "cmp.yaml"
    path.write_text("runs:\n  - {name: a, precision: bf16-sr}\n  - {name: b, precision: bf16-turbo}\nreference: a\n")
    with pytest.raises(ConfigError, match="unknown precision 'bf16-turbo'"):
        load_compare(path)
    path.write_text("runs:\n  - {name: a, precision: bf16}\nreference: bf16-sr\n")
    with pytest.raises(ConfigError, match="reference"):
        load_compare(path)
