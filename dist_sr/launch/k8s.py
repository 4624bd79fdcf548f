"""Kubernetes manifests rendered from an experiment config (core API only, no operators).

``dist-sr k8s --config EXP.yaml [--deepspeed_config DS.json] -o DIR`` writes:

- ``configmap.yaml``: the resolved experiment config (and the DeepSpeed JSON) the pods read;
- ``pvc.yaml``: a ReadWriteMany volume for checkpoints, caches and weight snapshots;
- ``trainer-service.yaml``: headless Service; pod ``<name>-trainer-<i>`` resolves as
  ``<name>-trainer-<i>.<name>-trainer``, and index 0 is the rendezvous host;
- ``trainer-job.yaml``: an Indexed Job, one pod per node, node rank = completion index, each
  running ``torchrun``/``deepspeed`` on ``launch/train.py``;
- with a rollout engine that runs as pods of its own, what its renderer adds (``FleetManifests``;
  ``rollout.engine: vllm``: ``vllm-service.yaml`` + ``vllm-statefulset.yaml``, one ``vllm serve``
  per pod, its control routes behind the sync secret's signature check, ``k8s_vllm.py``);
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
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..config import ConfigError, parse_overrides
from ..engines import engine_class
from ..registry import Registry
from ..rl.config import ExperimentConfig, load_experiment, to_dict
from ..rollout import rollout_engine_class
from ..weightsync import auth
from .planner import build_parser, config_source, plan

CONFIG_MOUNT = "/etc/dist-sr"
SECRET_MOUNT = "/etc/dist-sr-secret"
SECRET_FILE = "sync-secret.yaml"
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
WORKDIR = "/opt/dist-sr"  # the image's checkout (docker/Dockerfile)
ENTRY = "launch/train.py"


def labels(cfg: ExperimentConfig, component: str) -> dict:
    return {
        "app.kubernetes.io/name": "dist-sr",
        "app.kubernetes.io/instance": cfg.cluster.name,
        "app.kubernetes.io/component": component,
    }


def meta(cfg: ExperimentConfig, name: str, component: str) -> dict:
    return {"name": name, "namespace": cfg.cluster.namespace, "labels": labels(cfg, component)}


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


def master_addr(cfg: ExperimentConfig) -> str:
    nm = names(cfg)
    return f"{nm['trainer']}-0.{nm['trainer']}"


@dataclass(frozen=True)
class FleetManifests:
    """What a rollout engine that runs as pods of its own (``RolloutEngine.remote``, rendered by
    its ``kubernetes`` function) adds to the job: values for its part of the ``rollout`` config as
    the trainer's pods must see it (section -> fields: the engines' URLs by DNS name, ...), the
    ports the trainer pods open for it (name, port), and its files (file name -> objects: its
    Services and workloads, its pods labelled component ``rollout``, which the network policies
    let reach the trainer and each other)."""

    rollout_config: dict[str, dict]
    trainer_ports: list[tuple[str, int]]
    files: dict[str, list[dict]]


# rollout engine (by its rollout.engine name) -> the function that renders its pods,
# ``function(cfg) -> FleetManifests``; an engine that runs inside the trainer needs none
FLEET_RENDERERS: Registry = Registry("Kubernetes renderer of a rollout engine")
FLEET_RENDERERS.register("vllm", "dist_sr.launch.k8s_vllm:fleet_manifests")


def register_fleet_renderer(engine: str, renderer) -> None:
    """How the Kubernetes render makes the pods of rollout engine ``engine`` (a function, or
    ``"module:function"`` imported when first asked for)."""
    FLEET_RENDERERS.register(engine, renderer)


def fleet(cfg: ExperimentConfig) -> FleetManifests | None:
    """The rollout engine's own manifests, or None for an engine that runs inside the trainer."""
    name = cfg.rollout.engine
    if not rollout_engine_class(name).remote:
        return None
    if name not in FLEET_RENDERERS:
        raise ConfigError(
            f"rollout.engine={name!r} runs as processes of its own but has no Kubernetes renderer: register one "
            "with dist_sr.launch.k8s.register_fleet_renderer, render its pods yourself, or pick another engine"
        )
    return FLEET_RENDERERS[name](cfg)


def trainer_ports(cfg: ExperimentConfig) -> list[tuple[str, int]]:
    """(name, port) the trainer pods open: the rendezvous, then what the rollout fleet needs."""
    parts = fleet(cfg)
    return [("rendezvous", cfg.cluster.master_port), *(parts.trainer_ports if parts is not None else [])]


