"""The ``cluster`` config section: where a job runs on Kubernetes (``dist-sr k8s`` renders the
manifests from it). Data only."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .config import ConfigError


@dataclass
class ClusterConfig:
    """Where the job runs on Kubernetes; ``dist-sr k8s`` renders the manifests from this section."""

    name: str = "dist-sr"  # prefix of every object's name (DNS-1035 label)
    namespace: str = "default"
    image: str = "dist-sr:latest"  # built from docker/Dockerfile
    launcher: str = "torchrun"  # torchrun | deepspeed (both start launch/train.py on every node)
    nnodes: int = 1  # trainer pods (Indexed Job completions)
    nproc_per_node: int = 1  # training processes per pod
    gpus_per_node: int = 0  # nvidia.com/gpu per trainer pod; 0 = CPU (gloo)
    gpus_per_engine: int | None = None  # per vLLM engine pod; default rollout.vllm.tensor_parallel_size
    cpu_per_engine: str = "8"
    memory_per_engine: str = "64Gi"
    master_port: int = 29500
    cpu_per_node: str = "4"
    memory_per_node: str = "16Gi"
    storage: str = "50Gi"  # PVC for checkpoints, caches and weight snapshots (ReadWriteMany)
    storage_class: str | None = None
    data_dir: str = "/data"  # where the PVC is mounted

    def __post_init__(self):
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?", self.name):
            raise ConfigError(
                f"cluster.name: {self.name!r} is not a DNS-1035 label of <= 32 characters "
                "(lower-case letters, digits, '-', starting with a letter)"
            )
        if self.launcher not in ("torchrun", "deepspeed"):
            raise ConfigError(f"cluster.launcher: unknown launcher {self.launcher!r}; choose torchrun or deepspeed")
        if self.nnodes < 1 or self.nproc_per_node < 1 or self.gpus_per_node < 0:
            raise ConfigError("cluster.nnodes and cluster.nproc_per_node must be >= 1, cluster.gpus_per_node >= 0")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise ConfigError(
                f"cluster.nproc_per_node={self.nproc_per_node} exceeds cluster.gpus_per_node="
                f"{self.gpus_per_node}: nccl needs one GPU per process"
            )
