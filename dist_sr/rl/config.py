"""Typed experiment configuration, loaded from YAML and validated at load time.

Every section is a dataclass; an unknown key, a wrong type or a bad value raises ``ConfigError``
naming the field (``grpo.lr``) and what would be valid.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..precision import PrecisionConfig, PrecisionConfigError


class ConfigError(ValueError):
    pass


@dataclass
class ModelConfig:
    path: str | None = None          # from_pretrained: local directory or hub id; None = tiny model
    hidden_size: int = 64            # tiny Qwen2 built from a config when path is None
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    initializer_range: float = 0.25  # ~2/sqrt(d): LLM-like lr/|w| (DESIGN.md section 6)
    init_seed: int = 0


@dataclass
class TaskConfig:
    name: str = "reverse"            # reverse | add | dataset
    num_digits: int = 5
    source: str | None = None        # dataset: file path (.jsonl/.json/.parquet/.csv) or hub name
    split: str = "train"
    prompt_field: str = "question"
    answer_field: str = "answer"
    answer_format: str = "gsm8k"

    def __post_init__(self):
        from .tasks import TASKS

        if self.name not in TASKS:
            raise ConfigError(f"task.name: unknown task {self.name!r}; choose one of {', '.join(TASKS)}")
        if self.name == "dataset" and not self.source:
            raise ConfigError("task.source: the dataset task needs a file path or dataset name")


@dataclass
class WarmupConfig:
    """Supervised warm-up of a from-config model to partial accuracy, cached on disk."""

    enabled: bool = True
    distractor_fraction: float = 0.7  # share of targets that are the wrong "distractor" answer
    target_accuracy: float = 0.25     # stop when sampled accuracy reaches this
    max_steps: int = 4000
    batch_size: int = 256
    lr: float = 3e-3
    eval_every: int = 25
    eval_prompts: int = 512
    seed: int = 0
    cache_dir: str = "runs/cache"


@dataclass
class GRPOConfig:
    steps: int = 300
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    lr: float = 5e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0              # KL penalty (k3) to the frozen reference; 0 = off
    temperature: float = 1.0
    max_new_tokens: int = 6

    def __post_init__(self):
        if self.samples_per_prompt < 2:
            raise ConfigError("grpo.samples_per_prompt must be >= 2: advantages are normalised within a group")
        if self.steps < 0 or self.prompts_per_step < 1 or self.max_new_tokens < 1:
            raise ConfigError("grpo.steps must be >= 0, grpo.prompts_per_step and grpo.max_new_tokens >= 1")
        if self.lr <= 0 or self.temperature <= 0:
            raise ConfigError("grpo.lr and grpo.temperature must be > 0")


@dataclass
class EvalConfig:
    every: int = 10
    num_prompts: int = 1024
    seed: int = 1234                  # fixed prompts and fixed sampling noise at every evaluation


TRANSPORTS = ("broadcast", "shard-direct")


@dataclass
class FleetConfig:
    """A fleet of ``vllm serve`` engines that receive the trainer's BF16 weights after every step."""
    urls: list = field(default_factory=list)  # engine base URLs; empty = from the cluster section (Kubernetes)
    replicas: int = 1                 # engines (Kubernetes StatefulSet replicas)
    tensor_parallel_size: int = 1     # workers per engine; each joins the weight-transfer group
    port: int = 8000                  # each engine's HTTP port
    group_port: int = 29600           # trainer rank 0 hosts the weight-transfer group's store here
    group_host: str | None = None     # address engines use to reach trainer rank 0 (default: this host)
    transport: str = "broadcast"      # broadcast: gather per bucket, rank 0 sends | shard-direct: every rank sends
    bucket_mb: float = 64.0           # gather/send granularity
    timeout_s: float = 120.0          # per collective and per HTTP call; an engine that exceeds it is dropped
    snapshot_dir: str | None = None   # versioned safetensors snapshots, for engines that (re)start
    snapshot_every: int = 0           # with snapshot_dir: also every N versions (0 = only the start weights)
    startup_timeout_s: float = 1800.0  # how long the first sync waits for an engine to come up
    max_model_len: int = 128
    gpu_memory_utilization: float = 0.85

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"rollout.vllm.transport: unknown transport {self.transport!r}; "
                              f"choose one of {', '.join(TRANSPORTS)}")
        if self.replicas < 1 or self.tensor_parallel_size < 1:
            raise ConfigError("rollout.vllm.replicas and rollout.vllm.tensor_parallel_size must be >= 1")
        if self.bucket_mb <= 0 or self.timeout_s <= 0:
            raise ConfigError("rollout.vllm.bucket_mb and rollout.vllm.timeout_s must be > 0")
        if not all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in self.urls):
            raise ConfigError(f"rollout.vllm.urls: expected http(s):// base URLs, got {self.urls!r}")


@dataclass
class RolloutConfig:
    engine: str = "embedded"          # embedded: transformers in-process (the CPU default) | vllm: a fleet
    verify_every: int = 1             # compare rollout-weight digest with the trainer's every N steps
    vllm: FleetConfig = field(default_factory=FleetConfig)

    def __post_init__(self):
        if self.engine not in ("embedded", "vllm"):
            raise ConfigError(f"rollout.engine: unknown engine {self.engine!r}; choose one of embedded, vllm")


