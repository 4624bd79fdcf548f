"""FSDP2's memory modes with keyed SR, on real FSDP2 over gloo: ``CPUOffloadPolicy`` (the shards
rounded on the host, their BF16 bits what moves to the device), the kept BF16 shards optional,
and no storage held by dist-sr across an offload of the masters (verl's ``param_offload`` moves
the sharded model with ``model.to(device, non_blocking=True)``; its own functions are driven in
``tests/peers/test_verl.py``). On this machine a ``meta`` device stands for the accelerator the
shards move to or from; the CUDA runs of the same paths are in ``bench/gpu_check.sh``."""

import gc
import types
import weakref

import pytest
import torch

from dist_sr import stochastic_round
from tests.dist_utils import run_workers
from tests.engines.models import forward_weights, tiny_qwen2

pytestmark = pytest.mark.slow
SEED, STEPS = 1234, 3


def build(**fsdp2_config):
    from dist_sr.engines import fsdp2

    model = tiny_qwen2()
    config = {"shard_modules": ["Qwen2DecoderLayer"], **fsdp2_config}
    ctx = fsdp2.apply_fsdp2(model, {"precision": "bf16-sr", "seed": SEED}, config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ctx.track(opt)
    return model, ctx, opt


def batch(step=0):
    return torch.randint(0, 3, (4, 9), generator=torch.Generator().manual_seed(7 + step))  # the same on every rank


def train(model, opt, steps):
    for step in range(steps):
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def fsdp_params(model):
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                yield from group.fsdp_params


def assert_keyed(model, step):
    from dist_sr.engines import fsdp2

    full = fsdp2.full_master(model)
    used = forward_weights(model, batch(99))
    assert set(used) == set(full)
    for name, w in used.items():
        expected = stochastic_round(full[name], seed=SEED, step=step, param=name)
        assert torch.equal(w.view(torch.int16), expected.view(torch.int16)), name
    return used


def _offload_worker(rank, world_size, keep_rounded):
    model, ctx, opt = build(cpu_offload=True, keep_rounded=keep_rounded)
    plain, _, plain_opt = build()
    assert all(fp.offload_to_cpu for fp in fsdp_params(model)) and not any(
        fp.offload_to_cpu for fp in fsdp_params(plain)
    )
    assert ctx.cache_rounded is keep_rounded
    train(model, opt, STEPS)
    train(plain, plain_opt, STEPS)
    used = assert_keyed(model, STEPS)
    # offloading changes where the masters live, not a bit of the working weights
    assert all(
        torch.equal(used[n].view(torch.int16), w.view(torch.int16)) for n, w in assert_keyed(plain, STEPS).items()
    )
    routes = ctx.rounder.routes()
    assert routes and all(r.master == r.rounded_into == r.working == "cpu" for r in routes)


@pytest.mark.parametrize("keep_rounded", [True, False], ids=["kept-shards", "rounded-per-gather"])
def test_cpu_offload_policy_trains_with_the_keyed_bits(keep_rounded):
    run_workers(_offload_worker, 2, keep_rounded)


def _moved_input_worker(rank, world_size):
    """FSDP2's own all-gather input of an offloaded shard, gathered on another device (meta here):
    the move carries the BF16 bits rounded on the host, never the FP32 master."""
    from dist_sr.engines.fsdp2.gather import MovedShard

    model, ctx, opt = build(cpu_offload=True)
    train(model, opt, 1)
    params = list(fsdp_params(model))
    for fp in params:
        fp.device = torch.device("meta")  # where FSDP2 gathers: an accelerator without data
    ctx.release()  # read the layouts again: gathered elsewhere now
    calls = []
    original = MovedShard.__torch_dispatch__.__func__

    def spy(cls, func, types_, args=(), kwargs=None):
        calls.append(func)
        return original(cls, func, types_, args, kwargs)

    MovedShard.__torch_dispatch__ = classmethod(spy)
    try:
        inputs = {fp._param_fqn: fp.all_gather_inputs for fp in params}  # FSDP2's property, as its all-gather reads it
    finally:
        MovedShard.__torch_dispatch__ = classmethod(original)
    assert calls and all(f is torch.ops.aten._to_copy.default for f in calls)  # only the cast to BF16
    for fp in params:
        (moved,) = inputs[fp._param_fqn]
        assert moved.device.type == "meta" and moved.dtype == torch.bfloat16
        assert moved.numel() == fp._sharded_param_data.numel()
    routes = ctx.rounder.routes()
    assert {(r.master, r.rounded_into, r.working, r.copied_by) for r in routes} == {("cpu", "cpu", "meta", "dist-sr")}
    # what was moved: the keyed rounding of each padded host shard
    for name, layout in ctx.rounder.layouts.items():
        bits, offset = ctx.sent(name)
        assert bits.device.type == "cpu" and offset == layout.offset
        if layout.rows is None:
            expected = stochastic_round(layout.source, seed=SEED, step=1, param=name, offset=offset)
            assert torch.equal(bits.view(torch.int16), expected.view(torch.int16)), name


def test_an_offloaded_shard_moves_to_the_device_as_its_bf16_bits():
    run_workers(_moved_input_worker, 2)


# -- no storage kept across an offload ------------------------------------------------------------


def storages_held(root) -> set[int]:
    """Addresses of every tensor storage reachable from ``root`` through dist-sr's own objects
    (modules and what they own are the framework's; weak references are not followed)."""
    seen, found, todo = set(), set(), [root]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, (torch.nn.Module, type, types.ModuleType, weakref.ReferenceType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
            continue
        if isinstance(obj, torch.Tensor):
            if type(obj) in (torch.Tensor, torch.nn.Parameter):
                if obj.device.type != "meta":
                    found.add(obj.untyped_storage().data_ptr())
            else:  # a wrapper subclass (an SR shadow): the tensors inside it
                todo += list(vars(obj).values())
            continue
        todo += gc.get_referents(obj)
    return found - {0}


def local_storages(model) -> set[int]:
    from dist_sr.engines.fsdp2 import plain

    return {plain(p.to_local()).untyped_storage().data_ptr() for p in model.parameters()} | {
        fp._sharded_param_data.untyped_storage().data_ptr()
        if type(fp._sharded_param_data) is torch.Tensor
        else fp._sharded_param_data._data.untyped_storage().data_ptr()
        for fp in fsdp_params(model)
    }


def _release_worker(rank, world_size):
    model, ctx, opt = build()
    train(model, opt, 1)
    assert_keyed(model, 1)  # a forward: the shards are rounded and kept
    before = storages_held(ctx)
    masters = local_storages(model)
    assert before & masters  # the scan sees the views dist-sr keeps while the shards stay put
    # verl 0.9.1's offload_fsdp2_model_to_cpu / load_fsdp2_model_to_gpu: model.to(device, non_blocking=True)
    model.to("meta", non_blocking=True)
    gc.collect()
    assert storages_held(ctx) == set()  # neither the old shards nor the kept BF16 copies


def test_moving_the_masters_to_another_device_leaves_dist_sr_holding_no_storage():
    run_workers(_release_worker, 2)


def _release_then_train_worker(rank, world_size):
    model, ctx, opt = build()
    train(model, opt, 1)
    assert_keyed(model, 1)
    ctx.release()
    assert storages_held(ctx) == set()
    train(model, opt, 1)  # the next all-gather reads the layouts again
    assert_keyed(model, 2)


def test_released_rounder_rounds_again_where_the_shards_are():
    run_workers(_release_then_train_worker, 2)
