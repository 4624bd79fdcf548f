"""WeightSync against bare receiver processes (real HTTP, real gloo, no vLLM): many engines,
rank offsets, both transports from 2 trainer ranks, a receiver killed mid-sync. Runs everywhere."""

import json
import re
import signal

import pytest
import torch

from dist_sr.numerics.digest import combine, tensor_sums
from dist_sr.rollout.vllm.control import controls
from dist_sr.sources import ReplicatedSource
from dist_sr.testing.vllm_engines import free_port, spawn_receiver, wait_healthy
from dist_sr.weightsync.trainer.sync import WeightSync
from tests.dist_utils import run_workers

pytestmark = pytest.mark.slow


@pytest.fixture
def receivers():
    procs = []

    def start(n, *extra):
        procs.extend(spawn_receiver(*extra) for _ in range(n))  # all start at once, then each is awaited
        for p, url in procs[-n:]:
            wait_healthy(p, url)
        return procs[-n:]

    yield start
    for p, _ in procs:
        p.kill()
        p.wait()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Linear(300, 7)).to(torch.bfloat16)


def _worker(rank, world, data):
    model = _model()
    out = {}
    for transport, port in data["ports"].items():
        ws = WeightSync(
            ReplicatedSource(model, rank, world),
            controls(data["urls"], 30),
            transport=transport,
            bucket_mb=0.01,
            timeout_s=30,
            group_port=port,
        )
        r = ws.sync(4)
        out[transport] = {"digest": r.digest, "ready": r.ready, "bytes": r.bytes_sent}
    if rank == 0:
        out["reference"] = combine(tensor_sums(dict(model.named_parameters())))
        with open(data["out"], "w") as f:
            json.dump(out, f)


def _sync_with_both_transports(worker, world: int, urls: list[str], tmp_path) -> dict:
    """Run ``worker`` on ``world`` ranks, which syncs to ``urls`` once per transport; its rank 0's report."""
    out = tmp_path / "r.json"
    run_workers(
        worker, world, {"urls": urls, "out": str(out), "ports": {"broadcast": free_port(), "shard-direct": free_port()}}
    )
    return json.loads(out.read_text())


def test_three_receivers_get_the_same_bytes_from_two_ranks_with_both_transports(receivers, tmp_path):
    urls = [url for _, url in receivers(3)]
    r = _sync_with_both_transports(_worker, 2, urls, tmp_path)
    assert r["broadcast"]["digest"] == r["shard-direct"]["digest"] == r["reference"]
    assert r["broadcast"]["ready"] == r["shard-direct"]["ready"] == urls
    numel = sum(p.numel() for p in _model().parameters())
    assert r["broadcast"]["bytes"] == 2 * numel and r["shard-direct"]["bytes"] < 2 * numel


def test_a_receiver_killed_mid_sync_is_dropped_and_the_rest_are_verified(receivers):
    (pa, a), (pb, b) = receivers(2)
    model = _model()
    ws = WeightSync(
        ReplicatedSource(model), controls([a, b], 10), bucket_mb=0.002, timeout_s=10, group_port=free_port()
    )
    assert ws.sync(1).ready == [a, b]

    def kill_b(index, total):
        assert total >= 3
        if index == total // 2:
            pb.send_signal(signal.SIGKILL)
            pb.wait()

    r = ws.sync(2, on_bucket=kill_b)
    assert r.ready == [a] and r.attempts == 2 and any(b in p for p in r.problems)
    assert [e.state for e in ws.engines] == ["ready", "down"]


def test_a_receiver_holding_other_bits_is_named_with_its_tensor_and_gets_no_rollouts(receivers):
    """A receiver that loads one tensor with a flipped bit (and reports what it holds): the digest
    check names that engine and that tensor, it stays paused (pending), the healthy one serves."""
    ((_, a),) = receivers(1)
    ((_, b),) = receivers(1, "--corrupt", "1.weight")
    model = _model()
    ws = WeightSync(
        ReplicatedSource(model), controls([a, b], 10), bucket_mb=0.002, timeout_s=10, group_port=free_port()
    )
    r = ws.sync(1)
    assert r.ready == [a]
    assert [e.state for e in ws.engines] == ["ready", "pending"]
    (problem,) = r.problems
    assert b in problem and "'1.weight'" in problem and "0.weight" not in problem and "1.bias" not in problem
    # without the digests the faulty engine would have counted as ready: verification is what stops it
    assert ws.sync(2, verify=False).ready == [a, b]


def _hsdp_worker(rank, world, data):
    """FSDP2 as HSDP (2 replica groups x 2 shards) with keyed SR: the fleet gets the rounding of the
    full masters, and shard-direct spreads each shard's bytes over both replica groups."""
    from torch.distributed.fsdp import fully_shard

    from dist_sr import stochastic_round
    from dist_sr.engines import fsdp2
    from dist_sr.engines.fsdp2 import FSDP2Source
    from tests.engines.models import tiny_qwen2

    model = tiny_qwen2()
    ctx = fsdp2.prepare(model, seed=21)
    mesh = fsdp2.FSDP2Config(replicate=2).mesh()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mesh=mesh, mp_policy=fsdp2.MIXED_PRECISION)
    ctx.step = 3
    expected = combine(
        tensor_sums({n: stochastic_round(t, seed=21, step=3, param=n) for n, t in fsdp2.full_master(model).items()})
    )
    out = {}
    for transport, port in data["ports"].items():
        ws = WeightSync(
            FSDP2Source(model, ctx, rank, world),
            controls(data["urls"], 30),
            transport=transport,
            bucket_mb=0.05,
            timeout_s=30,
            group_port=port,
        )
        r = ws.sync(1)
        sent = [None] * world
        torch.distributed.all_gather_object(sent, r.bytes_sent)
        out[transport] = {"digest": r.digest, "ready": r.ready, "sent": sent}
    if rank == 0:
        out["expected"] = expected
        out["numel"] = sum(p.numel() for p in model.parameters())
        with open(data["out"], "w") as f:
            json.dump(out, f)


