"""Rendered Kubernetes manifests: schema-valid, and consistent with the entry point they start."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from dist_sr.config import ConfigError
from dist_sr.launch import k8s, k8s_vllm
from dist_sr.launch.planner import build_parser, plan
from tests.launch.conftest import REPO

kv = pytest.importorskip("kubernetes_validate")
KUBERNETES = "1.33"  # the schema version the manifests are validated against
EXPERIMENTS = sorted(
    p
    for pattern in ("quickstart.yaml", "precision-*.yaml", "grpo-*.yaml", "multinode-*.yaml")
    for p in (REPO / "configs").glob(pattern)
)


def _render(config: Path, *sets: str, tmp_path: Path) -> dict[str, list[dict]]:
    argv = ["--config", str(config), "-o", str(tmp_path)]
    for s in sets:
        argv += ["--set", s]
    assert k8s.main(argv) == 0
    out = {}
    for path in sorted(tmp_path.glob("*.yaml")):
        out[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def _objects(files, kind):
    return [o for objs in files.values() for o in objs if o["kind"] == kind]


def _expand(arg: str, env: dict) -> str:
    """Kubernetes' $(VAR) expansion in command arguments."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


@pytest.mark.parametrize("config", EXPERIMENTS, ids=lambda p: p.stem)
def test_every_config_renders_to_schema_valid_manifests(config, tmp_path):
    sets = ["cluster.nnodes=2"] if "engine: fsdp2" in config.read_text() or "deepspeed" in config.name else []
    files = _render(config, *sets, tmp_path=tmp_path)
    assert sorted(files["kustomization.yaml"][0]["resources"]) == sorted(
        n for n in files if n not in ("kustomization.yaml", k8s.SECRET_FILE)
    )
    for objs in files.values():
        for obj in objs:
            if obj["kind"] != "Kustomization":
                kv.validate(obj, KUBERNETES, strict=True)


