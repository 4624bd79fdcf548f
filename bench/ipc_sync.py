"""Weight sync into a colocated engine: the ``ipc`` backend (CUDA IPC on a GPU, shared memory on a
host) against gloo and against one device copy of the same bytes, side by side in one run.

    .venv/bin/python bench/ipc_sync.py [--mb 256] [--repeats 5]

The trainer holds ``--mb`` MB of BF16 weights (on the GPU when there is one), a bare receiver
process (``dist_sr.weightsync.engine.cli``: receives and keeps, no model reload) on the same
machine takes them; each row is the median of ``--repeats`` whole syncs (plan, control calls,
every bucket; digests off, so the rows compare the transports), and its GB/s. ``device copy``
is ``torch``'s copy of the same bytes within one process on the same device: the bound a
colocated transfer can reach (the issue's target: ipc >= 0.8 of it on a GPU).
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import synchronize  # noqa: E402
from dist_sr.rollout.vllm.control import controls  # noqa: E402
from dist_sr.sources import ReplicatedSource  # noqa: E402
from dist_sr.testing.vllm_engines import free_port, start_receiver  # noqa: E402
from dist_sr.weightsync.trainer.sync import WeightSync  # noqa: E402


def device_copy(n_bytes: int, device: torch.device, repeats: int) -> float:
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(7)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        synchronize(device.type)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device.type)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def sync_times(model, backend: str, bucket_mb: float, repeats: int) -> float:
    proc, url = start_receiver()
    try:
        ws = WeightSync(
            ReplicatedSource(model),
            controls([url], 120),
            bucket_mb=bucket_mb,
            timeout_s=120,
            group_port=free_port(),
            backend=backend,
        )
        times = []
        for v in range(repeats + 1):  # the first builds the groups and touches the buffers
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            synchronize(next(model.parameters()).device.type)
            t0 = time.perf_counter()
            r = ws.sync(v, verify=False)
            times.append(time.perf_counter() - t0)
            assert r.ready == [url], r.problems
        return statistics.median(times[1:])
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=256.0, help="MB of BF16 weights")
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ.setdefault("DIST_SR_SYNC_SECRET", secrets.token_hex(32))
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    n = int(args.mb * 2**20) // 2
    rows = 8
    model = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(n // rows, dtype=torch.bfloat16, device=device)) for _ in range(rows)]
    )
    nbytes = sum(p.numel() * 2 for p in model.parameters())
    copy_s = device_copy(nbytes, device, args.repeats)
    results = [("device copy", copy_s)]
    for backend in ("ipc", "gloo"):
        results.append((f"sync {backend}", sync_times(model, backend, args.bucket_mb, args.repeats)))
    print(f"colocated sync, {nbytes / 1e6:.0f} MB of BF16 on {device}, buckets of {args.bucket_mb:g} MB")
    for name, s in results:
        print(f"  {name:<12} {s * 1e3:9.2f} ms  {nbytes / s / 1e9:7.2f} GB/s  ({copy_s / s:.2f}x of a device copy)")


if __name__ == "__main__":
    main()
