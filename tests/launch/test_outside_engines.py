"""A training engine and a rollout engine registered from outside dist-sr's package (by
``"module:Class"``, no dist-sr file touched) go through the config, the preflight, the planner
and the Kubernetes render: each asks the engines what they support, never their names."""

import argparse
import json

import pytest
import yaml

from dist_sr.config import ConfigError
from dist_sr.engines import engine_names, register_engine
from dist_sr.launch import k8s
from dist_sr.launch.k8s import register_fleet_renderer
from dist_sr.launch.planner import build_parser, plan
from dist_sr.rl.config import load_experiment
from dist_sr.rl.preflight import check_secrets
from dist_sr.rollout import register_rollout_engine
from tests.launch import outside_engines
from tests.launch.conftest import REPO

TRAIN, ROLLOUT = "paired", "sidecar"
if TRAIN not in engine_names():
    register_engine(TRAIN, "tests.launch.outside_engines:PairedEngine")
    register_rollout_engine(ROLLOUT, "tests.launch.outside_engines:SidecarRollout")
    register_fleet_renderer(ROLLOUT, "tests.launch.outside_engines:sidecar_manifests")
SETS = [f"distributed.engine={TRAIN}", f"rollout.engine={ROLLOUT}"]


def _args(*extra: str) -> argparse.Namespace:
    argv = ["--config", str(REPO / "configs" / "quickstart.yaml")]
    for s in SETS:
        argv += ["--set", s]
    return build_parser().parse_args([*argv, *extra])


def test_the_config_takes_outside_engines_and_asks_them_what_they_support():
    cfg = load_experiment(REPO / "configs" / "quickstart.yaml", dict(s.split("=", 1) for s in SETS))
    assert (cfg.distributed.engine, cfg.rollout.engine) == (TRAIN, ROLLOUT)
    with pytest.raises(ConfigError, match=f"distributed.engine={TRAIN} always keeps"):
        load_experiment(
            REPO / "configs" / "quickstart.yaml", {**dict(s.split("=", 1) for s in SETS), "precision": "bf16-pure-sr"}
        )
    with pytest.raises(ConfigError, match="single-process control run"):
        load_experiment(
            REPO / "configs" / "quickstart.yaml", {**dict(s.split("=", 1) for s in SETS), "shadow_jitter": True}
        )


def test_the_preflight_runs_the_outside_rollout_engines_checks():
    cfg = load_experiment(REPO / "configs" / "quickstart.yaml", dict(s.split("=", 1) for s in SETS))
    outside_engines.PREFLIGHTS.clear()
    check_secrets(cfg)
    assert outside_engines.PREFLIGHTS == [ROLLOUT]


def test_the_planner_asks_the_outside_engine_which_worlds_and_configs_it_takes():
    launched = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}
    p = plan(_args("--set", "grpo.prompts_per_step=4", "--set", "eval.num_prompts=8"), env=launched, cuda=False)
    assert (p.engine, p.world, p.rank, p.launched) == (TRAIN, 2, 1, True)
    with pytest.raises(ConfigError, match="runs on pairs of ranks; world 3 is odd"):
        plan(_args("--set", "grpo.prompts_per_step=6", "--set", "eval.num_prompts=9"), env={"WORLD_SIZE": "3"})
    with pytest.raises(ConfigError, match="only drives distributed.engine=deepspeed"):
        plan(_args("--deepspeed_config", str(REPO / "configs" / "deepspeed" / "zero2-bf16-sr.json")), env={})


def test_kubernetes_renders_the_outside_rollout_engines_pods_beside_the_trainer(tmp_path):
    argv = ["--config", str(REPO / "configs" / "quickstart.yaml"), "-o", str(tmp_path)]
    for s in [*SETS, "cluster.nnodes=2", "grpo.prompts_per_step=4", "eval.num_prompts=8"]:
        argv += ["--set", s]
    assert k8s.main(argv) == 0
    files = {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in tmp_path.glob("*.yaml")}
    assert {"sidecar-service.yaml", "sidecar-deployment.yaml"} <= set(files)
    assert not {"vllm-service.yaml", "vllm-statefulset.yaml"} & set(files)
    (job,) = files["trainer-job.yaml"]
    ports = job["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert [p["name"] for p in ports] == ["rendezvous", "sidecar-feed"]
    policies = {p["metadata"]["name"] for p in files["networkpolicy.yaml"]}
    assert any(name.endswith("-vllm-ingress") for name in policies)  # the rollout pods' policy
    kustomization = yaml.safe_load((tmp_path / "kustomization.yaml").read_text())
    assert "sidecar-deployment.yaml" in kustomization["resources"]
    experiment = yaml.safe_load(files["configmap.yaml"][0]["data"]["experiment.yaml"])
    assert (experiment["distributed"]["engine"], experiment["rollout"]["engine"]) == (TRAIN, ROLLOUT)
    assert json.dumps(experiment)  # the pods read it back