def cluster_config(cfg: ExperimentConfig) -> tuple[dict, dict | None]:
    """The experiment config as the pods see it (paths on the volume, the fleet by DNS name), and
    the DeepSpeed JSON if the engine uses one."""
    c = cfg.cluster
    data = to_dict(cfg)
    data["output_dir"] = f"{c.data_dir}/runs/{c.name}"
    data["warmup"]["cache_dir"] = f"{c.data_dir}/cache"
    ds = None
    if engine_class(cfg.distributed.engine).reads_deepspeed_json and cfg.distributed.deepspeed_config:
        ds = json.loads(Path(cfg.distributed.deepspeed_config).read_text())
        data["distributed"]["deepspeed_config"] = f"{CONFIG_MOUNT}/deepspeed.json"
    parts = fleet(cfg)
    if parts is not None:
        for section, values in parts.rollout_config.items():
            data["rollout"][section].update(values)
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


def volumes(cfg: ExperimentConfig, *, data_read_only: bool = False) -> tuple[list, list]:
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
        "metadata": meta(cfg, names(cfg)["secret"], "secret"),
        "type": "Opaque",
        "stringData": {"secret": value},
    }


def resources(cpu: str, memory: str, gpus: int) -> dict:
    res = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if gpus:
        res["requests"]["nvidia.com/gpu"] = gpus
        res["limits"]["nvidia.com/gpu"] = gpus
    return res


def trainer_job(cfg: ExperimentConfig) -> dict:
    c, nm = cfg.cluster, names(cfg)
    vols, mounts = volumes(cfg)
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
    ports = [{"name": name, "containerPort": port} for name, port in trainer_ports(cfg)]
    container = {
        "name": "trainer",
        "image": c.image,
        "workingDir": WORKDIR,
        "command": trainer_command(cfg),
        "env": env,
        "ports": ports,
        "volumeMounts": mounts,
        "resources": resources(c.cpu_per_node, c.memory_per_node, c.gpus_per_node),
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta(cfg, nm["trainer"], "trainer"),
        "spec": {
            "completionMode": "Indexed",
            "completions": c.nnodes,
            "parallelism": c.nnodes,
            # one lost node fails the whole job; resubmitting resumes from the checkpoint (--resume-or-start)
            "backoffLimit": 0,
            "template": {
                "metadata": {"labels": labels(cfg, "trainer")},
                "spec": {
                    "subdomain": nm["trainer"],
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": vols,
                },
            },
        },
    }


def headless_service(cfg: ExperimentConfig, name: str, component: str, ports: list[dict]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(cfg, name, component),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels(cfg, component),
            "ports": ports,
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
    trainer = {"podSelector": {"matchLabels": labels(cfg, "trainer")}}
    rollout = {"podSelector": {"matchLabels": labels(cfg, "rollout")}}
    dns = {"to": [{"namespaceSelector": {}}], "ports": DNS_PORTS}
    has_fleet = fleet(cfg) is not None
    peers = [trainer, rollout] if has_fleet else [trainer]

    def policy(name, component, ingress, egress):
        return {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta(cfg, name, component),
            "spec": {
                "podSelector": {"matchLabels": labels(cfg, component)},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": copy.deepcopy(ingress),
                "egress": copy.deepcopy(egress),
            },
        }

    deny = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(cfg, nm["deny"], "policy"),
        "spec": {"podSelector": {"matchLabels": instance}, "policyTypes": ["Ingress", "Egress"]},
    }
    out = [deny, policy(nm["trainer_policy"], "trainer", [{"from": peers}], [{"to": peers}, dns])]
    if has_fleet:
        out.append(policy(nm["policy"], "rollout", [{"from": [trainer, rollout]}], [{"to": [trainer, rollout]}, dns]))
    return out


def render(cfg: ExperimentConfig) -> dict[str, list[dict]]:
    """File name -> the Kubernetes objects in it."""
    c, nm = cfg.cluster, names(cfg)
    data, ds = cluster_config(cfg)
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta(cfg, nm["config"], "config"),
        "data": {"experiment.yaml": yaml.safe_dump(data, sort_keys=False)},
    }
    if ds is not None:
        config_map["data"]["deepspeed.json"] = json.dumps(ds, indent=2) + "\n"
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta(cfg, nm["data"], "storage"),
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": c.storage}}},
    }
    if c.storage_class:
        pvc["spec"]["storageClassName"] = c.storage_class
    service_ports = [{"name": name, "port": port} for name, port in trainer_ports(cfg)]
    files = {
        "configmap.yaml": [config_map],
        "pvc.yaml": [pvc],
        "trainer-service.yaml": [headless_service(cfg, nm["trainer"], "trainer", service_ports)],
        "trainer-job.yaml": [trainer_job(cfg)],
    }
    parts = fleet(cfg)
    if parts is not None:
        files.update(parts.files)
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
