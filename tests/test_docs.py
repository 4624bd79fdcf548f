"""The reference docs describe the code as it is: every module under ``dist_sr/`` appears in
``docs/architecture.md``'s module map, and every module the map names exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARCH = REPO / "docs" / "architecture.md"


def _modules() -> set[str]:
    root = REPO / "dist_sr"
    return {str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py"}


def _named_in_map() -> set[str]:
    text = ARCH.read_text()
    section = text[text.index("## Module map") :]
    return set(re.findall(r"`([a-z_0-9/]+\.py)`", section))


def test_every_module_is_in_the_architecture_map():
    missing = sorted(_modules() - _named_in_map())
    assert not missing, f"add these to docs/architecture.md's module map: {missing}"


def test_the_map_names_no_module_that_is_gone():
    named = {m for m in _named_in_map() if m != "__init__.py" and not (REPO / m).exists()}  # repo files too
    gone = sorted(named - _modules())
    assert not gone, f"docs/architecture.md's module map names modules that no longer exist: {gone}"
