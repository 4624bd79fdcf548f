"""Training engines: the ``TrainingEngine`` protocol (``base``), a registry, and the built-in
engines, each one module or package that owns its config, its patching and its weight source:
``single`` (one process), ``fsdp2`` (PyTorch FSDP2 / HSDP), ``deepspeed`` (ZeRO 0-3)."""

from .base import TrainingEngine, TrainSettings, init_distributed, make_engine, training_device
from .config import DistributedConfig
from .deepspeed.engine import DeepSpeedEngine
from .fsdp2.engine import FSDP2Engine
from .registry import engine_class, engine_names, register_engine
from .single import SingleEngine

register_engine("single", SingleEngine)
register_engine("deepspeed", DeepSpeedEngine)
register_engine("fsdp2", FSDP2Engine)

__all__ = [
    "DeepSpeedEngine",
    "DistributedConfig",
    "FSDP2Engine",
    "SingleEngine",
    "TrainSettings",
    "TrainingEngine",
    "engine_class",
    "engine_names",
    "init_distributed",
    "make_engine",
    "register_engine",
    "training_device",
]
