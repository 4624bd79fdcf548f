"""Digests of working weights and the check that data-parallel replicas hold identical bits."""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .numerics.key import normalize_param_name


class ReplicaDivergenceError(RuntimeError):
    """Ranks hold different bits for some parameters; ``.params`` names them."""

    def __init__(self, params: list[str], detail: str):
        self.params = params
        super().__init__(detail)


def tensor_digest(t: torch.Tensor) -> str:
    """BLAKE2b-128 of a tensor's dtype, shape and raw bytes (row-major), as hex."""
    data = t.detach().contiguous().cpu()
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{data.dtype}|{tuple(data.shape)}|".encode())
    if data.numel():
        h.update(data.view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def named_tensors(model_or_tensors: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(model_or_tensors, nn.Module):
        return list(model_or_tensors.named_parameters())
    return list(model_or_tensors)


def weight_digests(model_or_tensors) -> dict[str, str]:
    """``{normalised name: digest}`` of the working weights."""
    return {normalize_param_name(n): tensor_digest(t) for n, t in named_tensors(model_or_tensors)}


def combined_digest(digests: dict[str, str]) -> str:
    """One digest over all parameters (sorted by name)."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(digests):
        h.update(f"{name}={digests[name]};".encode())
    return h.hexdigest()


def check_replicas(model_or_tensors, group: dist.ProcessGroup | None = None) -> str:
    """Compare working-weight digests across the ranks of ``group``; raise naming what differs.

    Collective: every rank of the group must call it. Returns the combined digest on success.
    """
    digests = weight_digests(model_or_tensors)
    world = dist.get_world_size(group)
    gathered: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(gathered, digests, group=group)
    reference = gathered[0]
    diverged: dict[str, list[int]] = {}
    for rank, other in enumerate(gathered):
        for name in sorted(set(reference) | set(other)):
            if reference.get(name) != other.get(name):
                diverged.setdefault(name, []).append(rank)
    if diverged:
        names = sorted(diverged)
        lines = ", ".join(f"{n} (ranks {diverged[n]} differ from rank 0)" for n in names[:10])
        more = f" and {len(names) - 10} more" if len(names) > 10 else ""
        raise ReplicaDivergenceError(names, f"replicas diverged in {len(names)} parameter(s): {lines}{more}")
    return combined_digest(digests)


class ReplicaChecker:
    """Calls ``check_replicas`` every ``every`` steps (0 disables)."""

    def __init__(self, model_or_tensors, every: int = 100, group: dist.ProcessGroup | None = None):
        if every < 0:
            raise ValueError(f"replica check interval must be >= 0, got {every}")
        self.target, self.every, self.group = model_or_tensors, every, group

    def maybe_check(self, step: int) -> str | None:
        if self.every and step % self.every == 0:
            return check_replicas(self.target, self.group)
        return None