def test_validation_is_strict_enough_to_catch_a_misspelt_field(tmp_path):
    files = _render(REPO / "configs" / "multinode-vllm.yaml", tmp_path=tmp_path)
    job = _objects(files, "Job")[0]
    job["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []
    with pytest.raises(kv.ValidationError):
        kv.validate(job, KUBERNETES, strict=True)


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_the_trainer_command_is_what_the_entry_point_and_launcher_accept(launcher, tmp_path):
    files = _render(REPO / "configs" / "multinode-vllm.yaml", f"cluster.launcher={launcher}", tmp_path=tmp_path)
    job = _objects(files, "Job")[0]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    index_ref = next(e for e in container["env"] if e["name"] == "NODE_RANK")["valueFrom"]["fieldRef"]["fieldPath"]
    assert index_ref == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    env["NODE_RANK"] = "1"
    argv = [_expand(a, env) for a in container["command"]]
    entry = argv.index(k8s.ENTRY)
    launcher_args, entry_args = argv[1:entry], argv[entry + 1 :]
    assert argv[0] == launcher

    # The launcher's own parser accepts its part; world size and port match the objects.
    if launcher == "torchrun":
        from torch.distributed.run import get_args_parser

        la = get_args_parser().parse_args(launcher_args + [k8s.ENTRY])
        nnodes, nproc, node_rank, addr, port = (
            int(la.nnodes),
            int(la.nproc_per_node),
            la.node_rank,
            la.master_addr,
            la.master_port,
        )
    else:
        from deepspeed.launcher.runner import parse_args

        la = parse_args(launcher_args + [k8s.ENTRY])
        nnodes, nproc, node_rank, addr, port = la.num_nodes, la.num_gpus, la.node_rank, la.master_addr, la.master_port
        assert la.no_ssh
    assert (nnodes, node_rank) == (job["spec"]["completions"], 1)
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == nnodes

    # The rendezvous host is index 0's stable name under the headless Service.
    (svc,) = [s for s in _objects(files, "Service") if s["metadata"]["name"] == pod["subdomain"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    assert addr == f"{job['metadata']['name']}-0.{svc['metadata']['name']}"
    svc_ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(port) == svc_ports["rendezvous"] == container_ports["rendezvous"]
    assert all(
        svc["spec"]["selector"][k] == v
        for k, v in job["spec"]["template"]["metadata"]["labels"].items()
        if k in svc["spec"]["selector"]
    )
    assert container["resources"]["limits"]["nvidia.com/gpu"] == nproc

    # The entry point's parser accepts its part, and the mounted config plans on that world.
    args = build_parser().parse_args(entry_args)
    mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "config")
    config_map = _objects(files, "ConfigMap")[0]
    assert args.config == f"{mount}/experiment.yaml"
    (tmp_path / "etc").mkdir()
    for name, text in config_map["data"].items():
        (tmp_path / "etc" / name).write_text(text)
    args.config = str(tmp_path / "etc" / "experiment.yaml")
    p = plan(args, env={"WORLD_SIZE": str(nnodes * nproc), "RANK": "8", "LOCAL_RANK": "0"}, cuda=True)
    assert (p.engine, p.backend, p.world) == ("fsdp2", "nccl", 16)
    data_mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "data")
    assert p.config.output_dir.startswith(data_mount + "/")

    # The fleet the trainer will call is the StatefulSet's pods, by their stable names.
    (sts,) = _objects(files, "StatefulSet")
    fleet = p.config.rollout.vllm
    vsvc = next(s for s in _objects(files, "Service") if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert fleet.urls == [
        f"http://{sts['metadata']['name']}-{i}.{vsvc['metadata']['name']}:{fleet.port}"
        for i in range(sts["spec"]["replicas"])
    ]
    assert fleet.group_host == addr and fleet.group_port in [p["port"] for p in svc["spec"]["ports"]]
    (vc,) = sts["spec"]["template"]["spec"]["containers"]
    serve = shlex.split(vc["command"][-1].split("exec ", 1)[1])
    assert serve[:2] == ["vllm", "serve"]
    assert json.loads(serve[serve.index("--weight-transfer-config") + 1]) == {"backend": "dist_sr"}
    assert "--worker-extension-cls" not in serve  # dist-sr's vLLM plugin gives every worker its RPCs
    assert serve[serve.index("--dtype") + 1] == "bfloat16"
    assert serve[serve.index("--port") + 1] == str(fleet.port) == str(vc["ports"][0]["containerPort"])
    assert serve[serve.index("--tensor-parallel-size") + 1] == str(fleet.tensor_parallel_size)
    assert vc["resources"]["limits"]["nvidia.com/gpu"] == fleet.tensor_parallel_size


def _policies(files) -> dict:
    return {p["metadata"]["name"]: p["spec"] for p in _objects(files, "NetworkPolicy")}


@pytest.mark.parametrize("config", ["multinode-vllm.yaml", "grpo-fsdp2.yaml"])
def test_every_job_denies_by_default_and_allows_only_its_peers(config, tmp_path):
    files = _render(REPO / "configs" / config, tmp_path=tmp_path)
    job_labels = _objects(files, "Job")[0]["spec"]["template"]["metadata"]["labels"]
    sts = _objects(files, "StatefulSet")
    pods = [job_labels] + [s["spec"]["template"]["metadata"]["labels"] for s in sts]
    policies = _policies(files)
    (deny,) = [p for p in policies.values() if "ingress" not in p and "egress" not in p]
    assert deny["policyTypes"] == ["Ingress", "Egress"]  # no rule: nothing in, nothing out
    assert all(
        all(deny["podSelector"]["matchLabels"][k] == labels[k] for k in deny["podSelector"]["matchLabels"])
        for labels in pods
    )  # every pod of the job is selected
    allowed = [p for p in policies.values() if p is not deny]
    assert sorted(p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in allowed) == sorted(
        ["trainer"] + ["rollout"] * len(sts)
    )
    for p in allowed:
        assert p["policyTypes"] == ["Ingress", "Egress"]
        sources = [peer["podSelector"]["matchLabels"] for rule in p["ingress"] for peer in rule["from"]]
        assert sources == pods  # only the job's own pods: no namespaceSelector, no ipBlock
        (to_pods, dns) = p["egress"]
        assert [peer["podSelector"]["matchLabels"] for peer in to_pods["to"]] == pods
        assert sorted(q["port"] for q in dns["ports"]) == [53, 53]  # DNS, nothing outside the job


def test_engines_need_the_sync_secret_and_cannot_write_the_data_volume(tmp_path):
    files = _render(REPO / "configs" / "multinode-vllm.yaml", tmp_path=tmp_path)
    (secret,) = _objects(files, "Secret")
    value = secret["stringData"]["secret"]
    assert len(value) == 64 and int(value, 16) >= 0
    assert (tmp_path / k8s.SECRET_FILE).stat().st_mode & 0o777 == 0o600
    assert k8s.SECRET_FILE not in yaml.safe_load((tmp_path / "kustomization.yaml").read_text())["resources"]
    for pod in [_objects(files, "Job")[0], _objects(files, "StatefulSet")[0]]:
        spec = pod["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in c["env"]}
        mount = next(m for m in c["volumeMounts"] if m["name"] == "sync-secret")
        vol = next(v for v in spec["volumes"] if v["name"] == "sync-secret")
        assert vol["secret"]["secretName"] == secret["metadata"]["name"] and mount["readOnly"]
        assert env["DIST_SR_SYNC_SECRET_FILE"].startswith(mount["mountPath"] + "/")
        assert "DIST_SR_SYNC_SECRET" not in env  # a file, never a plain env value
    (vc,) = _objects(files, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"]
    assert next(m for m in vc["volumeMounts"] if m["name"] == "data")["readOnly"] is True
    serve = shlex.split(vc["command"][-1].split("exec ", 1)[1])
    assert serve[serve.index("--middleware") + 1] == "dist_sr.rollout.vllm.auth.SyncAuthMiddleware"
    # a second render into the same directory keeps the secret (trainer and engines stay paired)
    again = _render(REPO / "configs" / "multinode-vllm.yaml", tmp_path=tmp_path)
    assert _objects(again, "Secret")[0]["stringData"]["secret"] == value


def test_committed_manifests_match_a_fresh_render(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    committed = REPO / "k8s" / "multinode-vllm"
    _render(Path("configs/multinode-vllm.yaml"), tmp_path=tmp_path)
    fix = "run `dist-sr k8s --config configs/multinode-vllm.yaml -o k8s/multinode-vllm`"
    fresh = sorted(p for p in tmp_path.glob("*.yaml") if p.name != k8s.SECRET_FILE)  # never committed
    assert sorted(p.name for p in committed.glob("*.yaml") if p.name != k8s.SECRET_FILE) == [p.name for p in fresh], fix
    for path in fresh:
        assert (committed / path.name).read_text() == path.read_text(), f"{path.name} is stale: {fix}"


def test_a_world_the_config_cannot_use_fails_at_render_time(tmp_path, capsys):
    out = tmp_path / "manifests"
    assert (
        k8s.main(["--config", str(REPO / "configs" / "grpo-fsdp2.yaml"), "--set", "cluster.nnodes=3", "-o", str(out)])
        == 2
    )
    err = capsys.readouterr().err
    assert "prompts_per_step=32 does not split over world size 3" in err and "multiple of 3" in err
    assert not out.exists()  # nothing half-rendered
    with pytest.raises(ConfigError, match="DNS-1035"):
        k8s.load_for_cluster(build_parser().parse_args(["--set", "cluster.name=Bad_Name"]))
    # the same config at a world it splits over renders
    assert (
        k8s.main(["--config", str(REPO / "configs" / "grpo-fsdp2.yaml"), "--set", "cluster.nnodes=2", "-o", str(out)])
        == 0
    )
    assert list(out.iterdir())


def test_the_image_provides_what_the_manifests_run(tmp_path):
    """docker/Dockerfile: the manifests' workingDir is its checkout, which holds the entry point,
    and it installs the extras the pods import (no image is built here)."""
    import tomllib

    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert re.search(rf"^WORKDIR {k8s.WORKDIR}$", dockerfile, re.M)
    copied = re.findall(r"^COPY (\S+) ", dockerfile, re.M)
    assert k8s.ENTRY.split("/")[0] in copied and "dist_sr" in copied and "configs" in copied
    extra = re.search(r'-e "\.\[(\w+)\]"', dockerfile).group(1)
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {"deepspeed", "rl", "vllm"} <= set(re.findall(r"\w+", extras[extra][0].split("[", 1)[1]))
    files = _render(REPO / "configs" / "multinode-vllm.yaml", tmp_path=tmp_path)
    job = _objects(files, "Job")[0]
    assert job["spec"]["template"]["spec"]["containers"][0]["workingDir"] == k8s.WORKDIR


def test_a_model_path_with_spaces_or_shell_characters_stays_one_argument():
    from dist_sr.rl.config import load_experiment

    for path in ("/models/my model", "/models/x; touch /tmp/pwned", "/models/$(id)"):
        cfg = load_experiment(
            REPO / "configs" / "multinode-vllm.yaml", {"model.path": path, "rollout.vllm.snapshot_deltas": False}
        )
        words = shlex.split(k8s_vllm.vllm_command(cfg)[2])
        assert words[:4] == ["exec", "vllm", "serve", path], words[:6]
    for deltas in (False, True):
        cfg = load_experiment(
            REPO / "configs" / "multinode-vllm.yaml",
            {"cluster.data_dir": "/data dir", "model.path": None, "rollout.vllm.snapshot_deltas": deltas},
        )
        script = k8s_vllm.vllm_command(cfg)[2]
        assert "'/data dir/snapshots/" in script and shlex.split(script.split("; do")[0])[:3] == ["until", "[", "-e"]


def test_engines_rebuild_the_newest_snapshot_version_into_their_own_volume_before_serving(tmp_path):
    from dist_sr.rl.config import load_experiment

    cfg = load_experiment(REPO / "configs" / "multinode-vllm.yaml")
    assert cfg.rollout.vllm.snapshot_deltas and cfg.model.path  # the trainer loads the model; engines the snapshots
    script = k8s_vllm.vllm_command(cfg)[2]
    rebuild, serve = script.split("; done; ")[1].split(" && ")
    assert shlex.split(rebuild) == ["dist-sr", "snapshot", "materialize", k8s_vllm.snapshot_dir(cfg), "/weights/model"]
    assert shlex.split(serve)[:4] == ["exec", "vllm", "serve", "/weights/model"]
    engines = _objects(_render(REPO / "configs" / "multinode-vllm.yaml", tmp_path=tmp_path), "StatefulSet")[0]
    pod = engines["spec"]["template"]["spec"]
    assert {"name": "weights", "emptyDir": {}} in pod["volumes"]
    assert {"name": "weights", "mountPath": "/weights"} in pod["containers"][0]["volumeMounts"]
    data = next(m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == cfg.cluster.data_dir)
    assert data.get("readOnly")  # the snapshots are read, never written, by an engine


def test_every_trainer_pod_reads_the_jobs_seed_from_the_mounted_config(tmp_path):
    """The manifests carry the SR switch to every rank in the files every pod mounts (the
    experiment's precision and the DeepSpeed JSON's block), not in a variable a launcher may drop;
    every rank's plan keys with the config's seed, and no pod sets DIST_SR_SEED that could differ."""
    from dist_sr.engines.deepspeed.config import split_config

    files = _render(REPO / "configs" / "grpo-deepspeed-zero2.yaml", "cluster.nnodes=2", tmp_path=tmp_path / "out")
    (container,) = _objects(files, "Job")[0]["spec"]["template"]["spec"]["containers"]
    assert not [
        e for e in container["env"] if e["name"].startswith("DIST_SR_") and e["name"] != "DIST_SR_SYNC_SECRET_FILE"
    ]
    mount = tmp_path / "etc"
    mount.mkdir()
    for name, text in _objects(files, "ConfigMap")[0]["data"].items():
        (mount / name).write_text(text.replace(k8s.CONFIG_MOUNT, str(mount)))
    _, block = split_config(mount / "deepspeed.json")
    assert (block.seed, block.mode) == (1234, "stochastic")
    args = build_parser().parse_args(["--config", str(mount / "experiment.yaml")])
    for rank in range(2):
        p = plan(args, env={"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": "0"}, cuda=False)
        assert (p.engine, p.config.precision.precision, p.config.precision.seed) == ("deepspeed", "bf16-sr", 1234)
