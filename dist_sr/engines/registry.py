"""The training-engine registry: a new engine is one module plus one ``register_engine`` call
(made in ``dist_sr/engines/__init__.py`` for the built-in ones)."""

from __future__ import annotations

from ..registry import Registry

TRAINING_ENGINES: Registry[type] = Registry("training engine")


def register_engine(name: str, cls: type | str) -> None:
    """``cls``: a class satisfying ``engines.base.TrainingEngine``, or ``"module:Class"``."""
    TRAINING_ENGINES.register(name, cls)


def engine_names() -> tuple[str, ...]:
    return TRAINING_ENGINES.names()


def engine_class(name: str) -> type:
    return TRAINING_ENGINES[name]
