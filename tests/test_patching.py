"""The one patch mechanism (``dist_sr.patching``): what dist-sr changes in other people's code is
kept, marked, idempotent, undoable and listed, and no module patches any other way."""

import re
import subprocess
import sys
import types

import pytest

from dist_sr import patching
from tests.conftest import ROOT


def _owner():
    class Engine:
        def step(self):
            return "theirs"

    return Engine


def test_a_patch_keeps_the_original_marks_the_replacement_and_is_undone():
    Engine = _owner()
    theirs = Engine.step

    def step(self):
        return "ours+" + theirs(self)

    record = patching.patch(Engine, "step", step, by="tests")
    assert Engine().step() == "ours+theirs" and patching.patched(Engine.step) and not patching.patched(theirs)
    assert patching.original(Engine, "step") is theirs and step.__wrapped__ is theirs
    assert record in patching.patches() and "Engine.step (by tests)" in record.describe()
    assert patching.patch(Engine, "step", lambda self: "again", by="tests") is record  # idempotent
    assert Engine().step() == "ours+theirs"
    assert patching.unpatch(Engine, "step") and Engine.step is theirs and record not in patching.patches()
    assert not patching.unpatch(Engine, "step")


def test_patches_of_one_attribute_with_different_tags_stack_and_unwind_in_order():
    Engine = _owner()
    first = patching.patch(Engine, "step", lambda self, f=Engine.step: "a+" + f(self), by="tests", tag="a")
    patching.patch(Engine, "step", lambda self, f=Engine.step: "b+" + f(self), by="tests", tag="b")
    assert Engine().step() == "b+a+theirs" and patching.original(Engine, "step") is first.original
    with pytest.raises(RuntimeError, match="wrapped by a later patch"):
        patching.unpatch(Engine, "step", "a")
    assert patching.unpatch(Engine, "step", "b") and patching.unpatch(Engine, "step", "a")
    assert Engine().step() == "theirs"


def test_an_added_attribute_is_removed_again_and_module_functions_patch_alike():
    Engine = _owner()
    patching.patch(Engine, "rpc", lambda self: "answer", by="tests")
    assert Engine().rpc() == "answer" and patching.original(Engine, "rpc") is patching.ABSENT
    assert patching.unpatch(Engine, "rpc") and not hasattr(Engine, "rpc")
    module = types.ModuleType("peer")
    module.load = lambda: "theirs"
    patching.patch(module, "load", lambda: "ours", by="tests")
    assert module.load() == "ours" and patching.unpatch(module, "load") and module.load() == "theirs"


def test_a_replacement_made_outside_the_mechanism_is_refused():
    Engine = _owner()

    def step(self):
        return "hand-rolled"

    step.__dist_sr__ = True
    Engine.step = step
    with pytest.raises(RuntimeError, match="outside dist_sr.patching"):
        patching.patch(Engine, "step", lambda self: "x", by="tests")


def test_no_module_marks_or_patches_by_hand():
    """Every ``__dist_sr__`` mark and ``PATCHED`` flag lives in ``dist_sr/patching.py``."""
    offenders = []
    for path in sorted((ROOT / "dist_sr").rglob("*.py")):
        if path.name == "patching.py":
            continue
        text = path.read_text()
        if re.search(r"__dist_sr__\b|^PATCHED\s*=", text, re.M):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_the_start_up_hooks_patch_of_deepspeed_is_listed_in_the_process():
    """A process where the hook is in force (scripts/setup.sh installs it): importing deepspeed
    patches ``deepspeed.initialize`` through the mechanism, and the listing says so."""
    code = "import deepspeed; from dist_sr import patching; print([p.describe() for p in patching.patches()])"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "initialize [hook] (by dist_sr.integrations.startup)" in r.stdout, r.stdout
