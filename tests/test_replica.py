"""Replica digests, and data-parallel replicas on real gloo process groups staying bit-identical."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dist_sr import ReplicaChecker, ReplicaDivergenceError, apply_precision, check_replicas, weight_digests
from dist_sr.replica import tensor_digest
from tests.dist_utils import run_workers


def test_digest_sees_every_bit_and_ignores_wrappers():
    t = torch.randn(100).to(torch.bfloat16)
    u = t.clone()
    u.view(torch.int16)[57] ^= 1
    assert tensor_digest(t) == tensor_digest(t.clone()) != tensor_digest(u)
    assert tensor_digest(torch.zeros(4)) != tensor_digest(torch.zeros(2, 2))
    model = nn.Linear(3, 3)
    assert weight_digests([("module.weight", model.weight)]) == weight_digests([("weight", model.weight)])


def _ddp_worker(rank, world_size, precision, steps):
    torch.manual_seed(0)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    tp = apply_precision(model, {"precision": precision, "seed": 42}, torch.optim.AdamW, lr=1e-4)
    ddp = DDP(model)
    names = [(f"module.{n}", p) for n, p in model.named_parameters()]  # as DDP's state dict names them
    g = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    checker = ReplicaChecker(names, every=10)
    before = weight_digests(names)
    for step in range(1, steps + 1):
        x = torch.randn(16, 32, generator=g).to(torch.bfloat16)
        loss = ddp(x).float().pow(2).mean()
        tp.zero_grad()
        tp.backward(loss)
        tp.step()
        checker.maybe_check(step)
    digest = check_replicas(names)
    # the weights did move (every parameter), and every element is the keyed rounding of the
    # shadows (read back vs re-derived), the same on every rank
    assert tp.optimizer.step_count == steps
    after = weight_digests(names)
    assert all(after[n] != before[n] for n in before), [n for n in before if after[n] == before[n]]
    assert tp.digest() == tp.expected_digest()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, digest)
    assert len(set(gathered)) == 1

    # an injected corruption of one element on one rank is caught, and named, on every rank
    if rank == 1:
        with torch.no_grad():
            model[2].weight.view(torch.int16)[3, 5] ^= 1
    with pytest.raises(ReplicaDivergenceError) as info:
        check_replicas(names)
    assert info.value.params == ["2.weight"] and "ranks [1]" in str(info.value)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-sr", "bf16-dither", "bf16-pure-sr"])
def test_ddp_replicas_hold_identical_bits_after_many_steps(precision):
    run_workers(_ddp_worker, 2, precision, 60)
