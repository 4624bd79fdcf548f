"""The memory modes on one GPU (run by ``bench/gpu_check.sh``; they skip elsewhere): FP32 masters
on the host, working weights on the device. Rounded where the masters live (the C++ kernel on the
host), one copy of BF16 bytes to the device; the bits are the CPU reference's; the device memory
dist-sr adds stays within the figures ``bench/memory.py`` reports in ``docs/performance.md``; an
offload of the sharded model leaves no device memory held by dist-sr."""

import gc
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (world 1, NCCL)")

SEED, STEPS = 1234, 3
# docs/performance.md, "What SR costs in memory" (device bytes per parameter: at rest, at peak)
DOCUMENTED = {"zero2-offload": (0.0, 0.0), "zero3-offload": (0.0, 0.0), "fsdp2-offload": (0.0, 0.0)}
SLACK = 0.02  # bytes per parameter: the allocator's rounding of small blocks


def _spawn(fn, *args):
    import torch.multiprocessing as mp

    from dist_sr.net import free_port

    mp.spawn(_entry, args=(free_port(), fn, args), nprocs=1)


def _entry(rank, port, fn, args):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    os.environ.pop("DS_ACCELERATOR", None)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def llama():
    from bench.common import tiny_llama

    return tiny_llama(256, 2, vocab=1024)


def ids():
    return torch.randint(0, 1024, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()


def _deepspeed_worker(zero, routes_expected):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from dist_sr import stochastic_round
    from dist_sr.engines import deepspeed as dsr

    model = llama()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "steps_per_print": 10**6,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "stochastic_rounding": {"enabled": True, "seed": SEED, "mode": "stochastic"},
    }
    engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=config)
    for _ in range(STEPS):
        engine.backward(engine(input_ids=ids(), labels=ids()).loss)
        engine.step()
    routes = engine.dist_sr.layout.routes()
    assert {(r.master, r.rounded_into, r.working, r.copied_by) for r in routes} == routes_expected
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params], enabled=zero["stage"] == 3):
        for name, p in params:
            master = safe_get_full_fp32_param(p).view(getattr(p, "ds_shape", p.shape)).cpu()
            expected = stochastic_round(master, seed=SEED, step=STEPS, param=name)  # the CPU reference
            assert p.device.type == "cuda" and torch.equal(p.data.cpu().view(torch.int16), expected.view(torch.int16))


def test_on_cuda_zero2_with_cpu_optimizer_offload_rounds_on_the_host_into_deepspeeds_copy():
    pytest.importorskip("deepspeed")  # bench/gpu_check.sh installs it from .gpu-wheels/
    zero = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    _spawn(_deepspeed_worker, zero, {("cpu", "cpu", "cuda:0", "deepspeed")})


def test_on_cuda_zero3_with_cpu_optimizer_offload_rounds_on_the_host_and_copies_the_bits():
    pytest.importorskip("deepspeed")  # bench/gpu_check.sh installs it from .gpu-wheels/
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    _spawn(_deepspeed_worker, zero, {("cpu", "cpu", "cuda:0", "dist-sr")})


def test_on_cuda_zero3_with_parameter_offload_rounds_into_the_host_partitions():
    pytest.importorskip("deepspeed")  # bench/gpu_check.sh installs it from .gpu-wheels/
    zero = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    _spawn(_deepspeed_worker, zero, {("cpu", "cpu", "cpu", None)})


def _fsdp2_offload_worker():
    from dist_sr import stochastic_round
    from dist_sr.engines import fsdp2
    from tests.engines.models import forward_weights

    model = llama().cuda()
    ctx = fsdp2.apply_fsdp2(
        model, {"precision": "bf16-sr", "seed": SEED}, {"shard_modules": ["LlamaDecoderLayer"], "cpu_offload": True}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ctx.track(opt)
    for _ in range(STEPS):
        model(input_ids=ids(), labels=ids()).loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(fsdp2.plain(p.to_local()).device.type == "cpu" for p in model.parameters())  # masters on the host
    masters = fsdp2.full_master(model)
    used = forward_weights(model, ids())
    for name, w in used.items():
        expected = stochastic_round(masters[name].cpu(), seed=SEED, step=STEPS, param=name)
        assert w.device.type == "cuda" and torch.equal(w.cpu().view(torch.int16), expected.view(torch.int16)), name
    routes = ctx.rounder.routes()
    assert {(r.master, r.rounded_into, r.working, r.copied_by) for r in routes} == {("cpu", "cpu", "cuda:0", "dist-sr")}
    kept = [bits for bits, _ in (ctx.sent(n) for n in ctx.rounder.layouts)]
    assert all(b.is_pinned() for b in kept)  # so that the copy to the device does not wait


def test_on_cuda_fsdp2_cpu_offload_policy_moves_only_the_keyed_bits():
    _spawn(_fsdp2_offload_worker)


def _param_offload_worker(sr: bool, out: dict):
    """verl's param_offload on FSDP2: ``model.to("cpu", non_blocking=True)`` before rollouts,
    ``model.to(device, non_blocking=True)`` after (verl 0.9.1's own helpers' bodies)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from dist_sr import stochastic_round
    from dist_sr.engines import fsdp2
    from tests.engines.models import forward_weights

    model = llama().cuda()
    if sr:
        ctx = fsdp2.apply_fsdp2(model, {"precision": "bf16-sr", "seed": SEED}, {"shard_modules": ["LlamaDecoderLayer"]})
    else:
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if sr:
        ctx.track(opt)
    model(input_ids=ids(), labels=ids()).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    forward_weights(model, ids())  # the shards are rounded and kept
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.is_cuda]
    for t in state:  # verl's offload_fsdp_optimizer
        t.data = t.data.to("cpu")
    model.to("cpu", non_blocking=True)
    torch.cuda.synchronize()
    gc.collect()
    out["offloaded"] = torch.cuda.memory_allocated()
    model.to(torch.cuda.current_device(), non_blocking=True)
    for t in state:
        t.data = t.data.to("cuda")
    model(input_ids=ids(), labels=ids()).loss.backward()
    opt.step()
    opt.zero_grad()
    if sr:
        masters = fsdp2.full_master(model)
        for name, w in forward_weights(model, ids()).items():
            expected = stochastic_round(masters[name].cpu(), seed=SEED, step=2, param=name)
            assert torch.equal(w.cpu().view(torch.int16), expected.view(torch.int16)), name


def _param_offload_both():
    without, with_sr = {}, {}
    _param_offload_worker(False, without)
    _param_offload_worker(True, with_sr)
    # offloaded, the device holds what it holds without SR: no kept shard (4 MiB here), no old
    # master (8 MiB); the slack is for the allocator's small blocks
    assert with_sr["offloaded"] <= without["offloaded"] + (1 << 20), (with_sr, without)


def test_on_cuda_an_offloaded_sharded_model_leaves_no_device_memory_to_dist_sr():
    _spawn(_param_offload_both)


@pytest.mark.parametrize("row", list(DOCUMENTED))
def test_on_cuda_the_device_memory_sr_adds_is_within_the_documented_figure(row):
    import argparse

    from bench import memory

    if row.startswith("zero"):
        pytest.importorskip("deepspeed")
    sizes = {"hidden": 256, "layers": 2, "vocab": 1024, "batch": 2, "seq": 32}
    args = argparse.Namespace(device="cuda", rows=[row], timeout=600, **sizes)
    (got,) = memory.run(args).values()  # each variant in a process of its own
    rest, peak = DOCUMENTED[row]
    assert got["rest"] <= rest + SLACK and got["peak"] <= peak + SLACK, got
