"""The ``distributed`` config section: which training engine runs, and its settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError
from .fsdp2.config import FSDP2Config
from .registry import engine_names


@dataclass
class DistributedConfig:
    engine: str = "single"  # a registered training engine: single | deepspeed | fsdp2
    deepspeed_config: str | None = None  # base DeepSpeed JSON; bf16/fp16 and the SR block follow `precision`
    zero_stage: int = 2  # when no deepspeed_config is given
    fsdp2: FSDP2Config = field(default_factory=FSDP2Config)  # shard_modules, reshard_after_forward, replicate (HSDP)

    def __post_init__(self):
        if self.engine not in engine_names():
            raise ConfigError(
                f"distributed.engine: unknown engine {self.engine!r}; choose one of {', '.join(engine_names())}"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"distributed.zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.deepspeed_config and not Path(self.deepspeed_config).exists():
            raise ConfigError(f"distributed.deepspeed_config: {self.deepspeed_config} does not exist")
        self.fsdp2 = FSDP2Config.from_dict(self.fsdp2)
