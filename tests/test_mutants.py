"""The mutation check's data (scripts/mutants.yaml) still applies to the tree: every planted bug
replaces text that occurs exactly once in its file with different text, names are unique, and
every test file it names exists (the check itself runs in CI with --fast; this catches a stale
entry in under a second, where a code change made it)."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("mutants_script", REPO / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.load()


MUTANTS = _mutants()


def test_names_are_unique_and_both_tiers_are_populated():
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert any(m.slow for m in MUTANTS) and any(not m.slow for m in MUTANTS)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_each_mutant_applies_once_and_names_tests_that_exist(mutant):
    text = (REPO / mutant.path).read_text()
    assert text.count(mutant.old) == 1, (
        f"{mutant.name}: its text occurs {text.count(mutant.old)} times in {mutant.path}"
    )
    assert mutant.new != mutant.old and mutant.tests
    for node in mutant.tests:
        assert (REPO / node.split("::")[0]).exists(), f"{mutant.name}: {node} names no test file"
