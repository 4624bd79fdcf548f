"""SR cast and optimizer-step cost, measured side by side in one run.

    python bench/rounding.py                 # 2^24 and 2^26 elements, markdown table
    python bench/rounding.py --sizes 20 22   # other sizes (log2)

Every row is timed in the same round-robin loop (one call of each candidate per round, median
over rounds), so machine noise hits all candidates alike; ratios are against the RTN cast
``out.copy_(x)`` into a preallocated BF16 buffer.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dist_sr import ShadowAdamW, ShadowOptimizer
from dist_sr.numerics.backends import cpu as cpu_kernel
from dist_sr.numerics.backends import reference
from dist_sr.numerics.key import stream_key


def median_times(candidates: dict, rounds: int) -> dict[str, float]:
    for fn in candidates.values():
        fn()  # warm-up (and kernel build)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def cast_candidates(n: int, with_reference: bool) -> dict:
    x = torch.randn(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    f32 = torch.empty(n)
    kernel = cpu_kernel.load()
    key = stream_key(seed=1, step=1, param="bench.weight")
    key_i64 = key - (1 << 64) if key >= 1 << 63 else key
    c = {
        "RTN cast out.copy_(x)": lambda: out.copy_(x),
        "FP32 copy (memcpy)": lambda: f32.copy_(x),
        "dist-sr SR, C++ kernel": lambda: kernel.round_tensor(x, out, True, key_i64, 0),
        "dist-sr nearest, C++ kernel": lambda: kernel.round_tensor(x, out, False, 0, 0),
    }
    if with_reference:
        c["dist-sr SR, torch reference"] = lambda: reference.round_into(x, out, key, 0)
    try:
        from torchao.optim.quant_utils import _fp32_to_bf16_sr

        c["torchao _fp32_to_bf16_sr (eager)"] = lambda: _fp32_to_bf16_sr(x)
    except ImportError:
        pass
    return c


def optimizer_candidates(n: int) -> dict:
    torch.manual_seed(0)
    fp32 = torch.nn.Parameter(torch.randn(n))
    fp32.grad = torch.randn(n) * 1e-3
    plain = torch.optim.AdamW([fp32], lr=1e-5, fused=True)
    work = torch.nn.Parameter(torch.randn(n).to(torch.bfloat16))
    work.grad = (torch.randn(n) * 1e-3).to(torch.bfloat16)
    shadow_sr = ShadowOptimizer(
        [("w", work)], torch.optim.AdamW, lr=1e-5, fused=True, mode="stochastic", skip_nonfinite=False
    )
    work_rtn = torch.nn.Parameter(work.detach().clone())
    work_rtn.grad = work.grad.clone()
    shadow_rtn = ShadowOptimizer(
        [("w", work_rtn)], torch.optim.AdamW, lr=1e-5, fused=True, mode="nearest", skip_nonfinite=False
    )
    work_fused = torch.nn.Parameter(work.detach().clone())
    work_fused.grad = work.grad.clone()
    fused_sr = ShadowAdamW([("w", work_fused)], lr=1e-5, mode="stochastic")
    return {
        "AdamW(fused) step, FP32 params": plain.step,
        "ShadowOptimizer AdamW(fused) + RTN": shadow_rtn.step,
        "ShadowOptimizer AdamW(fused) + SR": shadow_sr.step,
        "ShadowAdamW (one fused C++ pass, SR)": fused_sr.step,
    }


def table(title: str, results: dict[str, float], base: str, n: int) -> str:
    lines = [f"\n{title}", "", "| candidate | ms | GB/s (6 B/elem) | vs RTN cast |", "|---|---:|---:|---:|"]
    for name, t in results.items():
        lines.append(f"| {name} | {t * 1e3:.2f} | {6 * n / t / 1e9:.1f} | {t / results[base]:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[24, 26], help="log2 of the element counts")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--json", type=Path, default=Path("bench/results/rounding.json"))
    args = ap.parse_args()
    print(
        f"# dist-sr rounding benchmark: {platform.processor() or platform.machine()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    record = {"threads": torch.get_num_threads(), "torch": torch.__version__, "casts": {}, "optimizer": {}}
    for log2 in args.sizes:
        n = 1 << log2
        casts = median_times(
            cast_candidates(n, with_reference=log2 <= 24), args.rounds if log2 <= 24 else max(5, args.rounds // 2)
        )
        print(table(f"## SR cast, 2^{log2} elements", casts, "RTN cast out.copy_(x)", n))
        record["casts"][log2] = casts
        opt = median_times(optimizer_candidates(n), max(5, args.rounds // 2))
        base = "AdamW(fused) step, FP32 params"
        print(f"\n## optimizer step, 2^{log2} parameters\n\n| candidate | ms | vs AdamW step |\n|---|---:|---:|")
        for name, t in opt.items():
            print(f"| {name} | {t * 1e3:.1f} | {t / opt[base]:.2f}x |")
        record["optimizer"][log2] = opt
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
