"""The one registry shape behind every choose-by-name extension point: duplicates refused, an
unknown name listing the choices, lazy "module:attribute" entries imported on first use."""

import sys

import pytest

from dist_sr.config import Refusal
from dist_sr.registry import Registry, UnknownName


def test_a_registry_refuses_duplicates_and_lists_its_choices():
    reg = Registry("widget")
    reg.register("a", 1)
    reg.register("b", 2)
    with pytest.raises(ValueError, match="a widget named 'a' is already registered"):
        reg.register("a", 3)
    reg.register("a", 3, replace=True)
    assert dict(reg) == {"a": 3, "b": 2} and reg.names() == ("a", "b") and "a" in reg and "c" not in reg
    with pytest.raises(UnknownName, match=r"unknown widget 'c'; choose one of a, b") as info:
        reg["c"]
    assert isinstance(info.value, (KeyError, ValueError, Refusal))  # a lookup, a bad value, a one-line refusal
    with pytest.raises(ValueError, match="expected 'module:attribute'"):
        reg.register("d", "no_colon")


def test_a_lazy_entry_is_imported_when_first_asked_for(tmp_path, monkeypatch):
    (tmp_path / "lazy_widget_mod.py").write_text("import sys\nsys.lazy_widget_imported = True\nWidget = 'built'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("widget")
    reg.register("lazy", "lazy_widget_mod:Widget")
    assert not getattr(sys, "lazy_widget_imported", False)  # registering imports nothing
    assert reg["lazy"] == "built" and sys.lazy_widget_imported


def test_the_projects_registries_share_the_shape():
    from dist_sr.engines.registry import TRAINING_ENGINES
    from dist_sr.numerics import backends
    from dist_sr.optim.registry import OPTIMIZERS
    from dist_sr.precision import PRECISION_REGISTRY
    from dist_sr.rollout.base import ROLLOUT_ENGINES

    for reg in (TRAINING_ENGINES, OPTIMIZERS, PRECISION_REGISTRY, ROLLOUT_ENGINES):
        assert isinstance(reg, Registry)
        with pytest.raises(UnknownName, match="choose one of"):
            reg["no-such-entry"]
        with pytest.raises(ValueError, match="already registered"):
            reg.register(next(iter(reg)), object())
    with pytest.raises(ValueError, match="already registered"):
        backends.register_backend(backends.get("reference"))
