"""Kubernetes manifests rendered from an experiment config (core API only, no operators).

``dist-sr k8s --config EXP.yaml [--deepspeed_config DS.json] -o DIR`` writes:

- ``configmap.yaml``: the resolved experiment config (and the DeepSpeed JSON) the pods read;
- ``pvc.yaml``: a ReadWriteMany volume for checkpoints, caches and weight snapshots;
- ``trainer-service.yaml``: headless Service; pod ``<name>-trainer-<i>`` resolves as
  ``<name>-trainer-<i>.<name>-trainer``, and index 0 is the rendezvous host;
- ``trainer-job.yaml``: an Indexed Job, one pod per node, node rank = completion index, each
  running ``torchrun``/``deepspeed`` on ``launch/train.py``;
- with ``rollout.engine: vllm``: ``vllm-service.yaml`` + ``vllm-statefulset.yaml`` (the fleet,
  one ``vllm serve`` per pod, its control routes behind the sync secret's signature check);
- ``networkpolicy.yaml``: every pod of the job denies all traffic except what it needs (see
  ``network_policies``);
- ``kustomization.yaml``, so ``kubectl apply -k DIR`` applies the set;
- ``sync-secret.yaml`` (mode 0600, not in the kustomization and never committed): the job's sync
  secret, generated at the first render and kept by later ones; apply it first
  (``kubectl apply -f DIR/sync-secret.yaml``). Pods do not start without it.

The config inside the ConfigMap is the one the renderer validated for the cluster's world size,
with paths moved onto the volume, so manifests and configs cannot drift apart.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import sys
from pathlib import Path

import yaml

from ..config import ConfigError, parse_overrides
from ..rl.config import ExperimentConfig, load_experiment, to_dict
from ..weightsync import auth
from .planner import build_parser, config_source, plan

CONFIG_MOUNT = "/etc/dist-sr"
SECRET_MOUNT = "/etc/dist-sr-secret"
SECRET_FILE = "sync-secret.yaml"
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
WORKDIR = "/opt/dist-sr"  # the image's checkout (docker/Dockerfile)
ENTRY = "launch/train.py"
HTTP_PORT_NAME = "http"


def _labels(cfg: ExperimentConfig, component: str) -> dict:
    return {
        "app.kubernetes.io/name": "dist-sr",
        "app.kubernetes.io/instance": cfg.cluster.name,
        "app.kubernetes.io/component": component,
    }


def _meta(cfg: ExperimentConfig, name: str, component: str) -> dict:
    return {"name": name, "namespace": cfg.cluster.namespace, "labels": _labels(cfg, component)}


def names(cfg: ExperimentConfig) -> dict:
    n = cfg.cluster.name
    return {
        "config": f"{n}-config",
        "data": f"{n}-data",
        "trainer": f"{n}-trainer",
        "vllm": f"{n}-vllm",
        "secret": f"{n}-sync-secret",
        "deny": f"{n}-default-deny",
        "policy": f"{n}-vllm-ingress",
        "trainer_policy": f"{n}-trainer-ingress",
    }


def fleet_urls(cfg: ExperimentConfig) -> list[str]:
    """The engines' base URLs: one per StatefulSet pod, by its stable DNS name."""
    nm, f = names(cfg), cfg.rollout.vllm
    return [f"http://{nm['vllm']}-{i}.{nm['vllm']}:{f.port}" for i in range(f.replicas)]


def master_addr(cfg: ExperimentConfig) -> str:
    nm = names(cfg)
    return f"{nm['trainer']}-0.{nm['trainer']}"


def snapshot_dir(cfg: ExperimentConfig) -> str:
    return f"{cfg.cluster.data_dir}/snapshots/{cfg.cluster.name}"


def cluster_config(cfg: ExperimentConfig) -> tuple[dict, dict | None]:
    """The experiment config as the pods see it (paths on the volume, the fleet by DNS name), and
    the DeepSpeed JSON if the engine uses one."""
    c = cfg.cluster
    data = to_dict(cfg)
    data["output_dir"] = f"{c.data_dir}/runs/{c.name}"
    data["warmup"]["cache_dir"] = f"{c.data_dir}/cache"
    ds = None
    if cfg.distributed.engine == "deepspeed" and cfg.distributed.deepspeed_config:
        ds = json.loads(Path(cfg.distributed.deepspeed_config).read_text())
        data["distributed"]["deepspeed_config"] = f"{CONFIG_MOUNT}/deepspeed.json"
    if cfg.rollout.engine == "vllm":
        fleet = data["rollout"]["vllm"]
        fleet["urls"] = fleet_urls(cfg)
        fleet["group_host"] = master_addr(cfg)
        fleet["snapshot_dir"] = snapshot_dir(cfg)
    return data, ds


