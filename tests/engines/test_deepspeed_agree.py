"""At ``deepspeed.initialize``, every rank agrees on (seed, mode, attached, dist-sr version) before
any of them attaches SR: a rank that differs, or that runs without dist-sr's hook while another
rank asks for SR, stops the job before the first step, named. Real DeepSpeed engines on 2 gloo
ranks; the multi-node launcher's form is ``tests/launch/test_multinode_deepspeed.py``."""

import json
import os

import pytest

from dist_sr.engines.deepspeed.agree import Record, disagreement
from tests.dist_utils import run_workers

deepspeed = pytest.importorskip("deepspeed")

CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "steps_per_print": 10_000,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}


def _rec(rank, seed=7, mode="stochastic", attached=True, version="0.1.0", hook="on", host="node-a"):
    return Record(rank, host, seed, mode, attached, version, hook)


def test_records_that_agree_pass_and_every_difference_is_named_with_its_fix():
    assert disagreement([_rec(0), _rec(1)], 120) is None
    # nobody asks for SR: every rank rounds to nearest alike, whatever else differs or is missing
    assert disagreement([_rec(0, seed=None, mode=None, attached=False), None], 120) is None
    assert disagreement([_rec(0, None, None, False, "0.1"), _rec(1, None, None, False, "0.2")], 120) is None

    text = disagreement([_rec(0), _rec(1), _rec(2, None, None, False, host="node-b"), _rec(3, None, None, False)], 120)
    assert "rank 0-1 (host node-a): SR seed 7, mode stochastic" in text
    assert "rank 2-3 (host node-a, node-b): no SR asked" in text
    assert "DIST_SR_SEED (or the JSON's block) reached rank 0-1 but not rank 2-3" in text
    assert "DIST_SR_SEED=7 in the .deepspeed_env" in text

    text = disagreement([_rec(0), _rec(1, seed=8)], 120)
    assert "rank 1 (host node-a): SR seed 8" in text and "different seeds or modes" in text
    assert "different seeds or modes" in disagreement([_rec(0), _rec(1, mode="dither")], 120)
    assert "same dist-sr version" in disagreement([_rec(0), _rec(1, version="0.0.9")], 120)

    text = disagreement([_rec(0), None, _rec(2), None], 30)
    assert "rank 1, 3: posted nothing within 30 s" in text and "without dist-sr's start-up hook" in text
    assert "`dist-sr doctor`" in text


def _worker(rank, world, out, plan):
    """Each rank runs ``plan[rank]``: the DIST_SR_SEED it sees, and whether its deepspeed.initialize
    is dist-sr's (the start-up hook) or DeepSpeed's own (a node without dist-sr)."""
    import torch.distributed as dist

    from dist_sr.engines.deepspeed.agree import RanksDisagree
    from dist_sr.engines.deepspeed.hook import hooked_initialize
    from tests.engines.models import tiny_qwen2

    seed, hooked = plan[rank]
    os.environ.pop("DIST_SR_SEED", None)
    if seed is not None:
        os.environ["DIST_SR_SEED"] = str(seed)
    os.environ["DIST_SR_AGREE_TIMEOUT"] = "4"
    plain = getattr(deepspeed.initialize, "__wrapped__", deepspeed.initialize)
    init = hooked_initialize(plain) if hooked else plain
    store = dist.distributed_c10d._get_default_store()
    model = tiny_qwen2()
    result = {}
    try:
        engine, *_ = init(model=model, model_parameters=model.parameters(), config=dict(CONFIG))
    except RanksDisagree as exc:
        result["refused"] = str(exc)
    else:
        result["attached"] = hasattr(engine, "dist_sr")
    finally:
        store.set(f"test/done/{rank}", "1")
    # (the test's own rendezvous: a rank that would step waits for the others' verdicts first)
    store.wait([f"test/done/{r}" for r in range(world)])
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)


def _results(tmp_path, plan):
    out = str(tmp_path / "r")
    run_workers(_worker, len(plan), out, plan)
    return [json.loads(open(f"{out}.{r}").read()) for r in range(len(plan))]


@pytest.mark.slow
def test_ranks_with_different_seeds_both_stop_naming_each_rank(tmp_path):
    r0, r1 = _results(tmp_path, [(11, True), (12, True)])
    for r in (r0, r1):
        assert "rank 0 (host" in r["refused"] and "SR seed 11" in r["refused"], r
        assert "rank 1 (host" in r["refused"] and "SR seed 12" in r["refused"], r
        assert "attached" not in r  # refused before SR was attached to anything


@pytest.mark.slow
def test_a_rank_without_dist_sr_is_named_by_the_ranks_that_ask_for_sr(tmp_path):
    r0, r1 = _results(tmp_path, [(11, True), (11, False)])
    assert "rank 1: posted nothing within 4 s" in r0["refused"] and "dist-sr doctor" in r0["refused"], r0
    assert r1 == {"attached": False}  # DeepSpeed's own initialize: it cannot know


@pytest.mark.slow
def test_ranks_that_agree_attach_and_a_job_without_sr_is_left_alone(tmp_path):
    assert _results(tmp_path, [(11, True), (11, True)]) == [{"attached": True}] * 2
    # no rank asks for SR: a rank without dist-sr is no disagreement (logged after the wait)
    assert _results(tmp_path, [(None, True), (None, False)]) == [{"attached": False}] * 2
