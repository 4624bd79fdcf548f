"""launch/train.py: config/world checks, and real 2-process jobs under torchrun and deepspeed."""

import json
import subprocess
import sys

import pytest
import yaml

from dist_sr.config import ConfigError
from dist_sr.launch.planner import build_parser, plan
from tests.launch.conftest import REPO, free_port, write_experiment

ENTRY = str(REPO / "launch" / "train.py")
DS_SR = str(REPO / "configs" / "deepspeed" / "zero2-bf16-sr.json")


def _plan(argv, env=None, cuda=False):
    return plan(build_parser().parse_args(argv), env=env or {}, cuda=cuda)


def test_a_plain_process_runs_the_embedded_default_on_one_rank():
    p = _plan([])
    assert (p.engine, p.backend, p.world, p.rank, p.launched) == ("single", "gloo", 1, 0, False)


def test_the_launchers_environment_and_deepspeeds_local_rank_argument_are_read(tmp_path):
    cfg = write_experiment(tmp_path / "e.yaml", distributed={"engine": "fsdp2"})
    p = _plan(["--config", str(cfg), "--local_rank=1"], env={"WORLD_SIZE": "4", "RANK": "3"})
    assert (p.world, p.rank, p.local_rank, p.launched) == (4, 3, 1, True)
    p = _plan(["--config", str(cfg), "--local_rank=1"], env={"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "2"})
    assert p.local_rank == 2  # torchrun's environment wins over the argument
    assert _plan(["--config", str(cfg)], cuda=True).backend == "nccl"


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (["--config", "missing.yaml"], {}, "no such file"),
        (["--deepspeed_config", "missing.json"], {}, "no such file"),
        ([], {"WORLD_SIZE": "2"}, "engine is 'single'"),
        (["--engine", "fsdp2"], {"WORLD_SIZE": "3"}, "does not split over world size 3"),
        (["--engine", "fsdp2", "--backend", "nccl"], {}, "needs CUDA"),
        (["--engine", "fsdp2", "--deepspeed_config", DS_SR], {}, "only drives distributed.engine=deepspeed"),
        (["--deepspeed_config", DS_SR, "--set", "precision=bf16"], {}, "contradicts"),
        (["--deepspeed_config", DS_SR, "--set", "precision={precision: bf16-sr, seed: 5}"], {}, "seed 1234"),
        (["--set", "precision=bf17"], {}, "unknown precision 'bf17'"),
        (["--set", "cluster.launcher=mpirun"], {}, "cluster.launcher"),
        (["--engine", "fsdp2", "--set", "distributed.fsdp2={replicate: 3}"], {"WORLD_SIZE": "4"}, "does not divide"),
        (["--set", "distributed.fsdp2={replicate: 0}"], {}, "positive int"),
    ],
)
def test_bad_configs_and_worlds_fail_before_any_process_group(argv, env, message):
    with pytest.raises(ConfigError, match=message):
        _plan(argv, env=env)


