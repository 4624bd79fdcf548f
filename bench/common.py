"""What every benchmark here shares: candidates timed side by side in one round-robin loop."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def round_robin(
    candidates: dict[str, Callable[[], object]], rounds: int, device: str = "cpu", warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call of each candidate. One call of each per round, in turn, so machine
    noise hits all alike; wall time between device synchronisations (host work included)."""
    for _ in range(warmup):
        for fn in candidates.values():
            fn()
    synchronize(device)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            synchronize(device)
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}