def trainer_command(cfg: ExperimentConfig) -> list[str]:
    """The trainer container's command; ``$(NODE_RANK)`` and ``$(MASTER_ADDR)`` are expanded by
    Kubernetes from the container's env."""
    c = cfg.cluster
    if c.launcher == "torchrun":
        launcher = [
            "torchrun",
            f"--nnodes={c.nnodes}",
            f"--nproc-per-node={c.nproc_per_node}",
            "--node-rank=$(NODE_RANK)",
            "--master-addr=$(MASTER_ADDR)",
            f"--master-port={c.master_port}",
        ]
    else:
        launcher = [
            "deepspeed",
            "--no_ssh",
            f"--num_nodes={c.nnodes}",
            f"--num_gpus={c.nproc_per_node}",
            "--node_rank=$(NODE_RANK)",
            "--master_addr=$(MASTER_ADDR)",
            f"--master_port={c.master_port}",
        ]
    return launcher + [ENTRY, "--config", f"{CONFIG_MOUNT}/experiment.yaml", "--resume-or-start", "--no-progress"]


def _volumes(cfg: ExperimentConfig, *, data_read_only: bool = False) -> tuple[list, list]:
    """Config, data volume, shared memory and the sync secret (a file, never an env value).
    Engines mount the data volume read-only: they read snapshots, and must not be able to plant
    files the trainer loads."""
    nm = names(cfg)
    volumes = [
        {"name": "config", "configMap": {"name": nm["config"]}},
        {"name": "data", "persistentVolumeClaim": {"claimName": nm["data"]}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "sync-secret", "secret": {"secretName": nm["secret"], "defaultMode": 0o400}},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
        {"name": "data", "mountPath": cfg.cluster.data_dir, **({"readOnly": True} if data_read_only else {})},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "sync-secret", "mountPath": SECRET_MOUNT, "readOnly": True},
    ]
    return volumes, mounts


SECRET_ENV = {"name": auth.ENV_FILE, "value": f"{SECRET_MOUNT}/secret"}


def sync_secret(cfg: ExperimentConfig, value: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(cfg, names(cfg)["secret"], "secret"),
        "type": "Opaque",
        "stringData": {"secret": value},
    }


def _resources(cpu: str, memory: str, gpus: int) -> dict:
    res = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if gpus:
        res["requests"]["nvidia.com/gpu"] = gpus
        res["limits"]["nvidia.com/gpu"] = gpus
    return res


def trainer_job(cfg: ExperimentConfig) -> dict:
    c, nm = cfg.cluster, names(cfg)
    volumes, mounts = _volumes(cfg)
    env = [
        {
            "name": "NODE_RANK",
            "valueFrom": {
                "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
            },
        },
        {"name": "MASTER_ADDR", "value": master_addr(cfg)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        SECRET_ENV,
    ]
    if not c.gpus_per_node:
        env.append({"name": "DS_ACCELERATOR", "value": "cpu"})
    ports = [{"name": "rendezvous", "containerPort": c.master_port}]
    if cfg.rollout.engine == "vllm":
        ports.append({"name": "weight-group", "containerPort": cfg.rollout.vllm.group_port})
    container = {
        "name": "trainer",
        "image": c.image,
        "workingDir": WORKDIR,
        "command": trainer_command(cfg),
        "env": env,
        "ports": ports,
        "volumeMounts": mounts,
        "resources": _resources(c.cpu_per_node, c.memory_per_node, c.gpus_per_node),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _meta(cfg, nm["trainer"], "trainer"),
        "spec": {
            "completionMode": "Indexed",
            "completions": c.nnodes,
            "parallelism": c.nnodes,
            # one lost node fails the whole job; resubmitting resumes from the checkpoint (--resume-or-start)
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": _labels(cfg, "trainer")},
                "spec": {
                    "subdomain": nm["trainer"],
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": volumes,
                },
            },
        },
    }


def headless_service(cfg: ExperimentConfig, name: str, component: str, ports: list[dict]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cfg, name, component),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": _labels(cfg, component),
            "ports": ports,
        },
    }


WEIGHTS_MOUNT = "/weights"  # an engine's own copy of the weights it rebuilt from base + deltas


