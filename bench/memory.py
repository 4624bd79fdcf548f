"""What dist-sr adds in memory, per parameter, in every memory mode users run: each engine and mode
built twice from the same weights, without SR and with it, and the difference of what the
allocator holds, divided by the parameters the rank holds (world 1: all of them).

    python bench/memory.py                          # CPU: every row (host memory, torch's allocator)
    python bench/memory.py --device cuda            # one GPU (bench/gpu_check.sh): device memory
    python bench/memory.py --rows zero2 fsdp2       # some rows

One line per row (then a markdown table, and ``--json``):

    memory: <engine> <mode>: +N bytes/param at rest, +M at peak (noise E over R runs of each)

*At rest*: between steps (after two optimizer steps, before the next forward), when an RL
framework hands the memory to its rollout engine. *At peak*: the larger of the peak during one
training step (forward, backward, optimizer step) and the peak during one export of every working
weight (``dist_sr.rollout_weights``, each tensor dropped before the next, as a sender that streams
does). Each is ``(with SR) - (without SR)`` of the same engine, built and stepped the same way,
each variant in a fresh process (what a process allocates once, DeepSpeed's and gloo's buffers or
CUDA's workspaces, then counts in both alike).

Measured on CPU from torch's own CPU allocator: every allocation and free it makes (the
profiler's memory events, nanosecond-ordered), summed into live bytes over the run, so Python
objects and allocator caching do not count, and nothing torch allocates escapes (a traced Python
allocation counter would see none of it). On CUDA: ``torch.cuda.memory_allocated`` and
``max_memory_allocated`` (device memory only: with offload the host side is not counted there).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import synchronize, tiny_llama  # noqa: E402

SEED = 1234
PHASES = ("warm", "step", "export")


# -- what the allocator holds ------------------------------------------------------------------------


class CpuAllocations:
    """Live bytes of torch's CPU allocator over a profiled run, with named phases."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self):
        self._prof.__enter__()
        return self

    def __exit__(self, *exc):
        self._prof.__exit__(*exc)
        events = self._prof.profiler.kineto_results.events()
        self._memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
        self._phases = {e.name()[6:]: (e.start_ns(), e.end_ns()) for e in events if e.name().startswith("phase:")}

    def phase(self, name: str):
        from torch.profiler import record_function

        return record_function(f"phase:{name}")

    def results(self) -> dict[str, float]:
        """``rest``: live bytes at the end of the warm-up steps; ``<phase>``: the most live bytes
        during that phase (both counted from the start of the run)."""
        out, live, peaks = {}, 0, dict.fromkeys(PHASES[1:], 0)
        ends = {name: span[1] for name, span in self._phases.items()}
        rest_at, taken = ends["warm"], False
        for t, nbytes in self._memory:
            if not taken and t > rest_at:
                out["rest"], taken = live, True
            live += nbytes
            for name in peaks:
                start, end = self._phases[name]
                if start <= t <= end:
                    peaks[name] = max(peaks[name], live)
        out.setdefault("rest", live)
        for name in peaks:  # a phase that allocated nothing peaks where it started
            start = self._phases[name][0]
            before = sum(n for t, n in self._memory if t < start)
            out[name] = max(peaks[name], before)
        return out


class CudaAllocations:
    """Live bytes of the CUDA caching allocator (``memory_allocated``), with named phases."""

    def __enter__(self):
        synchronize("cuda")
        self._base = torch.cuda.memory_allocated()
        self._out: dict[str, float] = {}
        return self

    def __exit__(self, *exc):
        pass

    @contextlib.contextmanager
    def phase(self, name: str):
        synchronize("cuda")
        torch.cuda.reset_peak_memory_stats()
        yield
        synchronize("cuda")
        if name == "warm":
            self._out["rest"] = torch.cuda.memory_allocated() - self._base
        else:
            self._out[name] = torch.cuda.max_memory_allocated() - self._base

    def results(self) -> dict[str, float]:
        return self._out


# -- the rows: one engine and memory mode, built with SR off and on -----------------------------------


@dataclass
class Built:
    step: Callable[[torch.Tensor], None]
    export: Callable[[], None]
    params: int  # parameters this rank holds the masters of


def _export(obj) -> Callable[[], None]:
    from dist_sr import rollout_weights

    def run():
        for _, tensor in rollout_weights(obj):
            del tensor

    return run


