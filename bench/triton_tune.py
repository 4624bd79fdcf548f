"""Launch shapes of the Triton kernels, measured on this GPU: elements and warps per program.

    python bench/triton_tune.py                   # prints a table and the best choice
    python bench/triton_tune.py --env best.env    # also writes it as DIST_SR_TRITON_* variables

The bits never depend on the shape (the tests run every path at the default); only speed does.
Timed: the SR cast of one 2^28-element tensor and of the 290 tensors of a Qwen2.5-0.5B (494M
elements, one launch), and one fused ShadowAdamW-style step (FP32 shadow, BF16 gradient) over the
same 290 tensors; kernel time by CUDA events, median of rounds, against a device copy of the
same bytes.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.optimizer_step import qwen05b_shapes  # noqa: E402
from dist_sr.numerics.backends.triton import launcher as la  # noqa: E402
from dist_sr.numerics.backends.triton import sr_launch  # noqa: E402
from dist_sr.numerics.fused import AdamWHyper, AdamWPiece, AdamWPlan  # noqa: E402
from dist_sr.numerics.key import stream_keys  # noqa: E402


def kernel_ms(fn, rounds: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", type=Path, default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = qwen05b_shapes()
    ns = [math.prod(s) for _, s in shapes]
    names = [n for n, _ in shapes]
    n28 = 1 << 28
    x28 = torch.randn(n28, device="cuda")
    o28 = torch.empty(n28, dtype=torch.bfloat16, device="cuda")
    xs = [torch.randn(n, device="cuda") for n in ns]
    outs = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for n in ns]
    keys = stream_keys(names, seed=1, step=1)
    f32 = torch.empty(n28, device="cuda")
    copy_ms = kernel_ms(lambda: f32.copy_(x28))
    bw = 8 * n28 / copy_ms / 1e6  # GB/s
    print(f"# {torch.cuda.get_device_name()}: device copy {bw:.0f} GB/s (read + write)\n")
    print("| SR cast: elements x warps | 2^28, one tensor: ms | % of copy | 290 tensors (494M): ms | % of copy |")
    print("|---|---:|---:|---:|---:|")
    best_sr = None
    for block, warps in ((2048, 8), (4096, 8), (8192, 16)):
        la.SR_BLOCK, la.SR_WARPS = block, warps
        one = kernel_ms(lambda: sr_launch.round_one(x28, o28, int(keys[0]), 0))
        launch = sr_launch.SRLaunch(xs, outs, [0] * len(xs))
        many = kernel_ms(lambda: launch.with_keys(keys))
        pct_one, pct_many = 6 * n28 / one / 1e6 / bw, 6 * sum(ns) / many / 1e6 / bw
        print(f"| {block} x {warps} | {one:.3f} | {pct_one:.0%} | {many:.3f} | {pct_many:.0%} |")
        if best_sr is None or one + many < best_sr[0]:
            best_sr = (one + many, block, warps)
    x28 = o28 = f32 = None  # free the 2^28 buffers before the AdamW sweep
    shadows = xs
    m = [torch.zeros_like(x) for x in xs]
    v = [torch.zeros_like(x) for x in xs]
    grads = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in ns]
    hyper = [AdamWHyper(1e-5, 0.9, 0.999, 1e-8, 0.01, 1)]
    params16 = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in ns]
    m16 = [torch.zeros(n, device="cuda", dtype=torch.bfloat16) for n in ns]
    v16 = [torch.zeros(n, device="cuda", dtype=torch.bfloat16) for n in ns]
    print(
        "\n| fused AdamW+SR, 290 tensors: elements x warps | FP32 shadow: ms | GB/s (28 B/elem) | % of copy "
        "| pure BF16, BF16 moments: ms | GB/s (14 B/elem) | % of copy |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    best_adamw = None
    for block, warps in ((1024, 4), (2048, 8), (4096, 16)):
        la.ADAMW_BLOCK, la.ADAMW_WARPS = block, warps
        plan = AdamWPlan([AdamWPiece(nm, s, mm, vv, o) for nm, s, mm, vv, o in zip(names, shadows, m, v, outs)])
        pure = AdamWPlan([AdamWPiece(nm, p, mm, vv) for nm, p, mm, vv in zip(names, params16, m16, v16)])
        ms = kernel_ms(lambda: plan.step_(grads, hyper, [0] * len(ns), seed=1, step=1))
        ms16 = kernel_ms(lambda: pure.step_(grads, hyper, [0] * len(ns), seed=1, step=1))
        gbs, gbs16 = 28 * sum(ns) / ms / 1e6, 14 * sum(ns) / ms16 / 1e6
        print(
            f"| {block} x {warps} | {ms:.3f} | {gbs:.0f} | {gbs / bw:.0%} | "
            f"{ms16:.3f} | {gbs16:.0f} | {gbs16 / bw:.0%} |"
        )
        if best_adamw is None or ms + ms16 < best_adamw[0]:
            best_adamw = (ms + ms16, block, warps)
    env = (
        f"export DIST_SR_TRITON_SR_BLOCK={best_sr[1]} DIST_SR_TRITON_SR_WARPS={best_sr[2]} "
        f"DIST_SR_TRITON_ADAMW_BLOCK={best_adamw[1]} DIST_SR_TRITON_ADAMW_WARPS={best_adamw[2]}"
    )
    print(f"\nbest: {env}")
    if args.env:
        args.env.write_text(env + "\n")


if __name__ == "__main__":
    main()