def vllm_command(cfg: ExperimentConfig) -> list[str]:
    """Each engine serves the trainer's latest weight snapshot (or ``model.path``), with the
    dist-sr weight-transfer backend; it waits for the first snapshot to exist. With
    ``snapshot_deltas`` it first rebuilds the newest version the snapshots prove (a base plus its
    deltas: ``dist-sr snapshot materialize``) into a volume of its own and serves that, so an
    engine that restarts mid-run starts from the trainer's last step, not from the first."""
    f = cfg.rollout.vllm
    current = f"{snapshot_dir(cfg)}/current"
    wait = (
        f"until [ -e {shlex.quote(current + '/config.json')} ]; do echo waiting for {shlex.quote(current)}; "
        "sleep 5; done; "
    )
    if f.snapshot_deltas:
        model = f"{WEIGHTS_MOUNT}/model"
        wait += f"dist-sr snapshot materialize {shlex.quote(snapshot_dir(cfg))} {model} && "
    elif cfg.model.path:
        model, wait = shlex.quote(cfg.model.path), ""  # a path is one word, never a command
    else:
        model = shlex.quote(current)
    serve = (
        f"exec vllm serve {model} --port {f.port} --tensor-parallel-size {f.tensor_parallel_size} --dtype bfloat16 "
        f"--max-model-len {f.max_model_len} --gpu-memory-utilization {f.gpu_memory_utilization} "
        f"--weight-transfer-config '{json.dumps({'backend': 'dist_sr'})}' "
        f"--middleware dist_sr.rollout.vllm.auth.SyncAuthMiddleware"
    )
    return ["/bin/sh", "-c", wait + serve]


def vllm_statefulset(cfg: ExperimentConfig) -> dict:
    c, f, nm = cfg.cluster, cfg.rollout.vllm, names(cfg)
    volumes, mounts = _volumes(cfg, data_read_only=True)
    if f.snapshot_deltas:
        volumes.append({"name": "weights", "emptyDir": {}})
        mounts.append({"name": "weights", "mountPath": WEIGHTS_MOUNT})
    gpus = c.gpus_per_engine if c.gpus_per_engine is not None else (f.tensor_parallel_size if c.gpus_per_node else 0)
    container = {
        "name": "vllm",
        "image": c.image,
        "command": vllm_command(cfg),
        "env": [
            {"name": "VLLM_SERVER_DEV_MODE", "value": "1"},  # weight routes, behind SyncAuthMiddleware
            {"name": "VLLM_PLUGINS", "value": "dist_sr"},
            SECRET_ENV,
        ],
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": f.port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": HTTP_PORT_NAME}, "periodSeconds": 5},
        "volumeMounts": mounts,
        "resources": _resources(c.cpu_per_engine, c.memory_per_engine, gpus),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(cfg, nm["vllm"], "rollout"),
        "spec": {
            "serviceName": nm["vllm"],
            "replicas": f.replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": _labels(cfg, "rollout")},
            "template": {
                "metadata": {"labels": _labels(cfg, "rollout")},
                "spec": {"containers": [container], "volumes": volumes},
            },
        },
    }


def network_policies(cfg: ExperimentConfig) -> list[dict]:
    """Default deny for every pod of the job, in and out; then only what each component needs.

    Trainer pods: from and to each other on any port (rendezvous, and the collectives' ports,
    which NCCL and gloo pick at run time). Engines (with a fleet): the trainer reaches their HTTP
    port (inference and the signed control routes), and trainer and engines reach each other on
    any port for the weight-transfer group (gloo connects every pair of members on ports it picks);
    engines reach each other for the same mesh. DNS out, nothing else: no pod of the job talks to
    anything outside it."""
    nm = names(cfg)
    instance = {"app.kubernetes.io/name": "dist-sr", "app.kubernetes.io/instance": cfg.cluster.name}
    trainer = {"podSelector": {"matchLabels": _labels(cfg, "trainer")}}
    rollout = {"podSelector": {"matchLabels": _labels(cfg, "rollout")}}
    dns = {"to": [{"namespaceSelector": {}}], "ports": DNS_PORTS}
    fleet = cfg.rollout.engine == "vllm"
    peers = [trainer, rollout] if fleet else [trainer]

    def policy(name, component, ingress, egress):
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(cfg, name, component),
            "spec": {
                "podSelector": {"matchLabels": _labels(cfg, component)},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": copy.deepcopy(ingress),
                "egress": copy.deepcopy(egress),
            },
        }

    deny = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(cfg, nm["deny"], "policy"),
        "spec": {"podSelector": {"matchLabels": instance}, "policyTypes": ["Ingress", "Egress"]},
    }
    out = [deny, policy(nm["trainer_policy"], "trainer", [{"from": peers}], [{"to": peers}, dns])]
    if fleet:
        out.append(policy(nm["policy"], "rollout", [{"from": [trainer, rollout]}], [{"to": [trainer, rollout]}, dns]))
    return out


