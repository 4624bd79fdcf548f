"""Rollout engines: the ``RolloutEngine`` protocol and registry (``base``), sampling from a local
model (``sampling``), and the built-in engines: ``embedded`` (the trainer's own model) and
``vllm`` (a ``vllm serve`` fleet fed by ``dist_sr.weightsync``)."""

from .base import ROLLOUT_ENGINES, RolloutEngine, Rollouts, make_rollout_engine, register_rollout_engine
from .embedded import EmbeddedEngine, make_embedded
from .vllm.engine import VLLMFleetEngine, make_vllm_fleet

register_rollout_engine("embedded", make_embedded)
register_rollout_engine("vllm", make_vllm_fleet)

__all__ = [
    "ROLLOUT_ENGINES",
    "EmbeddedEngine",
    "RolloutEngine",
    "Rollouts",
    "VLLMFleetEngine",
    "make_rollout_engine",
    "register_rollout_engine",
]
