"""The one way dist-sr changes other people's code: ``patch(owner, name, replacement)`` sets
``owner.name`` (a class's method, a module's function) to ``replacement``, keeps the original,
marks the replacement, and records the patch, so that:

- patching twice is a no-op (the second call returns the patch in force); two patches of one
  attribute with different ``tag``s stack (the second wraps the first);
- ``original(owner, name)`` is what was there before (``ABSENT`` where the patch added the
  attribute), and ``unpatch`` puts it back;
- ``patches()`` lists every patch dist-sr has made in this process (``dist-sr doctor`` and the
  tests print them);
- ``patched(fn)`` tells a replacement from the original wherever it is found (a subclass, an
  instance), by its mark.

The replacement is told nothing: it closes over the original where it needs it (``original`` is
also ``replacement.__wrapped__``, as ``functools.wraps`` and ``inspect.unwrap`` expect). ``by``
names who made the patch (a module), for the listing. Methods given as ``staticmethod`` or
``classmethod`` objects are set as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MARK = "__dist_sr__"  # on every replacement: ``patched(fn)``
ABSENT = object()  # the original of an attribute a patch adds (``unpatch`` deletes it again)


@dataclass(frozen=True)
class Patch:
    owner: Any  # the class or module patched
    name: str
    original: Any
    replacement: Any
    by: str  # the dist-sr module that made it
    tag: str  # what the patch is for (patches of one attribute with different tags stack)

    def describe(self) -> str:
        where = getattr(self.owner, "__qualname__", None) or getattr(self.owner, "__name__", repr(self.owner))
        module = getattr(self.owner, "__module__", None) if isinstance(self.owner, type) else None
        what = "" if self.tag == self.name else f" [{self.tag}]"
        return f"{module + '.' if module else ''}{where}.{self.name}{what} (by {self.by})"


_PATCHES: dict[tuple[int, str, str], Patch] = {}


def _function(value: Any) -> Any:
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value


def patched(fn: Any) -> bool:
    """Whether ``fn`` (a function, or a static/class method object) is one of dist-sr's replacements."""
    return bool(getattr(_function(fn), MARK, False))


def patch(owner: Any, name: str, replacement: Any, *, by: str, tag: str | None = None) -> Patch:
    """Set ``owner.name`` to ``replacement`` (idempotent: while the patch ``tag`` of
    ``owner.name`` is recorded, it is returned and nothing changes). The original is read from
    ``owner.__dict__`` where it is defined there (a static or class method keeps its wrapper), else
    as an attribute; it may be another tag's patch, which the new one then wraps."""
    key = (id(owner), name, tag or name)
    current = _PATCHES.get(key)
    if current is not None:
        return current
    original = owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name, ABSENT)
    if patched(original) and not any(p.replacement is original for p in _PATCHES.values()):
        raise RuntimeError(
            f"{name} of {owner!r} is already one of dist-sr's replacements, made outside dist_sr.patching: "
            "patch every site through patch()"
        )
    fn = _function(replacement)
    setattr(fn, MARK, True)
    if not hasattr(fn, "__wrapped__") and original is not ABSENT:
        fn.__wrapped__ = _function(original)
    setattr(owner, name, replacement)
    _PATCHES[key] = record = Patch(owner, name, original, replacement, by, tag or name)
    return record


def original(owner: Any, name: str) -> Any:
    """What ``owner.name`` was before dist-sr patched it first (``owner.name`` when unpatched)."""
    first = next((p for (o, n, _), p in _PATCHES.items() if o == id(owner) and n == name), None)
    return first.original if first is not None else getattr(owner, name, ABSENT)


def unpatch(owner: Any, name: str, tag: str | None = None) -> bool:
    """Put back what ``owner.name`` was before the patch ``tag``; False if there is none. Refused
    while a later patch of the same attribute wraps it (unpatch that one first)."""
    key = (id(owner), name, tag or name)
    record = _PATCHES.get(key)
    if record is None:
        return False
    now = owner.__dict__.get(name, getattr(owner, name, None)) if hasattr(owner, "__dict__") else getattr(owner, name)
    if now is not record.replacement:
        raise RuntimeError(f"{record.describe()} is wrapped by a later patch: unpatch that one first")
    del _PATCHES[key]
    if record.original is ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, record.original)
    return True


def patches() -> list[Patch]:
    """Every patch dist-sr has in force in this process, in the order they were made."""
    return list(_PATCHES.values())