def render(cfg: ExperimentConfig) -> dict[str, list[dict]]:
    """File name -> the Kubernetes objects in it."""
    c, nm = cfg.cluster, names(cfg)
    data, ds = cluster_config(cfg)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(cfg, nm["config"], "config"),
        "data": {"experiment.yaml": yaml.safe_dump(data, sort_keys=False)},
    }
    if ds is not None:
        config_map["data"]["deepspeed.json"] = json.dumps(ds, indent=2) + "\n"
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _meta(cfg, nm["data"], "storage"),
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": c.storage}}},
    }
    if c.storage_class:
        pvc["spec"]["storageClassName"] = c.storage_class
    trainer_ports = [{"name": "rendezvous", "port": c.master_port}]
    if cfg.rollout.engine == "vllm":
        trainer_ports.append({"name": "weight-group", "port": cfg.rollout.vllm.group_port})
    files = {
        "configmap.yaml": [config_map],
        "pvc.yaml": [pvc],
        "trainer-service.yaml": [headless_service(cfg, nm["trainer"], "trainer", trainer_ports)],
        "trainer-job.yaml": [trainer_job(cfg)],
    }
    if cfg.rollout.engine == "vllm":
        files["vllm-service.yaml"] = [
            headless_service(cfg, nm["vllm"], "rollout", [{"name": HTTP_PORT_NAME, "port": cfg.rollout.vllm.port}])
        ]
        files["vllm-statefulset.yaml"] = [vllm_statefulset(cfg)]
    files["networkpolicy.yaml"] = network_policies(cfg)
    return files


def write_secret(cfg: ExperimentConfig, out: Path, header: str) -> Path:
    """``sync-secret.yaml``: kept when it exists (re-rendering must not split trainer and engines
    onto two secrets), else a fresh secret; readable by the owner only."""
    path = out / SECRET_FILE
    if path.exists():
        return path
    text = (
        header
        + "# The job's sync secret: apply it first, keep it out of version control.\n"
        + yaml.safe_dump(sync_secret(cfg, auth.generate()), sort_keys=False)
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def write(cfg: ExperimentConfig, out_dir: str | Path, source: str = "") -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = f"# Rendered by `dist-sr k8s` from {source or 'an experiment config'}; edit the config, not this file.\n"
    written = []
    files = render(cfg)
    for name, objs in files.items():
        path = out / name
        path.write_text(header + "---\n".join(yaml.safe_dump(copy.deepcopy(o), sort_keys=False) for o in objs))
        written.append(path)
    kustom = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": list(files)}
    (out / "kustomization.yaml").write_text(header + yaml.safe_dump(kustom, sort_keys=False))
    return written + [out / "kustomization.yaml", write_secret(cfg, out, header)]


def load_for_cluster(args) -> ExperimentConfig:
    """Resolve the config exactly as the entry point will on the cluster's world, so a config the
    cluster cannot run (world size, engine, contradictory DeepSpeed JSON) fails here, not in pods."""
    c = load_experiment(config_source(args), parse_overrides(args.set)).cluster  # the world comes from here
    world = c.nnodes * c.nproc_per_node
    return plan(args, env={"WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0"}, cuda=bool(c.gpus_per_node)).config


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    ap.prog, ap.description = "dist-sr k8s", "Render Kubernetes manifests from an experiment config."
    ap.add_argument("-o", "--output", required=True, help="directory for the manifests")
    args = ap.parse_args(argv)
    try:
        cfg = load_for_cluster(args)
    except ConfigError as exc:
        print(f"dist-sr k8s: config error: {exc}", file=sys.stderr)
        return 2
    for path in write(cfg, args.output, source=args.config or "the embedded default"):
        print(path)
    print(
        f"apply with: kubectl apply -f {Path(args.output) / SECRET_FILE} && kubectl apply -k {args.output}",
        file=sys.stderr,
    )
    return 0
