"""Engines a user writes outside dist-sr's package: a training engine and a rollout engine that
answer the capability questions dist-sr's config, preflight, planner and Kubernetes renderer ask
(``tests/launch/test_outside_engines.py`` registers them by ``"module:Class"``)."""

from __future__ import annotations

from dist_sr.config import ConfigError
from dist_sr.engines.single import SingleEngine
from dist_sr.launch.k8s import FleetManifests, headless_service, labels, meta
from dist_sr.rollout.embedded import EmbeddedEngine

PREFLIGHTS: list[str] = []  # what the rollout engine's preflight saw (the test reads it)


class PairedEngine(SingleEngine):
    """A launched engine that runs on an even number of ranks (say, one replica per pair of
    GPUs): no DeepSpeed JSON, no pure-BF16 training."""

    needs_process_group = True
    reads_deepspeed_json = False
    trains_pure_bf16 = False

    @classmethod
    def check_world(cls, distributed, world: int) -> None:
        if world % 2:
            raise ConfigError(f"distributed.engine={distributed.engine!r} runs on pairs of ranks; world {world} is odd")


class SidecarRollout(EmbeddedEngine):
    """A rollout engine that runs as pods of its own: its own Kubernetes renderer."""

    remote = True

    @classmethod
    def preflight(cls, config) -> None:
        PREFLIGHTS.append(config.engine)


def sidecar_manifests(cfg) -> FleetManifests:
    name = f"{cfg.cluster.name}-sidecar"
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(cfg, name, "rollout"),
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels(cfg, "rollout")},
            "template": {
                "metadata": {"labels": labels(cfg, "rollout")},
                "spec": {"containers": [{"name": "sidecar", "image": cfg.cluster.image}]},
            },
        },
    }
    return FleetManifests(
        rollout_config={},
        trainer_ports=[("sidecar-feed", 7000)],
        files={
            "sidecar-service.yaml": [headless_service(cfg, name, "rollout", [{"name": "http", "port": 9000}])],
            "sidecar-deployment.yaml": [deployment],
        },
    )
