"""The training-engine registry: a new engine is one module plus one ``register_engine`` call
(made in ``dist_sr/engines/__init__.py`` for the built-in ones)."""

from __future__ import annotations

TRAINING_ENGINES: dict[str, type] = {}


def register_engine(name: str, cls: type) -> None:
    TRAINING_ENGINES[name] = cls


def engine_names() -> tuple[str, ...]:
    return tuple(TRAINING_ENGINES)


def engine_class(name: str) -> type:
    try:
        return TRAINING_ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown training engine {name!r}; choose one of {', '.join(TRAINING_ENGINES)}") from None
