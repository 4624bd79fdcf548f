"""What the trainer's check of a verl weight sync reports about the rollout side, without verl
(verl's own classes run these paths in ``tests/peers/test_verl.py``, under
``scripts/peer_stacks.sh``): a checkpoint-engine sync whose rollout side checks nothing (replicas
other than vLLM's, rollout workers without dist-sr imported, deltas) is never reported verified,
in the result, its summary and its metrics; it stops the step unless ``DIST_SR_VERIFY=warn``."""

import logging
from types import SimpleNamespace

import pytest

from dist_sr.integrations.verl_sync import SyncCheck, enforce, rollout_side_gap
from dist_sr.rollout.vllm.check import HeldWeightsMismatch

SWITCH = "dist_sr.integrations.verl"


def rollout(name, modules=None):
    """verl's rollout config as the check reads it: ``name`` and ``checkpoint_engine``."""
    return SimpleNamespace(name=name, checkpoint_engine={"custom_backend_module": modules})


@pytest.mark.parametrize("name", ["sglang", "trtllm"])
def test_a_rollout_that_is_not_vllm_leaves_the_rollout_side_not_verified_by_name(name):
    gap = rollout_side_gap(rollout(name, SWITCH))  # dist-sr imported there too: still nothing checks
    assert gap.startswith(f"rollout side not verified: rollout.name={name}") and "DIST_SR_VERIFY=warn" in gap, gap


def test_vllm_replicas_check_their_engines_only_where_dist_sr_is_imported_on_the_rollout_side():
    assert "custom_backend_module=dist_sr.integrations.verl" in rollout_side_gap(rollout("vllm"))
    assert "custom_backend_module" in rollout_side_gap(rollout("vllm", "some.other_module"))
    assert rollout_side_gap(rollout("vllm", SWITCH)) == ""
    assert rollout_side_gap(rollout("vllm", ["some.other_module", SWITCH])) == ""


def test_a_sync_whose_rollout_side_checks_nothing_is_reported_so_and_stops_unless_warn(monkeypatch, caplog):
    checked = SyncCheck("checkpoint engine (nccl)")
    assert checked.ok and checked.metrics() == {"dist_sr/tensors_differ": 0.0, "dist_sr/rollout_side_verified": 1.0}
    gap = rollout_side_gap(rollout("sglang", SWITCH))
    unchecked = SyncCheck("checkpoint engine (nccl)", gap=gap)
    assert not unchecked.ok and unchecked.metrics()["dist_sr/rollout_side_verified"] == 0.0
    assert "rollout side not verified: rollout.name=sglang" in unchecked.summary()
    monkeypatch.delenv("DIST_SR_VERIFY", raising=False)
    with pytest.raises(HeldWeightsMismatch, match="checkpoint engine \\(nccl\\).*rollout side not verified"):
        enforce(unchecked)
    monkeypatch.setenv("DIST_SR_VERIFY", "warn")
    with caplog.at_level(logging.WARNING, logger="dist_sr.integrations.verl"):
        enforce(unchecked)  # logged, and training goes on
    assert any("rollout side not verified" in r.getMessage() for r in caplog.records)
