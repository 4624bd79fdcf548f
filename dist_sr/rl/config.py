"""The experiment config: the RL sections (model, task, warm-up, GRPO, evaluation) and the
``ExperimentConfig`` that composes them with every other layer's section (precision,
distributed, rollout, cluster), loaded from YAML by the one loader in ``dist_sr.config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cluster import ClusterConfig
from ..config import ConfigError, from_dict, load_document
from ..engines import DistributedConfig, engine_class, engine_names
from ..optim import OPTIMIZERS
from ..precision import PrecisionConfig
from ..rollout.config import RolloutConfig
from .cpu_math import check_cpu_matmul
from .tasks import RG_ANSWERS, TASKS

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "DistributedConfig",
    "EvalConfig",
    "ExperimentConfig",
    "GRPOConfig",
    "GymConfig",
    "ModelConfig",
    "RolloutConfig",
    "TaskConfig",
    "WarmupConfig",
    "from_dict",
    "load_experiment",
    "to_dict",
]


@dataclass
class ModelConfig:
    path: str | None = None  # from_pretrained: local directory or hub id; None = tiny model
    hidden_size: int = 64  # tiny Qwen2 built from a config when path is None
    intermediate_size: int = 192
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    initializer_range: float = 0.25  # ~2/sqrt(d): LLM-like lr/|w| (DESIGN.md section 6)
    init_seed: int = 0

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} must be a multiple of "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.initializer_range <= 0:
            raise ConfigError(f"model.initializer_range must be > 0, got {self.initializer_range}")


@dataclass
class GymConfig:
    """A reasoning-gym dataset (``task.name: reasoning-gym``; ``tasks.ReasoningGym``)."""

    dataset: str = "chain_sum"  # a name in reasoning_gym's registry
    params: dict[str, Any] = field(default_factory=dict)  # the dataset's config (min_terms, max_digits, ...)
    seed: int = 0  # the generator's seed; also seeds the train/eval split
    size: int = 100_000  # generator indices drawn from
    eval_share: float = 0.25  # share of questions held out for evaluation (by a hash of the text)
    answer: str = "last-number"  # what is scored: last-number | tag (<answer>...</answer>) | full

    def __post_init__(self):
        if not isinstance(self.params, dict):
            raise ConfigError(f"task.gym.params must be a mapping of the dataset's config fields, got {self.params!r}")
        if not 0 < self.eval_share < 1:
            raise ConfigError(f"task.gym.eval_share must be in (0, 1), got {self.eval_share}")
        if self.size < 1:
            raise ConfigError(f"task.gym.size must be >= 1, got {self.size}")
        if self.answer not in RG_ANSWERS:
            raise ConfigError(f"task.gym.answer: choose one of {', '.join(RG_ANSWERS)}, got {self.answer!r}")


@dataclass
class TaskConfig:
    name: str = "reverse"  # reverse | add | chat-add (a chat model's own format) | dataset | reasoning-gym
    num_digits: int = 5  # chat-add: each operand has 1..num_digits digits
    question: str = "What is {a} + {b}?"  # chat-add: the user message
    source: str | None = None  # dataset: file path (.jsonl/.json/.parquet/.csv) or hub name
    split: str = "train"
    prompt_field: str = "question"
    answer_field: str = "answer"
    answer_format: str = "gsm8k"
    gym: GymConfig | None = None  # reasoning-gym: which dataset, its config, the split

    def __post_init__(self):
        if self.name == "reasoning-gym" and self.gym is None:
            self.gym = GymConfig()
        if self.gym is not None and self.name != "reasoning-gym":
            raise ConfigError(f"task.gym is for task.name reasoning-gym; task.name is {self.name!r}")
        if self.name not in TASKS:
            raise ConfigError(f"task.name: unknown task {self.name!r}; choose one of {', '.join(TASKS)}")
        if self.name == "dataset" and not self.source:
            raise ConfigError("task.source: the dataset task needs a file path or dataset name")
        if self.name == "chat-add" and ("{a}" not in self.question or "{b}" not in self.question):
            raise ConfigError(f"task.question must contain {{a}} and {{b}} (the operands), got {self.question!r}")


@dataclass
class WarmupConfig:
    """Supervised warm-up of a from-config model to partial accuracy, cached on disk."""

    enabled: bool = True
    distractor_fraction: float = 0.7  # share of targets that are the wrong "distractor" answer
    target_accuracy: float = 0.25  # stop when sampled accuracy reaches this
    max_steps: int = 4000
    batch_size: int = 256
    lr: float = 3e-3
    eval_every: int = 25
    eval_prompts: int = 512
    seed: int = 0
    cache_dir: str = "runs/cache"
    # model.path set: warm its checkpoint up too (right answers only, from its BF16 cast), one start
    # checkpoint per warm-up seed, instead of starting every run from the cast itself
    pretrained: bool = False


@dataclass
class GRPOConfig:
    steps: int = 300
    optimizer: str = "adamw"  # a registered optimizer (dist_sr.optim.OPTIMIZERS)
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    lr: float = 5e-6
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # KL penalty (k3) to the frozen reference; 0 = off
    temperature: float = 1.0
    max_new_tokens: int = 6
    # a run that skips more than this share of its steps (non-finite gradients, loss-scale
    # overflows) stops with an error instead of finishing without training
    max_skipped_fraction: float = 0.25
    # training-inference mismatch (rollouts from another engine, dist_sr.rl.mismatch): the
    # importance-sampling correction (none | tis: token-level truncated | mis: sequence-level
    # masked), its cap (> 1), and the |log-ratio| a token counts as mismatched beyond
    is_correction: str = "none"
    is_cap: float = 2.0
    mismatch_threshold: float = 0.1

    def __post_init__(self):
        if self.samples_per_prompt < 2:
            raise ConfigError("grpo.samples_per_prompt must be >= 2: advantages are normalised within a group")
        if self.steps < 0 or self.prompts_per_step < 1 or self.max_new_tokens < 1:
            raise ConfigError("grpo.steps must be >= 0, grpo.prompts_per_step and grpo.max_new_tokens >= 1")
        if self.lr <= 0 or self.temperature <= 0:
            raise ConfigError("grpo.lr and grpo.temperature must be > 0")
        if self.max_grad_norm <= 0:
            raise ConfigError(
                f"grpo.max_grad_norm must be > 0 (the gradient's norm is clipped to it), got {self.max_grad_norm}"
            )
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"grpo.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if self.eps <= 0 or self.weight_decay < 0 or self.clip_eps <= 0 or self.kl_coef < 0:
            raise ConfigError("grpo.eps and grpo.clip_eps must be > 0, grpo.weight_decay and grpo.kl_coef >= 0")
        if self.is_correction not in ("none", "tis", "mis"):
            raise ConfigError(
                f"grpo.is_correction: unknown correction {self.is_correction!r}; choose none, tis "
                "(token-level truncated importance sampling) or mis (sequence-level masked)"
            )
        if not self.is_cap > 1 or not self.mismatch_threshold > 0:
            raise ConfigError(
                f"grpo.is_cap must be > 1 (got {self.is_cap}) and grpo.mismatch_threshold > 0 "
                f"(got {self.mismatch_threshold})"
            )
        if not 0 <= self.max_skipped_fraction < 1:
            raise ConfigError(
                f"grpo.max_skipped_fraction must be in [0, 1) (the share of steps a run may skip), got "
                f"{self.max_skipped_fraction}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"grpo.optimizer: unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"
            )


@dataclass
class EvalConfig:
    every: int = 10
    num_prompts: int = 1024
    seed: int = 1234  # fixed prompts and fixed sampling noise at every evaluation

    def __post_init__(self):
        if self.every < 1 or self.num_prompts < 1:
            raise ConfigError(f"eval.every and eval.num_prompts must be >= 1, got {self.every} and {self.num_prompts}")


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
    seed: int = 0  # RL sampling seed
    shadow_jitter: bool = False  # control run: move FP32 shadows off the BF16 grid at start
    output_dir: str = "runs/train"
    checkpoint_every: int = 50  # steps between checkpoints (0 = only at the end)
    threads: int | None = None  # torch.set_num_threads
    # how the trainer computes BF16/FP16 matrix products on a CPU (rl/cpu_math.py): native (torch's
    # kernels) or fp32-accumulate (FP32 GEMMs rounded once to BF16/FP16, as matrix units do: 7.5x
    # (BF16) and 18x (FP16) faster where the CPU has no BF16/FP16 units)
    cpu_matmul: str = "native"

    def __post_init__(self):
        check_cpu_matmul(self.cpu_matmul)
        if self.warmup.pretrained and (self.model.path is None or not self.warmup.enabled):
            raise ConfigError(
                "warmup.pretrained warms up the checkpoint of model.path: set model.path (and warmup.enabled), "
                "or set warmup.pretrained to false"
            )
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"threads must be >= 1 (or null for torch's default), got {self.threads}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        spec = self.precision.spec
        if self.shadow_jitter and not spec.shadows:
            raise ConfigError("shadow_jitter needs FP32 shadows: precision fp16, bf16, bf16-sr or bf16-dither")
        engine = engine_class(self.distributed.engine)
        if self.shadow_jitter and engine.needs_process_group:
            raise ConfigError("shadow_jitter is a single-process control run; use distributed.engine=single")
        if spec.pure and not engine.trains_pure_bf16:
            pure = ", ".join(n for n in engine_names() if engine_class(n).trains_pure_bf16)
            raise ConfigError(
                f"precision {spec.name} keeps no FP32 master, which distributed.engine={self.distributed.engine} "
                f"always keeps; use bf16-sr with it, or distributed.engine {pure}"
            )


def load_experiment(source: str | Path | dict, overrides: dict | None = None) -> ExperimentConfig:
    """An ``ExperimentConfig`` from a YAML file path, YAML text or a dict, with dotted overrides
    (``{"grpo.lr": 1e-5}``) applied before validation."""
    return from_dict(ExperimentConfig, load_document(source, overrides))


def to_dict(config: ExperimentConfig) -> dict:
    """Plain data that ``load_experiment`` turns back into ``config``."""
    data = dataclasses.asdict(config)
    data["precision"] = config.precision.to_dict()
    return data