def test_hsdp_shard_direct_sends_each_element_once_from_every_replica_group(receivers, tmp_path):
    urls = [url for _, url in receivers(2)]
    r = _sync_with_both_transports(_hsdp_worker, 4, urls, tmp_path)
    assert r["broadcast"]["digest"] == r["shard-direct"]["digest"] == r["expected"]
    assert r["broadcast"]["ready"] == r["shard-direct"]["ready"] == urls
    sent = r["shard-direct"]["sent"]
    assert sum(sent) == 2 * r["numel"] and all(s > 0 for s in sent), sent  # once in total, every rank a share


def test_a_receiver_that_hangs_mid_sync_costs_one_timeout_not_one_per_bucket(receivers):
    """A stopped receiver (SIGSTOP: its sockets stay open, so small buckets still go out) never
    answers its update; the trainer waits timeout_s after the last bucket, not timeout_s for
    every bucket, leaves it out and verifies the other."""
    import time

    (pa, a), (pb, b) = receivers(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)]).to(torch.bfloat16)  # 24 tensors
    ws = WeightSync(ReplicatedSource(model), controls([a, b], 4), bucket_mb=0.0005, timeout_s=4, group_port=free_port())
    assert ws.sync(1).ready == [a, b]

    def stop_b(index, total):
        assert total >= 20  # the wait this bounds grew with the bucket count: 4 s x (1 + 24)
        if index == 3:
            pb.send_signal(signal.SIGSTOP)

    t0 = time.monotonic()
    r = ws.sync(2, on_bucket=stop_b)
    took = time.monotonic() - t0
    assert r.ready == [a] and any(b in p and "hangs" in p for p in r.problems), r.problems
    assert [e.state for e in ws.engines] == ["ready", "down"]
    assert took < 40, took  # one timeout for the hang, one for the health probe, the re-sync


def test_engines_that_answer_badly_are_marked_down_with_url_and_reason_and_the_sync_goes_on(receivers):
    """Real receivers behind engines whose replies break at each phase (``tests/bad_engines.py``):
    a banner at every route, a non-UTF-8 worker count, an init answer cut short, a JSON list for
    the update (the bytes arrived), a report of the wrong shape. Each is named down with its URL
    and what it sent; the sync goes on with the healthy engine, this time and the next."""
    from tests.bad_engines import BadEngine

    (_, good), *upstreams = receivers(4)
    hosts = [url.removeprefix("http://") for _, url in upstreams]
    bad = [
        BadEngine("banner"),
        BadEngine("not-utf8", on="/get_world_size"),
        BadEngine("cut-short", on="/init_weight_transfer_engine", upstream=hosts[0]),
        BadEngine("json-list", on="/update_weights", upstream=hosts[1]),
        BadEngine("wrong-json", on="/collective_rpc", upstream=hosts[2]),
    ]
    model = _model()
    urls = [good] + [b.url for b in bad]
    ws = WeightSync(ReplicatedSource(model), controls(urls, 10), bucket_mb=0.002, timeout_s=10, group_port=free_port())
    try:
        for version in (1, 2):
            r = ws.sync(version)
            assert r.ready == [good] and r.attempts == 3, r.problems  # init, then update, cost one retry each
            for e, b in zip(ws.engines[1:], bad):
                assert e.state == "down" and e.reason.startswith(b.url), (e.url, e.reason)
                assert re.search(b.expect, e.reason), (e.url, e.reason)
            assert r.digest == combine(tensor_sums(dict(model.named_parameters())))
    finally:
        for b in bad:
            b.close()


def _refused_start_worker(rank, world, data):
    model = _model()
    ws = WeightSync(
        ReplicatedSource(model, rank, world),
        controls(data["urls"], 10),
        transport="shard-direct",
        bucket_mb=0.002,
        timeout_s=10,
        group_port=data["port"],
    )
    r = ws.sync(1)
    if rank == 0:
        reference = combine(tensor_sums(dict(model.named_parameters())))
        with open(data["out"], "w") as f:
            json.dump(
                {"ready": r.ready, "attempts": r.attempts, "problems": r.problems, "ok": r.digest == reference}, f
            )


def test_an_engine_refusing_to_start_its_update_costs_every_trainer_rank_one_retry(receivers, tmp_path):
    """Rank 0 takes the engines through an update; when one refuses to start it (a reply that is
    not an answer), every rank must give up that attempt together: rank 1 sending its shards to
    engines never asked for them would wait in the transfer, then in a collective rank 0 skips.
    The retry goes on without the refusing engine, from both ranks."""
    from tests.bad_engines import BadEngine

    (_, good), (_, upstream) = receivers(2)
    bad = BadEngine("banner", on="/start_weight_update", upstream=upstream.removeprefix("http://"))
    out = tmp_path / "r.json"
    try:
        run_workers(_refused_start_worker, 2, {"urls": [good, bad.url], "out": str(out), "port": free_port()})
    finally:
        bad.close()
    r = json.loads(out.read_text())
    assert r["ready"] == [good] and r["attempts"] == 2 and r["ok"], r
    assert any(bad.url in p and "BadStatusLine" in p for p in r["problems"]), r["problems"]
