"""The vLLM fleet's Kubernetes manifests (``rollout.engine: vllm``, whose class names
``fleet_manifests`` as its renderer): a headless Service and a StatefulSet, one ``vllm serve``
per pod serving the trainer's latest weight snapshot, its control routes behind the sync
secret's signature check; the fleet's part of the config as the trainer's pods see it (engine
URLs by DNS name, the weight group's host, the snapshot directory on the volume)."""

from __future__ import annotations

import shlex

from ..rl.config import ExperimentConfig
from ..rollout.vllm.serve import ENV as SERVE_ENV
from ..rollout.vllm.serve import serve_flags
from .k8s import (
    SECRET_ENV,
    FleetManifests,
    headless_service,
    labels,
    master_addr,
    meta,
    names,
    resources,
    volumes,
)

HTTP_PORT_NAME = "http"
WEIGHTS_MOUNT = "/weights"  # an engine's own copy of the weights it rebuilt from base + deltas


def fleet_urls(cfg: ExperimentConfig) -> list[str]:
    """The engines' base URLs: one per StatefulSet pod, by its stable DNS name."""
    nm, f = names(cfg), cfg.rollout.vllm
    return [f"http://{nm['vllm']}-{i}.{nm['vllm']}:{f.port}" for i in range(f.replicas)]


def snapshot_dir(cfg: ExperimentConfig) -> str:
    return f"{cfg.cluster.data_dir}/snapshots/{cfg.cluster.name}"


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
        + shlex.join(serve_flags())
    )
    return ["/bin/sh", "-c", wait + serve]


def vllm_statefulset(cfg: ExperimentConfig) -> dict:
    c, f, nm = cfg.cluster, cfg.rollout.vllm, names(cfg)
    vols, mounts = volumes(cfg, data_read_only=True)
    if f.snapshot_deltas:
        vols.append({"name": "weights", "emptyDir": {}})
        mounts.append({"name": "weights", "mountPath": WEIGHTS_MOUNT})
    gpus = c.gpus_per_engine if c.gpus_per_engine is not None else (f.tensor_parallel_size if c.gpus_per_node else 0)
    container = {
        "name": "vllm",
        "image": c.image,
        "command": vllm_command(cfg),
        "env": [
            *({"name": k, "value": v} for k, v in SERVE_ENV.items()),  # the weight routes, behind SyncAuthMiddleware
            {"name": "VLLM_PLUGINS", "value": "dist_sr"},
            SECRET_ENV,
        ],
        "ports": [{"name": HTTP_PORT_NAME, "containerPort": f.port}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": HTTP_PORT_NAME}, "periodSeconds": 5},
        "volumeMounts": mounts,
        "resources": resources(c.cpu_per_engine, c.memory_per_engine, gpus),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(cfg, nm["vllm"], "rollout"),
        "spec": {
            "serviceName": nm["vllm"],
            "replicas": f.replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels(cfg, "rollout")},
            "template": {
                "metadata": {"labels": labels(cfg, "rollout")},
                "spec": {"containers": [container], "volumes": vols},
            },
        },
    }


def fleet_manifests(cfg: ExperimentConfig) -> FleetManifests:
    """``launch.k8s.FLEET_RENDERERS["vllm"]``: the fleet's Service and StatefulSet, its config as the pods
    see it, and the trainer's port for the weight-transfer group's store."""
    nm, f = names(cfg), cfg.rollout.vllm
    return FleetManifests(
        rollout_config={
            "vllm": {"urls": fleet_urls(cfg), "group_host": master_addr(cfg), "snapshot_dir": snapshot_dir(cfg)}
        },
        trainer_ports=[("weight-group", f.group_port)],
        files={
            "vllm-service.yaml": [
                headless_service(cfg, nm["vllm"], "rollout", [{"name": HTTP_PORT_NAME, "port": f.port}])
            ],
            "vllm-statefulset.yaml": [vllm_statefulset(cfg)],
        },
    )
