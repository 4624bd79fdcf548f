"""The rounding keys live in this process: what ``export_bf16`` rounds a master with.

Whatever turns SR on for a model (``engines.fsdp2.prepare``, the DeepSpeed hook's ``attach``)
registers an owner here. An owner answers for the parameters it rounds: the seed, the mode, and
the optimizer step whose result is live now (the key of the working weights the forward pass
uses). Owners are held weakly: a model that is gone no longer answers.
"""

from __future__ import annotations

import weakref
from typing import Protocol

from .key import normalize_param_name


class KeyOwner(Protocol):
    seed: int
    mode: str

    @property
    def step(self) -> int: ...

    def rounds(self, name: str) -> bool | None:
        """For a (normalized) parameter name of this owner's model: True when it is rounded with
        the key, False when it is not (frozen: its working weight is the round-to-nearest cast);
        None when the model has no parameter of that name."""
        ...

    def key_name(self, name: str) -> str:
        """The name the parameter is keyed by (a tied weight's first name)."""
        ...


_OWNERS: list[weakref.ref] = []


def register(owner: KeyOwner) -> None:
    _OWNERS[:] = [r for r in _OWNERS if r() is not None]
    _OWNERS.append(weakref.ref(owner))


def owners() -> list[KeyOwner]:
    return [o for o in (r() for r in _OWNERS) if o is not None]


def owner_of(name: str) -> KeyOwner | None:
    """The one live owner whose model has a parameter ``name`` (rounded or frozen); None when no
    owner knows it. Two owners knowing the same name (two SR models in one process with the same
    parameter names) are ambiguous: pass the owner explicitly then."""
    name = normalize_param_name(name)
    found = [o for o in owners() if o.rounds(name) is not None]
    if len(found) > 1:
        raise RuntimeError(
            f"{len(found)} SR models in this process round {name!r}: pass key= (the SRContext from "
            "dist_sr.engines.fsdp2.prepare, or engine.dist_sr for DeepSpeed) to say which"
        )
    return found[0] if found else None
