"""One registry shape for every "choose by name" extension point (optimizers, precisions,
rounding backends, training engines, rollout engines): register by name, optionally lazily as
``"module:attribute"`` (imported on first use), a duplicate name refused, and an unknown name an
error that lists the choices.

    OPTIMIZERS = Registry("optimizer")
    OPTIMIZERS.register("adamw", torch.optim.AdamW)
    OPTIMIZERS.register("lion", "my_package.optim:Lion")     # imported when first asked for
    OPTIMIZERS["adamw"]                                       # a Mapping: in, iteration, .items()
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

from .config import Refusal

T = TypeVar("T")


def resolve(reference: str):
    """The object a ``"module:attribute"`` reference names (the module imported if it was not)."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)


class UnknownName(Refusal, KeyError, ValueError):
    """A name no entry of a registry has (the message lists the registered ones)."""

    what = "unknown name"

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


class Registry(Mapping, Generic[T]):
    """Entries by name, in registration order. ``kind`` names the entries in errors."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T | str] = {}

    def register(self, name: str, entry: T | str, *, replace: bool = False) -> None:
        """Add ``entry`` (an object, or ``"module:attribute"`` to import on first use) under
        ``name``; a name already registered is refused unless ``replace``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} is registered under a non-empty string name, got {name!r}")
        if name in self._entries and not replace:
            raise ValueError(
                f"a {self.kind} named {name!r} is already registered; choose another name (or "
                "register with replace=True)"
            )
        if isinstance(entry, str) and ":" not in entry:
            raise ValueError(f"lazy {self.kind} {name!r}: expected 'module:attribute', got {entry!r}")
        self._entries[name] = entry

    def __getitem__(self, name: str) -> T:
        try:
            entry = self._entries[name]
        except (KeyError, TypeError):
            raise UnknownName(f"unknown {self.kind} {name!r}; choose one of {', '.join(self._entries)}") from None
        if isinstance(entry, str):  # lazy: import it now, once
            entry = resolve(entry)
            self._entries[name] = entry
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._entries)})"
