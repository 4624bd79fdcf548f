"""Host work of the GPU launch path, per call and per optimizer step, against torch's own.

    python bench/host_cost.py                   # no GPU needed: the host side alone (dry run)
    python bench/host_cost.py --device cuda     # GPU: real launches, back to back

On a GPU a rounding whose kernel takes less time than the host needs to launch it is bound by
the host, so the host's microseconds per call are what a small ``stochastic_round`` costs and
what a single synchronised call adds to a large one. Both modes time calls back to back (no
synchronisation between them) on tensors small enough that the device is never the limit.

- CPU (``--device cpu``, the default): ``dry_run()`` (``numerics/backends/triton/dry_run.py``)
  runs every line of the launch path on CPU tensors with the device launch itself replaced by a
  recording no-op: what remains is our Python, which is what this measures (Triton's C launcher
  and the driver call come on top on a GPU, as they do for every Triton kernel). torch's rows are
  its real CPU operators on one element, as a yardstick for one operator's dispatch on this machine.
- CUDA: everything real; the rows are comparable directly (ours vs ``out.copy_(x)`` and
  ``x.to(torch.bfloat16)``, the RTN cast a user would otherwise write).

Optimizer steps: the 290 tensors of a Qwen2.5-0.5B shape (bench/optimizer_step.py) shrunk to a
few elements each (the host work does not depend on the element count: tests/numerics/test_triton.py).
Every call derives its key afresh (a new step each call), as training does.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

if "--device" not in sys.argv or "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported: CPU tensors take the Triton path

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.optimizer_step import qwen05b_shapes, scaled  # noqa: E402
from dist_sr import AdamWSR, ShadowAdamW  # noqa: E402
from dist_sr.numerics import RoundingBatch, RoundingJob, stochastic_round  # noqa: E402
from dist_sr.numerics.backends.triton.dry_run import dry_run  # noqa: E402


def per_call_us(fn, calls: int, device: str, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean microseconds per call of ``calls`` back-to-back calls."""
    for _ in range(max(10, calls // 10)):
        fn()
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def rounding_rows(device: str, calls: int) -> dict[str, float]:
    n = 1024
    x = torch.randn(n, device=device)
    w = torch.randn(64, 16, device=device)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    one, one_out = torch.randn(1, device=device), torch.empty(1, dtype=torch.bfloat16, device=device)
    steps = itertools.count(1)
    backend = "triton"
    rows = {
        "dist-sr stochastic_round(x, out=out)": lambda: stochastic_round(
            x, seed=1, step=next(steps), param="w", out=out, backend=backend
        ),
        "dist-sr stochastic_round(x) (allocates out)": lambda: stochastic_round(
            x, seed=1, step=next(steps), param="w", backend=backend
        ),
        "dist-sr stochastic_round(2-D weight)": lambda: stochastic_round(
            w, seed=1, step=next(steps), param="w", backend=backend
        ),
        "dist-sr stochastic_round(x, mode='nearest', out=out)": lambda: stochastic_round(
            x, seed=1, step=1, param="w", mode="nearest", out=out, backend=backend
        ),
    }
    yardsticks = {
        "torch out.copy_(x) (RTN cast)": lambda: one_out.copy_(one),
        "torch x.to(torch.bfloat16) (RTN cast, allocates)": lambda: one.to(torch.bfloat16),
    }
    return {
        **{k: per_call_us(f, calls, device) for k, f in rows.items()},
        **{k: per_call_us(f, calls, device) for k, f in yardsticks.items()},
    }


def step_rows(device: str, steps: int) -> dict[str, float]:
    shapes = scaled(qwen05b_shapes(), 290 * 64)  # 290 tensors, a few dozen elements each
    rows = {}

    def params():
        g = torch.Generator(device=device).manual_seed(0)
        ps = []
        for name, shape in shapes:
            p = torch.nn.Parameter(torch.randn(shape, device=device, generator=g).to(torch.bfloat16))
            p.grad = torch.randn(shape, device=device, generator=g).to(torch.bfloat16)
            ps.append((name, p))
        return ps

    builds = {
        "ShadowAdamW.step (290 tensors)": lambda: ShadowAdamW(params(), lr=1e-5, seed=1, backend="triton"),
        "AdamWSR.step, FP32 moments (290 tensors)": lambda: AdamWSR(
            params(), lr=1e-5, seed=1, moment_dtype="fp32", backend="triton"
        ),
        "AdamWSR.step, BF16 moments (290 tensors)": lambda: AdamWSR(
            params(), lr=1e-5, seed=1, moment_dtype="bf16", backend="triton"
        ),
    }
    for name, build in builds.items():
        opt = build()
        rows[name] = per_call_us(opt.step, steps, device)
    # ShadowOptimizer's own part of a step (the inner torch optimizer's is torch's): the rounding
    jobs = [
        RoundingJob(n, torch.randn(s, device=device), torch.empty(s, dtype=torch.bfloat16, device=device))
        for n, s in shapes
    ]
    batch = RoundingBatch(jobs, backend="triton")
    counter = itertools.count(1)
    rows["RoundingBatch.run, ShadowOptimizer's rounding (290 tensors)"] = per_call_us(
        lambda: batch.run(seed=1, step=next(counter)), steps, device
    )
    if device == "cuda":
        ps = params()
        torch_opt = torch.optim.AdamW([p for _, p in ps], lr=1e-5, fused=True)
        rows["torch AdamW(fused) on the BF16 params (290 tensors)"] = per_call_us(torch_opt.step, steps, device)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    dev = args.device
    if dev == "cuda":
        what = f"{torch.cuda.get_device_name()}: real launches"
        ctx = None
    else:
        what = f"CPU, {torch.get_num_threads()} threads: launch path dry-run (device launch recorded, not run)"
        ctx = dry_run()
    print(f"# dist-sr host work per call: {what}; torch {torch.__version__}\n")
    if ctx is not None:
        ctx.__enter__()
    try:
        calls = rounding_rows(dev, args.calls)
        steps = step_rows(dev, args.steps)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    base = calls["torch out.copy_(x) (RTN cast)"]
    if dev == "cuda":
        print("| call (1024 elements; torch's on 1) | us per call | vs torch copy_ |\n|---|---:|---:|")
        for k, t in calls.items():
            print(f"| {k} | {t:.2f} | {t / base:.1f}x |")
    else:  # a CPU operator is not a CUDA one (no stream, no allocator, no launch): no ratio
        print("| call (1024 elements; torch's on 1, on this CPU) | us per call |\n|---|---:|")
        for k, t in calls.items():
            print(f"| {k} | {t:.2f} |")
    print("\n| optimizer step, host side | us per step | us per tensor |\n|---|---:|---:|")
    for k, t in steps.items():
        print(f"| {k} | {t:.0f} | {t / 290:.2f} |")


if __name__ == "__main__":
    main()
