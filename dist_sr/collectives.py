"""The collectives the trainer's ranks agree by, in one place. Each takes the process group it
runs on (None: the default group) and is the identity in a process that runs alone (no process
group, or a world of one). Rank 0 of a group is named by its global rank, which is what
``torch.distributed``'s ``src`` means on a subgroup."""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def world(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def barrier(group=None) -> None:
    if world(group) > 1:
        dist.barrier(group=group)


def from_first(obj, group=None):
    """Rank 0's ``obj`` (picklable), on every rank of ``group``."""
    if world(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return box[0]


def all_true(ok: bool, group=None) -> bool:
    """Whether ``ok`` holds on every rank of ``group``."""
    if world(group) == 1:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def gathered(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if world(group) == 1:
        return [obj]
    out = [None] * world(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def summed(values: list[float], group=None, device=None) -> list[float]:
    """``values`` summed over the ranks of ``group`` (float64; ``device``: where the reduction
    runs, a CUDA device for nccl)."""
    if world(group) == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return t.tolist()


def posted(key: str, obj, timeout_s: float) -> list:
    """Every rank's ``obj`` (JSON-serialisable), in rank order, exchanged through the default
    group's rendezvous store rather than a collective: a rank that never posts under ``key`` (one
    that does not run this code) leaves None in its place after ``timeout_s``, where a collective
    would hang or pair with another call. ``key`` must name one exchange of the job."""
    import json
    from datetime import timedelta

    if world() == 1:
        return [obj]
    store = dist.distributed_c10d._get_default_store()
    me, n = rank(), world()
    store.set(f"{key}/{me}", json.dumps(obj))
    keys = [f"{key}/{r}" for r in range(n)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except dist.DistStoreError:  # timed out: which ranks never posted is asked key by key
        return [json.loads(store.get(k)) if store.check([k]) else None for k in keys]
    return [json.loads(v) for v in store.multi_get(keys)]  # one round trip, at any world size