def test_a_deepspeed_json_sets_the_precision_when_the_experiment_has_none(tmp_path):
    p = _plan(["--deepspeed_config", DS_SR])
    assert p.engine == "deepspeed"
    assert (p.config.precision.precision, p.config.precision.seed) == ("bf16-sr", 1234)
    ds = json.loads(open(DS_SR).read())
    ds.pop("stochastic_rounding")
    (tmp_path / "rtn.json").write_text(json.dumps(ds))
    assert _plan(["--deepspeed_config", str(tmp_path / "rtn.json")]).config.precision.precision == "bf16"
    ds["bf16"]["enabled"] = False
    ds["stochastic_rounding"] = {"enabled": True, "seed": 1}
    (tmp_path / "bad.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match='not "bf16"'):
        _plan(["--deepspeed_config", str(tmp_path / "bad.json")])


def test_the_deepspeed_json_and_the_experiment_have_one_set_of_hyperparameters(tmp_path):
    """Values the JSON states are adopted where the experiment is silent; a value both state
    differently is an error naming both (never one silently replacing the other)."""
    ds = json.loads(open(DS_SR).read())
    ds["optimizer"]["params"].update(lr=2e-5, betas=[0.9, 0.95], weight_decay=0.1)
    ds["gradient_clipping"] = 0.5
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    g = _plan(["--deepspeed_config", str(tmp_path / "ds.json")]).config.grpo
    assert (g.lr, g.betas, g.weight_decay, g.max_grad_norm) == (2e-5, (0.9, 0.95), 0.1, 0.5)
    with pytest.raises(ConfigError, match=r"grpo.lr=1e-05 vs the JSON's optimizer.params.lr=2e-05"):
        _plan(["--deepspeed_config", str(tmp_path / "ds.json"), "--set", "grpo.lr=1e-5"])
    cfg = write_experiment(tmp_path / "e.yaml", grpo={"max_grad_norm": 2.0})
    with pytest.raises(ConfigError, match=r"grpo.max_grad_norm=2.0 vs the JSON's gradient_clipping=0.5"):
        _plan(["--config", str(cfg), "--deepspeed_config", str(tmp_path / "ds.json")])
    assert _plan(["--deepspeed_config", str(tmp_path / "ds.json"), "--set", "grpo.lr=2e-5"]).config.grpo.lr == 2e-5
    ds["gradient_clipping"] = 0.0
    (tmp_path / "off.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match="turns clipping off"):
        _plan(["--deepspeed_config", str(tmp_path / "off.json")])
    with pytest.raises(ConfigError, match="configures optimizer 'AdamW' but the trainer's is grpo.optimizer='sgd'"):
        _plan(["--deepspeed_config", DS_SR, "--set", "grpo.optimizer=sgd"])


def test_errors_reach_the_user_as_exit_code_2_with_the_message():
    r = subprocess.run([sys.executable, ENTRY, "--config", "nope.yaml"], capture_output=True, text=True)
    assert r.returncode == 2 and "--config nope.yaml: no such file" in r.stderr


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_runs_a_two_process_fsdp2_job(tmp_path, launch_env, warmup_cache):
    cfg = write_experiment(
        tmp_path / "e.yaml",
        distributed={"engine": "fsdp2"},
        output_dir=str(tmp_path / "run"),
        warmup={"cache_dir": warmup_cache},
    )
    r = subprocess.run(
        [
            "torchrun",
            "--nnodes=1",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            ENTRY,
            "--config",
            str(cfg),
            "--no-progress",
        ],
        env=launch_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "engine=fsdp2 backend=gloo world=2 rank=0" in r.stdout
    rows = _metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]  # rollout digests were checked at every step


@pytest.mark.slow
def test_deepspeed_launcher_runs_a_two_process_zero2_job(tmp_path, launch_env, warmup_cache):
    cfg = write_experiment(
        tmp_path / "e.yaml",
        distributed={"engine": "deepspeed"},
        output_dir=str(tmp_path / "run"),
        warmup={"cache_dir": warmup_cache},
    )
    cfg.write_text(cfg.read_text().replace("precision: bf16-sr\n", ""))
    data = yaml.safe_load(cfg.read_text())
    del data["grpo"]["lr"]  # no lr and no precision in the experiment: both come from the JSON
    cfg.write_text(yaml.safe_dump(data, sort_keys=False))
    r = subprocess.run(
        [
            "deepspeed",
            "--num_gpus=2",
            f"--master_port={free_port()}",
            ENTRY,
            "--config",
            str(cfg),
            "--deepspeed_config",
            DS_SR,
            "--no-progress",
        ],
        env=launch_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "engine=deepspeed backend=gloo world=2 rank=0" in r.stdout
    assert "--local_rank=1" in r.stdout + r.stderr  # the launcher's argument reached the entry point
    rows = _metrics(tmp_path / "run")
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "precision: bf16-sr\n  seed: 1234" in saved  # taken from the DeepSpeed JSON's SR block
    assert yaml.safe_load(saved)["grpo"]["lr"] == 5e-6  # and the JSON's optimizer lr
