"""Rollout engines: the ``RolloutEngine`` protocol and registry (``base``), sampling from a local
model (``sampling``), and the built-in engines: ``embedded`` (the trainer's own model) and
``vllm`` (a ``vllm serve`` fleet fed by ``dist_sr.weightsync``)."""

from .base import (
    ROLLOUT_ENGINES,
    RolloutEngine,
    Rollouts,
    make_rollout_engine,
    register_rollout_engine,
    rollout_engine_class,
)
from .embedded import EmbeddedEngine
from .vllm.engine import VLLMFleetEngine

register_rollout_engine("embedded", EmbeddedEngine)
register_rollout_engine("vllm", VLLMFleetEngine)

__all__ = [
    "ROLLOUT_ENGINES",
    "EmbeddedEngine",
    "RolloutEngine",
    "Rollouts",
    "VLLMFleetEngine",
    "make_rollout_engine",
    "register_rollout_engine",
    "rollout_engine_class",
]
