"""A ZeRO-2 and an FSDP2 training step with round-to-nearest vs keyed SR, side by side; and
FSDP2 with FP32 masters (bf16-sr) vs pure BF16 shards (bf16-pure-sr): per-rank bytes and step.

    python bench/distributed.py                  # 2 ranks on gloo (CPU), tiny Llama
    python bench/distributed.py --world 2 --steps 12 --hidden 512

In each rank the variants of an engine are built from the same weights and stepped in
alternation (RTN, SR, RTN, SR, ...), each step between barriers, so load and noise hit them
alike; the tables show median step times and ratios. Bytes are counted from the tensors each
rank holds after a step (its parameter shards and its optimizer state).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import deepspeed_step, tiny_llama  # noqa: E402


def deepspeed_engine(model, sr: bool):
    return deepspeed_step(model, stage=2, sr=sr)


def fsdp2_step_fn(model, sr: bool):
    from torch.distributed.fsdp import fully_shard

    from dist_sr.engines import fsdp2

    ctx = fsdp2.prepare(model, seed=1) if sr else None
    for block in model.model.layers:
        fully_shard(block, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(model, mp_policy=fsdp2.MIXED_PRECISION)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    if ctx:
        ctx.track(opt)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def fsdp2_precision_step_fn(model, precision: dict):
    """FSDP2 under the precision switch (bf16-sr or bf16-pure-sr) and the optimizer it pairs with."""
    from dist_sr.engines import fsdp2

    ctx = fsdp2.apply_fsdp2(model, precision, {"shard_modules": ["LlamaDecoderLayer"]})
    if precision["precision"] == "bf16-pure-sr":
        opt = fsdp2.pure_bf16_optimizer(model, precision, lr=1e-5)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        ctx.track(opt)

    def step(ids):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def held_bytes() -> tuple[int, int]:
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        weights = sum(local(p).numel() * p.element_size() for p in model.parameters())
        state = sum(
            local(v).numel() * v.element_size()
            for st in opt.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        return weights, state

    return step, held_bytes


def worker(rank: int, world: int, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ids = torch.randint(0, 2048, (4, args.seq), generator=torch.Generator().manual_seed(rank))
    results = {}
    for engine_name, make in (("ZeRO-2", deepspeed_engine), ("FSDP2", fsdp2_step_fn)):
        steps = {
            "RTN": make(tiny_llama(args.hidden, args.layers), sr=False),
            "SR": make(tiny_llama(args.hidden, args.layers), sr=True),
        }
        times = {k: [] for k in steps}
        for i in range(args.steps + 2):
            for variant, step in steps.items():
                dist.barrier()
                t0 = time.perf_counter()
                step(ids)
                dist.barrier()
                if i >= 2:  # warm-up
                    times[variant].append(time.perf_counter() - t0)
        results[engine_name] = {k: statistics.median(v) for k, v in times.items()}
    variants = {
        "bf16-sr (FP32 masters)": {"precision": "bf16-sr", "seed": 1},
        "bf16-pure-sr, FP32 moments": {"precision": "bf16-pure-sr", "seed": 1},
        "bf16-pure-sr, BF16 moments": {"precision": "bf16-pure-sr", "seed": 1, "moment_dtype": "bf16"},
    }
    built = {
        name: fsdp2_precision_step_fn(tiny_llama(args.hidden, args.layers), prec) for name, prec in variants.items()
    }
    times = {k: [] for k in built}
    for i in range(args.steps + 2):
        for name, (step, _) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            step(ids)
            dist.barrier()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    pure = {name: {"step": statistics.median(times[name]), "bytes": built[name][1]()} for name in built}
    if rank == 0:
        n = sum(p.numel() for p in tiny_llama(args.hidden, args.layers).parameters())
        print(
            f"# distributed step, tiny Llama ({n / 1e6:.1f}M params), {world} ranks on gloo, "
            f"{torch.get_num_threads()} threads/rank, batch 4x{args.seq}/rank\n"
        )
        print("| engine | RTN step (ms) | SR step (ms) | SR / RTN |\n|---|---:|---:|---:|")
        for name, r in results.items():
            print(f"| {name} | {r['RTN'] * 1e3:.0f} | {r['SR'] * 1e3:.0f} | {r['SR'] / r['RTN']:.3f} |")
        base = pure["bf16-sr (FP32 masters)"]
        print(
            "\n| FSDP2 variant | weights bytes/rank | optimizer state bytes/rank | total vs bf16-sr | step (ms) "
            "| step vs bf16-sr |\n|---|---:|---:|---:|---:|---:|"
        )
        for name, r in pure.items():
            (w, st), (bw, bst) = r["bytes"], base["bytes"]
            print(
                f"| {name} | {w / 2**20:.2f} MiB | {st / 2**20:.2f} MiB | {(w + st) / (bw + bst):.2f}x | "
                f"{r['step'] * 1e3:.0f} | {r['step'] / base['step']:.3f} |"
            )
        results["FSDP2 precision"] = pure
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--port", type=int, default=29533)
    ap.add_argument("--json", default="bench/results/distributed.json")
    args = ap.parse_args()
    torch.multiprocessing.start_processes(worker, args=(args.world, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
