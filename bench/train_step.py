"""One whole training step (forward, backward, optimizer) with and without SR, side by side, for
DeepSpeed ZeRO-2 and ZeRO-3 (the config's SR block on vs off) and FSDP2 (torch's own BF16
``MixedPrecisionPolicy`` vs dist-sr's keyed round-to-nearest vs bf16-sr, with and without its kept BF16
shards), on one device.

    python bench/train_step.py                               # CPU, world 1 on gloo (host cost)
    python bench/train_step.py --device cuda --hidden 1024 --layers 24   # ~300M params on a GPU
    python bench/train_step.py --device cuda --engines fsdp2              # one engine family
    torchrun --nproc-per-node 2 bench/train_step.py --engines fsdp2       # CPU, world 2: FSDP2's
                                                                          # foreach all-gather path

Each family's variants are built from the same weights and stepped in turn (A, B, C, A, B, C...),
synchronised around each step, so noise hits them alike; the table gives the median step, its
ratio to the family's baseline, and on CUDA, from one profiled step each, the kernel launches and
the host-device synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, blocking
copies) per step and the host time spent launching. On the CPU the step is host time: the SR
path's Python and dispatch overhead shows there at a size where the arithmetic is small. DeepSpeed
rows need DeepSpeed (``bench/gpu_check.sh`` installs it from ``.gpu-wheels/`` on a machine
without network: ``bash scripts/gpu_wheels.sh`` fills that folder here). Results go to
``bench/results/train_step-<device>.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import deepspeed_step, synchronize, tiny_llama  # noqa: E402

VOCAB = 8192


def model(args):
    return tiny_llama(args.hidden, args.layers, vocab=VOCAB, positions=1024, device=args.device, align=64)


def deepspeed_variant(stage: int, sr: bool, args):
    return deepspeed_step(model(args), stage=stage, sr=sr, batch=args.batch)


def fsdp2_step(variant: str, args):
    from torch.distributed.fsdp import fully_shard

    from dist_sr.engines import fsdp2

    net = model(args)
    ctx = None
    if variant != "torch bf16 MixedPrecisionPolicy":
        mode = "nearest" if variant == "dist-sr bf16 (keyed nearest)" else "stochastic"
        ctx = fsdp2.prepare(net, seed=1, mode=mode)
        ctx.cache_rounded = variant != "dist-sr bf16-sr, no kept shards"  # (each all-gather rounds again)
    for block in net.model.layers:
        fully_shard(block, mp_policy=fsdp2.MIXED_PRECISION)
    fully_shard(net, mp_policy=fsdp2.MIXED_PRECISION)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-5, foreach=True)
    if ctx is not None:
        ctx.track(opt)

    def step(ids):
        net(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


FAMILIES = {
    "zero2": (
        "DeepSpeed ZeRO-2",
        {"SR off": lambda a: deepspeed_variant(2, False, a), "SR on": lambda a: deepspeed_variant(2, True, a)},
    ),
    "zero3": (
        "DeepSpeed ZeRO-3",
        {"SR off": lambda a: deepspeed_variant(3, False, a), "SR on": lambda a: deepspeed_variant(3, True, a)},
    ),
    "fsdp2": (
        "FSDP2",
        {
            v: (lambda a, v=v: fsdp2_step(v, a))
            for v in (
                "torch bf16 MixedPrecisionPolicy",
                "dist-sr bf16 (keyed nearest)",
                "dist-sr bf16-sr",
                "dist-sr bf16-sr, no kept shards",
            )
        },
    ),
}


def profile_counts(step, ids) -> dict:
    """Kernel launches, host-device synchronisations and host launch time of one CUDA step."""
    from torch.profiler import ProfilerActivity, profile

    synchronize("cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(ids)
        synchronize("cuda")
    launches = syncs = 0
    host_us = 0.0
    for e in prof.events():
        name = e.name
        if name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            launches += 1
            host_us += e.cpu_time_total
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            syncs += 1
        elif name == "cudaMemcpyAsync" and "DtoH" in str(getattr(e, "input_shapes", "")):
            syncs += 1
    return {"launches": launches, "syncs": syncs, "launch_host_ms": host_us / 1e3}


def run(args) -> dict:
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)).to(args.device)
    out = {}
    for key in args.engines:
        title, variants = FAMILIES[key]
        if key.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
            print(
                f"# {title}: skipped (DeepSpeed is not installed: bash scripts/gpu_wheels.sh, then carry .gpu-wheels/)"
            )
            continue
        steps = {name: make(args) for name, make in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(args.steps + args.warmup):
            for name, step in steps.items():
                synchronize(args.device)
                t0 = time.perf_counter()
                step(ids)
                synchronize(args.device)
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        base = next(iter(med.values()))
        rows = {}
        for name, t in med.items():
            rows[name] = {"step_ms": t * 1e3, "ratio": t / base}
            if args.device == "cuda":
                rows[name].update(profile_counts(steps[name], ids))
        out[title] = rows
        del steps
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--engines", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--port", type=int, default=29541)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        results = run(args)
        world = dist.get_world_size()
    finally:
        dist.destroy_process_group()
    if int(os.environ["RANK"]):
        return 0
    n = sum(p.numel() for p in tiny_llama(args.hidden, args.layers, vocab=VOCAB, align=64, device="meta").parameters())
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    where += f", world {world}"
    print(f"# one training step, Llama-shaped model of {n / 1e6:.1f}M params, batch {args.batch}x{args.seq}, {where}\n")
    cuda = args.device == "cuda"
    head = "| engine | variant | step (ms) | vs first |" + (" launches | syncs | launch host (ms) |" if cuda else "")
    print(head + "\n|---|---|---:|---:|" + ("---:|---:|---:|" if cuda else ""))
    for title, rows in results.items():
        for name, r in rows.items():
            extra = f" {r['launches']} | {r['syncs']} | {r['launch_host_ms']:.1f} |" if cuda else ""
            print(f"| {title} | {name} | {r['step_ms']:.1f} | {r['ratio']:.3f} |{extra}")
    path = Path(args.json or f"bench/results/train_step-{args.device}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"params": n, "device": where, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
