"""One optimizer step on the 290 parameters of a Qwen2.5-0.5B-shaped model, every candidate side by side.

    python bench/optimizer_step.py                  # CPU: the same 290 tensors scaled to ~25M parameters
    python bench/optimizer_step.py --device cuda    # GPU: full size (494M parameters)

Rows: torch's fused AdamW on FP32 masters plus a ``torch._foreach_copy_`` RTN cast into the BF16
working weights (the baseline: what mixed precision costs today), torch's fused AdamW directly on
BF16 weights, and dist-sr's ShadowAdamW, ShadowOptimizer(torch.optim.AdamW, fused=True) and
pure-BF16 AdamWSR with FP32 or BF16 moments. Gradients arrive in the working dtype (BF16), except
the baseline's FP32 masters, whose FP32 gradients are given (as the issue's baseline defines it).

Time: median synchronised wall time of a step (host work included), all candidates in one
round-robin loop. Memory: peak bytes per parameter while one candidate steps alone (its weights,
gradients, optimizer state and temporaries): ``torch.cuda.max_memory_allocated`` on CUDA; on CPU
the process's peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs``) above
what it held before the candidate was built. On CUDA, host round trips per step are counted with
the profiler (``cudaStreamSynchronize``, ``cudaMemcpyAsync``) and checked with
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import round_robin, synchronize  # noqa: E402
from dist_sr import AdamWSR, ShadowAdamW, ShadowOptimizer  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS, KV = 896, 4864, 151936, 24, 128  # Qwen2.5-0.5B


def qwen05b_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The 290 trainable tensors of Qwen2.5-0.5B (tied embeddings), 494M parameters."""
    shapes = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.q_proj.bias", (HIDDEN,)),
            (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.k_proj.bias", (KV,)),
            (p + "self_attn.v_proj.weight", (KV, HIDDEN)),
            (p + "self_attn.v_proj.bias", (KV,)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    shapes.append(("model.norm.weight", (HIDDEN,)))
    return shapes


def scaled(shapes, target: int):
    """The same tensors with every dimension scaled so the total is about ``target``."""
    total = sum(math.prod(s) for _, s in shapes)
    f = math.sqrt(target / total)
    return [(n, tuple(max(1, round(d * f)) for d in s)) for n, s in shapes]


def make_params(shapes, device, dtype, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    params = []
    for name, shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, device=device, generator=g, dtype=dtype).mul_(0.02))
        p.grad = torch.randn(shape, device=device, generator=g, dtype=dtype).mul_(1e-3)
        params.append((name, p))
    return params


def candidates(shapes, device: str) -> dict:
    """name -> builder; a builder returns (step function, objects to keep alive)."""

    def baseline():
        masters = make_params(shapes, device, torch.float32)
        working = [p.detach().to(torch.bfloat16) for _, p in masters]
        opt = torch.optim.AdamW([p for _, p in masters], lr=1e-5, fused=True)
        ms = [p for _, p in masters]

        def step():
            opt.step()
            torch._foreach_copy_(working, ms)

        return step, (masters, working, opt)

    def torch_bf16():
        params = make_params(shapes, device, torch.bfloat16)
        opt = torch.optim.AdamW([p for _, p in params], lr=1e-5, fused=True)
        return opt.step, (params, opt)

    def shadow_adamw(mode="stochastic"):
        def build():
            params = make_params(shapes, device, torch.bfloat16)
            opt = ShadowAdamW(params, lr=1e-5, seed=1, mode=mode)
            return opt.step, (params, opt)

        return build

    def shadow_optimizer():
        params = make_params(shapes, device, torch.bfloat16)
        opt = ShadowOptimizer(params, torch.optim.AdamW, lr=1e-5, seed=1, fused=True, skip_nonfinite=False)
        return opt.step, (params, opt)

    def adamw_sr(moments):
        def build():
            params = make_params(shapes, device, torch.bfloat16)
            opt = AdamWSR(params, lr=1e-5, seed=1, moment_dtype=moments)
            return opt.step, (params, opt)

        return build

    return {
        "torch AdamW(fused) on FP32 masters + _foreach_copy_ RTN into BF16 (baseline)": baseline,
        "torch AdamW(fused) directly on BF16 params": torch_bf16,
        "ShadowAdamW": shadow_adamw(),
        "ShadowAdamW, nearest (RTN) for comparison": shadow_adamw("nearest"),
        "ShadowOptimizer(torch.optim.AdamW, fused=True, skip_nonfinite=False), SR": shadow_optimizer,
        "AdamWSR, FP32 moments": adamw_sr("fp32"),
        "AdamWSR, BF16 moments": adamw_sr("bf16"),
    }


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_bytes(build, device: str, n_params: int) -> float:
    """Peak bytes per parameter while this candidate alone takes a step (after two warm-up steps).
    On CPU call it in a fresh process: memory another candidate freed may stay resident."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_kib("VmRSS") * 1024
    step, keep = build()
    step()
    step()
    synchronize(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        step()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident size
        step()
        peak = _rss_kib("VmHWM") * 1024 - base
    del step, keep
    gc.collect()
    return peak / n_params


def host_round_trips(step) -> dict[str, int]:
    """Synchronisations, cudaMemcpyAsync calls and kernel launches in one step (profiler), less
    those of the measuring harness itself (the same profile around a no-op)."""
    own, harness = _profile_counts(step), _profile_counts(lambda: None)
    return {k: own[k] - harness[k] for k in own}


def _profile_counts(step) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    synchronize("cuda")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        synchronize("cuda")
    counts = {"syncs": 0, "memcpys": 0, "launches": 0}
    for e in prof.events():
        if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            counts["syncs"] += 1
        elif e.name == "cudaMemcpyAsync":
            counts["memcpys"] += 1
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            counts["launches"] += 1
    return counts


def sync_free(step) -> str:
    synchronize("cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return "yes"
    except RuntimeError as exc:
        return f"no ({str(exc).splitlines()[0][:60]})"
    finally:
        torch.cuda.set_sync_debug_mode("default")
        synchronize("cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--params", type=float, default=None, help="total parameters (default: 494M on CUDA, 25M on CPU)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--measure", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, default=Path("bench/results/optimizer_step.json"))
    args = ap.parse_args()
    dev = args.device
    shapes = qwen05b_shapes()
    target = args.params or (None if dev == "cuda" else 25e6)
    if target:
        shapes = scaled(shapes, int(target))
    n = sum(math.prod(s) for _, s in shapes)
    name = torch.cuda.get_device_name() if dev == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    if args.measure is None:
        print(
            f"# Optimizer step, {len(shapes)} tensors of a Qwen2.5-0.5B shape, {n / 1e6:.1f}M parameters: {name}, "
            f"torch {torch.__version__}\n"
        )
    builders = candidates(shapes, dev)
    if args.measure is not None:  # a child process measuring one CPU candidate
        warm = list(candidates(scaled(qwen05b_shapes(), 10**5), dev).values())[args.measure]
        step, keep = warm()  # libraries and code paths loaded before the baseline is read
        step()
        del step, keep
        print(peak_bytes(list(builders.values())[args.measure], dev, n))
        return
    if dev == "cuda":
        memory = {k: peak_bytes(b, dev, n) for k, b in builders.items()}
    else:
        # a fixed mmap threshold: freed tensors leave the resident set at once (glibc's adaptive
        # threshold would keep them in the heap, counted in the next peak)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 17)}
        memory = {
            k: float(
                subprocess.run(
                    [sys.executable, __file__, "--params", str(n), "--measure", str(i)],
                    check=True,
                    capture_output=True,
                    text=True,
                    env=env,
                ).stdout.split()[-1]
            )
            for i, k in enumerate(builders)
        }
    built = {k: b() for k, b in builders.items()}
    steps = {k: v[0] for k, v in built.items()}
    times = round_robin(steps, args.rounds, dev, warmup=2)
    extra = {}
    if dev == "cuda":
        extra = {k: {**host_round_trips(s), "sync_free": sync_free(s)} for k, s in steps.items()}
    base = times["torch AdamW(fused) on FP32 masters + _foreach_copy_ RTN into BF16 (baseline)"]
    bf16 = times["torch AdamW(fused) directly on BF16 params"]
    cols = "| step | ms | vs baseline | vs torch BF16 | peak B/param |"
    if dev == "cuda":
        cols += " syncs | memcpys | launches | sync-debug 'error' passes |"
    print(cols)
    print("|---" + "|---:" * (cols.count("|") - 2) + "|")
    for k, t in times.items():
        row = f"| {k} | {t * 1e3:.2f} | {t / base:.2f}x | {t / bf16:.2f}x | {memory[k]:.1f} |"
        if dev == "cuda":
            e = extra[k]
            row += f" {e['syncs']} | {e['memcpys']} | {e['launches']} | {e['sync_free']} |"
        print(row)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "device": name,
                "parameters": n,
                "tensors": len(shapes),
                "seconds": times,
                "peak_bytes_per_param": memory,
                "cuda": extra,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