def deepspeed_row(zero: dict):
    def build(sr: bool, args) -> Built:
        from dist_sr.engines import deepspeed as dsr

        model = tiny_llama(args.hidden, args.layers, vocab=args.vocab)
        n = sum(p.numel() for p in model.parameters())
        # DeepSpeed's buckets default to 5e8 elements, sized for models far larger than this one:
        # scaled to the model, they stop drowning what SR adds (and behave as at the sizes users run)
        bucket = max(1 << 16, n // 8)
        buckets = {"reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
        if zero.get("stage") == 3:
            buckets.update(stage3_prefetch_bucket_size=bucket, stage3_max_live_parameters=n)
        config = {
            "train_micro_batch_size_per_gpu": args.batch,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**6,
            "bf16": {"enabled": True},
            "zero_optimization": {**zero, **buckets},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
        }
        if sr:
            config["stochastic_rounding"] = {"enabled": True, "seed": SEED, "mode": "stochastic"}
        engine, *_ = dsr.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(ids):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

        return Built(step, _export(engine), n // dist.get_world_size())

    return build


def fsdp2_row(**fsdp2_config):
    def build(sr: bool, args) -> Built:
        from dist_sr.engines import fsdp2

        model = tiny_llama(args.hidden, args.layers, vocab=args.vocab, device=args.device)
        n = sum(p.numel() for p in model.parameters())
        config = {"shard_modules": ["LlamaDecoderLayer"], **fsdp2_config}
        if sr:
            ctx = fsdp2.apply_fsdp2(model, {"precision": "bf16-sr", "seed": SEED}, config)
        else:  # the same FSDP2 with torch's own BF16 cast (FP32 masters, BF16 all-gather)
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            kwargs: dict = {"mp_policy": policy}
            if config.get("cpu_offload"):
                kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=args.device == "cuda")
            for block in model.model.layers:
                fully_shard(block, **kwargs)
            fully_shard(model, **kwargs)
            ctx = None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
        if ctx is not None:
            ctx.track(opt)

        def step(ids):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return Built(step, _export(model), n // dist.get_world_size())

    return build


def single_row(build_precision: Callable[[bool], object]):
    def build(sr: bool, args) -> Built:
        from dist_sr.precision import apply_precision

        model = tiny_llama(args.hidden, args.layers, vocab=args.vocab, device=args.device)
        n = sum(p.numel() for p in model.parameters())
        precision, optimizer = build_precision(sr)
        if precision is None:  # plain torch: BF16 parameters, AdamW on them
            model.to(torch.bfloat16)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

            def step(ids):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

        else:
            trainer = apply_precision(model, precision, optimizer, lr=1e-5)

            def step(ids):
                trainer.backward(model(input_ids=ids, labels=ids).loss)
                trainer.step()
                trainer.zero_grad()

        return Built(step, _export(model), n)

    return build


def _single(sr: bool):
    return ({"precision": "bf16-sr", "seed": SEED} if sr else "bf16"), torch.optim.AdamW


def _pure(sr: bool):
    from dist_sr.optim import AdamWSR

    if not sr:
        return None, None
    return {"precision": "bf16-pure-sr", "seed": SEED, "moment_dtype": "bf16"}, AdamWSR


ROWS: dict[str, tuple[str, str, Callable]] = {
    "single": ("single", "bf16-sr (FP32 shadows) vs bf16 (shadows, nearest)", single_row(_single)),
    "pure-bf16": ("single", "bf16-pure-sr, BF16 moments vs torch AdamW on BF16 params", single_row(_pure)),
    "zero1": ("deepspeed", "ZeRO-1", deepspeed_row({"stage": 1})),
    "zero2": ("deepspeed", "ZeRO-2", deepspeed_row({"stage": 2})),
    "zero3": ("deepspeed", "ZeRO-3", deepspeed_row({"stage": 3})),
    "zero2-offload": (
        "deepspeed",
        "ZeRO-2 + offload_optimizer",
        deepspeed_row({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    ),
    "zero3-offload": (
        "deepspeed",
        "ZeRO-3 + offload_param + offload_optimizer",
        deepspeed_row(
            {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}, "offload_optimizer": {"device": "cpu"}}
        ),
    ),
    "fsdp2": ("fsdp2", "bf16-sr, kept BF16 shards", fsdp2_row()),
    "fsdp2-unkept": ("fsdp2", "bf16-sr, rounded per all-gather", fsdp2_row(keep_rounded=False)),
    "fsdp2-offload": ("fsdp2", "bf16-sr + CPUOffloadPolicy", fsdp2_row(cpu_offload=True)),
}


def measure(build: Callable, sr: bool, args) -> tuple[dict[str, float], int]:
    """Live allocator bytes of one variant at rest and at its phases' peaks (in this process,
    whose process group is set up), and the parameters the rank holds."""
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    gc.collect()
    tracker = CudaAllocations() if args.device == "cuda" else CpuAllocations()
    with tracker:
        with tracker.phase("warm"):
            built = build(sr, args)
            for _ in range(2):
                built.step(ids)
        with tracker.phase("step"):
            built.step(ids)
        with tracker.phase("export"):
            built.export()
    params = built.params
    del built
    gc.collect()
    return tracker.results(), params


SIZES = ("hidden", "layers", "vocab", "batch", "seq")


def measure_fresh(key: str, sr: bool, args) -> tuple[dict[str, float], int]:
    """``measure`` of row ``key`` in a process of its own, so that what a process allocates once
    (DeepSpeed's and gloo's buffers, CUDA's workspaces) counts in both variants alike."""
    from dist_sr.net import free_port

    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", key, "--sr", str(int(sr))]
    cmd += ["--device", args.device, "--port", str(free_port())]
    for name in SIZES:
        cmd += [f"--{name}", str(getattr(args, name))]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in r.stdout.splitlines() if line.startswith("measured: ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"{key} (SR {'on' if sr else 'off'}) failed: {r.stderr[-3000:]}")
    got = json.loads(lines[-1].removeprefix("measured: "))
    return got["bytes"], got["params"]


def run(args) -> dict:
    out = {}
    for key in args.rows:
        engine, mode, _ = ROWS[key]
        offs, ons = [], []
        for _ in range(getattr(args, "repeat", 1)):  # the variants alternately, each in a fresh process
            (off, params), (on, _) = measure_fresh(key, False, args), measure_fresh(key, True, args)
            offs.append(off)
            ons.append(on)
        median = {k: statistics.median(on[k] for on in ons) - statistics.median(off[k] for off in offs) for k in off}
        per = {k: v / params for k, v in median.items()}
        row = {
            "engine": engine,
            "mode": mode,
            "params": params,
            "rest": per["rest"],
            "step_peak": per["step"],
            "export_peak": per["export"],
            "peak": max(per["step"], per["export"]),
            "without_sr": {k: v / params for k, v in offs[0].items()},
            # how much a variant moves between fresh runs of itself, the larger of the two (0 with one run)
            "noise": max(max(r[k] for r in runs) - min(r[k] for r in runs) for runs in (offs, ons) for k in off)
            / params,
        }
        out[key] = row
        print(
            f"memory: {engine} {mode}: {row['rest']:+.3f} bytes/param at rest, {row['peak']:+.3f} at peak "
            f"(noise {row['noise']:.3f} over {len(offs)} runs of each)",
            flush=True,
        )
    return out


def table(rows: dict, device: str) -> str:
    lines = [
        f"| engine | mode | at rest | peak of a step | peak of an export | noise |  ({device}, bytes per parameter)",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in rows.values():
        lines.append(
            f"| {row['engine']} | {row['mode']} | {row['rest']:+.2f} | {row['step_peak']:+.2f} | "
            f"{row['export_peak']:+.2f} | {row['noise']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    ap.add_argument("--hidden", type=int, default=512)  # ~34M parameters: the engines' own buffers no longer
    ap.add_argument("--layers", type=int, default=8)  # drown what SR adds (noise < 0.5 bytes/param)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="runs of each variant (medians; the spread of the runs without SR is the row's noise)",
    )
    ap.add_argument("--timeout", type=int, default=600, help="seconds for one variant's process")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--measure", choices=list(ROWS), help=argparse.SUPPRESS)  # one variant, in this process
    ap.add_argument("--sr", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29517, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure is None:
        rows = run(args)
        print(table(rows, args.device))
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            settings = {k: v for k, v in vars(args).items() if k in (*SIZES, "device", "rows")}
            args.json.write_text(json.dumps({"device": args.device, "args": settings, "rows": rows}, indent=1))
        return 0
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ[k] = v
    if args.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        results, params = measure(ROWS[args.measure][2], bool(args.sr), args)
        print("measured: " + json.dumps({"bytes": results, "params": params}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
