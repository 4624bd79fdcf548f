"""What ``scripts/peer_stacks.sh`` prints of a peer's loop test comes from the values the test
recorded (``tests/peers/results.py``), run as the script runs it: the extension the engine said it
runs, the engines and tensors verified and the tensor caught; a value that does not show the check
passing prints FAILED or NOT CAUGHT and fails the script, whatever the file's existence."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers import results

REPO = Path(__file__).resolve().parents[1]
EXTENSION = ["acme.rollout.CPUExtension", "acme.rollout.GPUExtension"]  # as an engine reports it
GOOD = {
    "version": "9.9.1",
    "extension": EXTENSION,
    "load_format": "dummy",
    "engines": 2,
    "verified": 2,
    "tensors": 24,
    "read_back": 6,
    "as_loaded": 18,
    "pushed": "model.layers.0.self_attn.q_proj.weight",
    "caught": ["model.layers.0.self_attn.q_proj.weight"],
    "pushed_as": "the FP32 master",
}


def printed(tmp_path, monkeypatch, cases: dict | None) -> tuple[int, list[str]]:
    """Record ``cases`` as a peer test does, then run the printer as ``peer_stacks.sh`` does."""
    path = tmp_path / "peer.json"
    monkeypatch.setenv(results.ENV, str(path))
    for case, values in (cases or {}).items():
        results.record("acme", case, **values)
    r = subprocess.run(
        [sys.executable, "-m", "tests.peers.results", str(path), "acme"], cwd=REPO, capture_output=True, text=True
    )
    return r.returncode, r.stdout.splitlines()


def test_the_lines_print_the_extension_the_engine_reported_and_the_recorded_counts(tmp_path, monkeypatch):
    rc, lines = printed(tmp_path, monkeypatch, {"colocated": GOOD})
    assert rc == 0, lines
    assert lines == [
        "peer-stack: acme 9.9.1: engine check through acme.rollout.CPUExtension (from acme.rollout.GPUExtension) "
        "(load format dummy): passed (2/2 engines verified, 24 tensors each: 6 read back, 18 only as loaded)",
        "peer-stack: acme 9.9.1: FP32 master pushed for model.layers.0.self_attn.q_proj.weight (the FP32 master): "
        "caught",
    ]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"verified": 1}, "engine check through .*: FAILED: not every engine verified \\(1/2 engines verified"),
        ({"engines": 0, "verified": 0}, "FAILED: not every engine verified"),
        ({"read_back": 5}, "FAILED: not every tensor checked \\(2/2 engines verified, 24 tensors each: 5 read back"),
        ({"extension": []}, "through no worker extension reported \\(\\[\\]\\) .*FAILED: the engine did not say"),
        ({"caught": []}, "FP32 master pushed for .*: NOT CAUGHT \\(the check named \\[\\]\\)"),
        ({"caught": ["model.norm.weight"]}, "NOT CAUGHT \\(the check named \\['model.norm.weight'\\]\\)"),
    ],
)
def test_values_that_do_not_show_the_check_passing_print_failed_and_fail_the_script(
    tmp_path, monkeypatch, change, words
):
    import re

    rc, lines = printed(tmp_path, monkeypatch, {"colocated": GOOD, "zero3": {**GOOD, **change}})
    assert rc == 1, lines
    bad = [line for line in lines if line.startswith("peer-stack: acme 9.9.1 [zero3]")]
    assert any(re.search(words, line) for line in bad), lines
    assert all("FAILED" not in line and "NOT CAUGHT" not in line for line in lines if "[colocated]" in line), lines


def test_a_case_without_its_counts_or_no_file_at_all_is_not_passed(tmp_path, monkeypatch):
    rc, lines = printed(tmp_path, monkeypatch, {"old": {"version": "1", "extension": EXTENSION, "passed": "ok"}})
    assert (
        rc == 1 and "FAILED (not recorded: load_format, engines, verified, tensors, read_back, as_loaded)" in lines[0]
    )
    assert "NOT CAUGHT (not recorded" in lines[1], lines
    rc, lines = printed(tmp_path / "none", monkeypatch, None)
    assert rc == 1 and lines == ["peer-stack: acme: engine check: NOT OBSERVED (its loop test did not pass)"]


def test_peer_stacks_prints_every_peers_lines_from_its_results_file():
    script = (REPO / "scripts" / "peer_stacks.sh").read_text()
    for peer in ("verl", "openrlhf"):
        assert f'-m tests.peers.results "$results/{peer}.json" {peer} || status=1' in script
    assert "own worker extension" not in script  # no extension named by the script itself
