"""The ``rollout`` config section: which rollout engine generates, and how often it is verified."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigError
from .base import rollout_engine_names
from .vllm.config import FleetConfig


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # embedded: transformers in-process (the CPU default) | vllm: a fleet
    verify_every: int = 1  # compare rollout-weight digest with the trainer's every N steps
    vllm: FleetConfig = field(default_factory=FleetConfig)

    def __post_init__(self):
        if self.engine not in rollout_engine_names():
            raise ConfigError(
                f"rollout.engine: unknown engine {self.engine!r}; choose one of {', '.join(rollout_engine_names())}"
            )