@dataclass
class ClusterConfig:
    """Where the job runs on Kubernetes; ``dist-sr k8s`` renders the manifests from this section."""
    name: str = "dist-sr"             # prefix of every object's name (DNS-1035 label)
    namespace: str = "default"
    image: str = "dist-sr:latest"     # built from docker/Dockerfile
    launcher: str = "torchrun"        # torchrun | deepspeed (both start launch/train.py on every node)
    nnodes: int = 1                   # trainer pods (Indexed Job completions)
    nproc_per_node: int = 1           # training processes per pod
    gpus_per_node: int = 0            # nvidia.com/gpu per trainer pod; 0 = CPU (gloo)
    gpus_per_engine: int | None = None  # per vLLM engine pod; default rollout.vllm.tensor_parallel_size
    cpu_per_engine: str = "8"
    memory_per_engine: str = "64Gi"
    master_port: int = 29500
    cpu_per_node: str = "4"
    memory_per_node: str = "16Gi"
    storage: str = "50Gi"             # PVC for checkpoints, caches and weight snapshots (ReadWriteMany)
    storage_class: str | None = None
    data_dir: str = "/data"           # where the PVC is mounted

    def __post_init__(self):
        import re

        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?", self.name):
            raise ConfigError(f"cluster.name: {self.name!r} is not a DNS-1035 label of <= 32 characters "
                              "(lower-case letters, digits, '-', starting with a letter)")
        if self.launcher not in ("torchrun", "deepspeed"):
            raise ConfigError(f"cluster.launcher: unknown launcher {self.launcher!r}; choose torchrun or deepspeed")
        if self.nnodes < 1 or self.nproc_per_node < 1 or self.gpus_per_node < 0:
            raise ConfigError("cluster.nnodes and cluster.nproc_per_node must be >= 1, cluster.gpus_per_node >= 0")
        if self.gpus_per_node and self.nproc_per_node > self.gpus_per_node:
            raise ConfigError(f"cluster.nproc_per_node={self.nproc_per_node} exceeds cluster.gpus_per_node="
                              f"{self.gpus_per_node}: nccl needs one GPU per process")


@dataclass
class DistributedConfig:
    engine: str = "single"                # single | deepspeed | fsdp2 (the latter two under torchrun/deepspeed)
    deepspeed_config: str | None = None   # base DeepSpeed JSON; bf16/fp16 and the SR block follow `precision`
    zero_stage: int = 2                   # when no deepspeed_config is given
    fsdp2: dict = field(default_factory=dict)  # FSDP2Config: shard_modules, reshard_after_forward, replicate (HSDP)

    def __post_init__(self):
        if self.engine not in ("single", "deepspeed", "fsdp2"):
            raise ConfigError(f"distributed.engine: unknown engine {self.engine!r}; choose one of single, deepspeed, fsdp2")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"distributed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.deepspeed_config and not Path(self.deepspeed_config).exists():
            raise ConfigError(f"distributed.deepspeed_config: {self.deepspeed_config} does not exist")
        from ..integrations.fsdp2 import FSDP2Config

        try:
            FSDP2Config.from_dict(self.fsdp2)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"distributed.{exc}") from None


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    seed: int = 0                     # RL sampling seed
    shadow_jitter: bool = False       # control run: move FP32 shadows off the BF16 grid at start
    output_dir: str = "runs/train"
    checkpoint_every: int = 0         # 0 = only at the end
    threads: int | None = None        # torch.set_num_threads

    def __post_init__(self):
        if self.shadow_jitter and self.precision.precision not in ("bf16", "bf16-sr", "bf16-dither", "fp16"):
            raise ConfigError("shadow_jitter needs FP32 shadows: precision fp16, bf16, bf16-sr or bf16-dither")
        if self.shadow_jitter and self.distributed.engine != "single":
            raise ConfigError("shadow_jitter is a single-process control run; use distributed.engine=single")
        if self.precision.precision == "bf16-pure-sr" and self.distributed.engine == "deepspeed":
            raise ConfigError("precision bf16-pure-sr keeps no FP32 master, which DeepSpeed always shards; "
                              "use bf16-sr with DeepSpeed, or distributed.engine=fsdp2 or single")


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is PrecisionConfig:
        return PrecisionConfig.from_dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        return _convert(next(a for a in args if a is not type(None)), value, where)
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return list(value)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_convert(a, v, where) for a, v in zip(typing.get_args(tp), value))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and not (isinstance(value, tp) and not (tp is int and isinstance(value, bool))):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def from_dict(cls, data: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, recursively, with errors that name the field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(f"unknown field(s) {[prefix + u for u in unknown]}; valid: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        path = f"{where}.{name}" if where else name
        try:
            kwargs[name] = _convert(hints[name], value, path)
        except PrecisionConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    try:
        return cls(**kwargs)
    except (PrecisionConfigError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where or 'config'}: {exc}") from None


def load_experiment(source: str | Path | dict, overrides: dict | None = None) -> ExperimentConfig:
    """An ``ExperimentConfig`` from a YAML file path, YAML text or a dict, with dotted overrides
    (``{"grpo.lr": 1e-5}``) applied before validation."""
    if isinstance(source, dict):
        data = source
    else:
        path = Path(source)
        if path.suffix in (".yaml", ".yml"):
            if not path.exists():
                raise ConfigError(f"config file {path} does not exist")
            data = yaml.safe_load(path.read_text()) or {}
        else:
            data = yaml.safe_load(str(source)) or {}
    data = _deep_copy(data)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted}: {p} is not a section")
        node[leaf] = value
    return from_dict(ExperimentConfig, data)


def to_dict(config: ExperimentConfig) -> dict:
    """Plain data that ``load_experiment`` turns back into ``config``."""
    data = dataclasses.asdict(config)
    data["precision"] = config.precision.to_dict()
    return data


def _deep_copy(d):
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d
