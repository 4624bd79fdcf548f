"""FSDP2's all-gather cast under SR (engines/fsdp2/gather.py): where each padded shard lies, what a
step costs the host (one rounding call, a dispatch per all-gather group, not per parameter), and
the casts it refuses."""

import pytest
import torch

from tests.dist_utils import run_workers
from tests.engines.models import tiny_qwen2

SEED = 1234


def _shard_worker(rank, world_size):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from dist_sr.numerics.shards import padded_shard

    mesh = init_device_mesh("cpu", (world_size,))
    # (shape, shard dim): uneven rows (rank 1 short, padded); a 3-D block on dim 1 (rows of 2*3
    # elements, 4*3 apart); a 3-D tensor whose leading dim is 1 (one contiguous span)
    for shape, dim in (((5, 3), 0), ((2, 4, 3), 1), ((1, 4, 3), 1), ((3, 8), 1)):
        index = torch.arange(torch.Size(shape).numel()).view(shape)
        p = distribute_tensor(index, mesh, [Shard(dim)], src_data_rank=None)
        offset, rows, padded = padded_shard(p)
        local = p.to_local()
        pad = [(0, 0)] * len(shape)
        pad[dim] = (0, padded[dim] - local.shape[dim])
        assert local.shape[dim] <= padded[dim] and all(
            a == b for i, (a, b) in enumerate(zip(local.shape, padded)) if i != dim
        )
        # the global index of every element of the padded shard, from (offset, rows)
        n = torch.Size(padded).numel()
        if rows is None:
            where = torch.arange(offset, offset + n)
        else:
            row_len, row_stride = rows
            where = (offset + torch.arange(n // row_len)[:, None] * row_stride + torch.arange(row_len)).reshape(-1)
        got = where.view(padded)[tuple(slice(0, k) for k in local.shape)]
        assert torch.equal(got, local), (shape, dim, rank)


@pytest.mark.slow
def test_a_padded_shard_lies_where_dtensor_puts_it_on_any_dim():
    run_workers(_shard_worker, 2)


def _build(layers, device="cpu"):
    from torch.distributed.fsdp import fully_shard

    from dist_sr.engines import fsdp2

    model = tiny_qwen2(layers=layers).to(device)
    ctx = fsdp2.prepare(model, seed=SEED)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mp_policy=fsdp2.MIXED_PRECISION)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ctx.track(opt)
    return model, ctx, opt


def _count_worker(rank, world_size, out):
    from dist_sr.engines.fsdp2 import gather, hook
    from dist_sr.numerics import rounding

    counts = {"dispatch": 0, "casts": 0, "batches": 0}
    original = hook.SRShadowParam.__torch_dispatch__.__func__
    cast, run = hook._cast, rounding.RoundingBatch.run

    def dispatch(cls, *args, **kwargs):
        counts["dispatch"] += 1
        return original(cls, *args, **kwargs)

    def counted_cast(*args):
        counts["casts"] += 1
        return cast(*args)

    def counted_run(self, **kwargs):
        counts["batches"] += 1
        return run(self, **kwargs)

    hook.SRShadowParam.__torch_dispatch__ = classmethod(dispatch)
    hook._cast, rounding.RoundingBatch.run = counted_cast, counted_run
    ids = torch.randint(0, 3, (2, 6), generator=torch.Generator().manual_seed(1))
    per_step = {}
    for layers in (2, 4):
        model, ctx, opt = _build(layers)
        for step in range(3):
            if step == 2:  # steady state: layouts read, batches built
                counts.update(dict.fromkeys(counts, 0))
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        per_step[layers] = dict(counts)
        assert isinstance(ctx.rounder, gather.ShardRounder) and len(ctx.rounder.layouts) == len(ctx.names)
    if rank == 0:
        out.put(per_step)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_step_rounds_once_and_dispatches_per_group_not_per_parameter(world_size):
    """The host work SR adds to an FSDP2 step: one rounding call for the whole model, whatever its
    size, and a dispatch per all-gather group (world > 1: FSDP2's foreach copy-in) or per gathered
    parameter (world 1: FSDP2's per-parameter cast, as torch's own policy pays it), plus the
    optimizer's foreach ops on the masters, whose count does not grow with the model. Two more
    layers (24 parameters: a Qwen2 layer has 12) add two groups, each gathered in forward and
    backward."""
    import torch.multiprocessing as mp

    out = mp.get_context("forkserver").SimpleQueue()
    run_workers(_count_worker, world_size, out)
    per_step = out.get()
    small, large = per_step[2], per_step[4]
    assert small["batches"] == large["batches"] == 1, per_step  # one rounding call per step
    grown = large["dispatch"] - small["dispatch"]
    if world_size == 1:  # a cast per gathered parameter, forward and backward
        assert large["casts"] - small["casts"] <= 2 * 2 * 12, per_step
    else:  # a cast per group: two more groups
        assert large["casts"] - small["casts"] <= 2 * 2, per_step
        assert grown <= 2 * 2, per_step
    assert grown <= large["casts"] - small["casts"], per_step  # the optimizer's ops do not grow with size


def test_a_lower_precision_copy_of_a_wrapped_master_is_refused_naming_it():
    from dist_sr.engines import fsdp2

    model = tiny_qwen2()
    fsdp2.prepare(model, seed=SEED)
    p = model.model.layers[0].mlp.up_proj.weight
    for cast in (
        lambda: p.to(torch.bfloat16),
        lambda: p.half(),
        lambda: torch.empty(p.shape, dtype=torch.bfloat16).copy_(p),
        lambda: torch._foreach_copy_([torch.empty(p.shape, dtype=torch.bfloat16)], [p]),
    ):
        with pytest.raises(TypeError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*round to nearest.*fsdp2\.plain"):
            cast()
    # exact casts and arithmetic see the FP32 master as it is
    assert torch.equal(p.to(torch.float64), fsdp2.plain(p).double())
    assert torch.equal((p * 2).detach(), fsdp2.plain(p) * 2)


def _cuda_worker(rank, port, steps):
    import os

    import torch.distributed as dist

    from dist_sr import stochastic_round
    from dist_sr.engines import fsdp2
    from dist_sr.engines.fsdp2.gather import ShardRounder
    from tests.engines.models import forward_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        model, ctx, opt = _build(2, "cuda")
        ids = torch.randint(0, 3, (4, 9), generator=torch.Generator().manual_seed(7)).cuda()

        def no_sync(method):  # dist-sr's part of the step: FSDP2's casts, the rounding
            def run(*args, **kwargs):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    return method(*args, **kwargs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")

            return run

        for step in range(steps):
            if step == 1:  # after the first step built the batch and read the layouts
                ShardRounder.into, ShardRounder.one = no_sync(ShardRounder.into), no_sync(ShardRounder.one)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        masters = {n: t.cpu() for n, t in fsdp2.full_master(model).items()}
        working = forward_weights(model, ids)
        assert set(working) == set(masters)
        for name, w in working.items():
            expected = stochastic_round(masters[name], seed=SEED, step=steps, param=name)  # the CPU reference
            assert w.dtype == torch.bfloat16 and torch.equal(w.cpu().view(torch.int16), expected.view(torch.int16)), (
                name
            )
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (FSDP2 on NCCL, world 1)")
def test_on_cuda_the_gathered_weights_are_the_cpu_references_bits_and_the_cast_never_syncs():
    import torch.multiprocessing as mp

    from dist_sr.net import free_port

    mp.spawn(_cuda_worker, args=(free_port(), 3), nprocs=1)
