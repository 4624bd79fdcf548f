"""The CI rule: under CI=true a skip fails the run (CUDA-only tests excepted); elsewhere it is a skip."""

import os
import subprocess
import sys

from tests.conftest import ROOT

SCRATCH = """
import pytest

def test_runs():
    pass

def test_needs_a_missing_extra():
    pytest.importorskip("dist_sr_no_such_module")

@pytest.mark.skipif(True, reason="no CUDA device")
def test_cuda_only():
    pass
"""


def _pytest(tmp_path, ci: str | None):
    (tmp_path / "test_scratch.py").write_text(SCRATCH)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.ci_skips", "-p", "no:cacheprovider", "-rA", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )


def test_in_ci_a_skip_other_than_no_cuda_fails(tmp_path):
    r = _pytest(tmp_path, "true")
    assert r.returncode == 1, r.stdout
    assert "1 failed, 1 passed, 1 skipped" in r.stdout
    assert "FAILED" in r.stdout and "test_needs_a_missing_extra" in r.stdout and "dist_sr_no_such_module" in r.stdout


def test_outside_ci_a_skip_is_a_skip(tmp_path):
    r = _pytest(tmp_path, None)
    assert r.returncode == 0 and "1 passed, 2 skipped" in r.stdout, r.stdout
