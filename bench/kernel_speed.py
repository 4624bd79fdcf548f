"""Fast paths side by side: SR cast and fused AdamW+SR against torch baselines, CPU or CUDA.

    python bench/kernel_speed.py                      # CPU, 2^20 .. 2^26
    python bench/kernel_speed.py --sizes 20 24 28     # other sizes (log2)
    python bench/kernel_speed.py --device cuda        # GPU: Triton kernels, GB/s vs a D2D copy

Every candidate of a size is timed in the same round-robin loop (median over rounds); ratios
are against the RTN cast (casts) and against torch's fused AdamW (optimizer steps).
Bytes per element: SR cast 6 (4 read, 2 written); AdamW on FP32 params with FP32 grads 28
(p, g, m, v read; p, m, v written); fused AdamW+SR with BF16 grads 28 (s, m, v, g16 read;
s, m, v, w16 written).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import round_robin  # noqa: E402
from dist_sr.numerics.backends import cpu as cpu_kernel  # noqa: E402
from dist_sr.numerics.fused import AdamWHyper, AdamWPiece, AdamWPlan  # noqa: E402
from dist_sr.numerics.key import signed64, stream_key  # noqa: E402


def medians(candidates: dict, rounds: int, device: str) -> dict[str, float]:
    return round_robin(candidates, rounds, device)


def torch_ops_sr(x: torch.Tensor) -> torch.Tensor:
    """SR the way users write it in plain torch (torchao's recipe): random 16 bits, add, mask."""
    r = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device)
    return ((x.view(torch.int32) + r) & -65536).view(torch.float32).to(torch.bfloat16)


def cast_candidates(n: int, device: str) -> dict:
    x = torch.randn(n, device=device)
    out = torch.empty(n, dtype=torch.bfloat16, device=device)
    f32 = torch.empty(n, device=device)
    key = signed64(stream_key(seed=1, step=1, param="bench.weight"))
    c = {"RTN cast out.copy_(x)": lambda: out.copy_(x), "FP32 copy": lambda: f32.copy_(x)}
    if device == "cpu":
        kernel = cpu_kernel.load()
        c["dist-sr SR (C++)"] = lambda: kernel.round_tensor(x, out, True, key, 0)
    else:
        from dist_sr.numerics import stochastic_round

        # the public call, as users make it (a fresh key each call, as each training step derives one)
        steps = itertools.count(1)
        c["dist-sr SR (Triton)"] = lambda: stochastic_round(x, seed=1, step=next(steps), param="bench.weight", out=out)
        c["SR in torch ops (randint + mask)"] = lambda: torch_ops_sr(x)
    try:
        from torchao.optim.quant_utils import _fp32_to_bf16_sr

        if n <= 1 << 24 or device == "cuda":  # its eager CPU path is ~100x a cast: sample it at small sizes
            c["torchao _fp32_to_bf16_sr"] = lambda: _fp32_to_bf16_sr(x)
    except ImportError:
        pass
    return c


def back_to_back_ms(fn, calls: int = 20) -> float:
    """CUDA: milliseconds per call of ``calls`` calls made back to back (CUDA events around them):
    the device's throughput, with each call's host work overlapping the previous kernels."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def optimizer_candidates(n: int, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    param = torch.nn.Parameter(torch.randn(n, device=device, generator=g))
    param.grad = torch.randn(n, device=device, generator=g) * 1e-3
    torch_fused = torch.optim.AdamW([param], lr=1e-5, fused=True)
    shadow = torch.nn.Parameter(torch.randn(n, device=device, generator=g))
    shadow.grad = param.grad.clone()
    shadow_opt = torch.optim.AdamW([shadow], lr=1e-5, fused=True)
    working = torch.empty(n, dtype=torch.bfloat16, device=device)

    def torch_then_sr():
        from dist_sr.numerics import stochastic_round

        shadow_opt.step()
        stochastic_round(shadow.data, seed=1, step=1, param="bench.weight", out=working)

    s, m, v = (torch.randn(n, device=device, generator=g) for _ in range(3))
    v.abs_()
    g16 = param.grad.to(torch.bfloat16)
    h = AdamWHyper(1e-5, 0.9, 0.999, 1e-8, 0.01, 10)
    plan = AdamWPlan([AdamWPiece("w", s, m, v, working)])
    fused = lambda grad: plan.step_([grad], [h], seed=1, step=1)  # noqa: E731
    return {
        "torch AdamW(fused=True), FP32 params+grads": torch_fused.step,
        "torch AdamW(fused=True) + separate SR pass": torch_then_sr,
        "dist-sr fused AdamW+SR, BF16 grads": lambda: fused(g16),
        "dist-sr fused AdamW+SR, FP32 grads": lambda: fused(param.grad),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22, 24, 26])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", type=Path, default=Path("bench/results/kernels.json"))
    args = ap.parse_args()
    dev = args.device
    name = torch.cuda.get_device_name() if dev == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"# dist-sr kernels benchmark: {name}, torch {torch.__version__}")
    record: dict = {"device": name, "sizes": {}}
    for log2 in args.sizes:
        n = 1 << log2
        casts = medians(cast_candidates(n, dev), args.rounds, dev)
        base = casts["RTN cast out.copy_(x)"]
        print(f"\n## 2^{log2} elements: casts\n\n| candidate | ms | GB/s | vs RTN cast |\n|---|---:|---:|---:|")
        copy_bw = 8 * n / casts["FP32 copy"]
        for k, t in casts.items():
            nbytes = 8 * n if k == "FP32 copy" else 6 * n
            print(f"| {k} | {t * 1e3:.3f} | {nbytes / t / 1e9:.1f} | {t / base:.2f}x |")
        if dev == "cuda":
            sr = casts["dist-sr SR (Triton)"]
            print(
                f"\nSR cast bandwidth, one synchronised call: {6 * n / sr / 1e9:.0f} GB/s = "
                f"{6 * n / sr / copy_bw:.0%} of the measured copy"
            )
            cands = cast_candidates(n, dev)
            b2b = {k: back_to_back_ms(cands[k]) for k in ("FP32 copy", "RTN cast out.copy_(x)", "dist-sr SR (Triton)")}
            sr_b, copy_b = 6 * n / b2b["dist-sr SR (Triton)"] / 1e6, 8 * n / b2b["FP32 copy"] / 1e6
            print(
                f"SR cast bandwidth, 20 calls back to back (CUDA events): {sr_b:.0f} GB/s = {sr_b / copy_b:.0%} "
                f"of the copy's {copy_b:.0f} GB/s (RTN cast {6 * n / b2b['RTN cast out.copy_(x)'] / 1e6:.0f} GB/s)"
            )
            casts.update({f"{k}, back to back": t / 1e3 for k, t in b2b.items()})
        opt = medians(optimizer_candidates(n, dev), max(3, args.rounds // 2), dev)
        obase = opt["torch AdamW(fused=True), FP32 params+grads"]
        print(
            f"\n## 2^{log2} parameters: optimizer step\n\n"
            "| candidate | ms | GB/s (28 B/elem) | vs torch fused AdamW |\n"
            "|---|---:|---:|---:|"
        )
        for k, t in opt.items():
            print(f"| {k} | {t * 1e3:.2f} | {28 * n / t / 1e9:.1f} | {t / obase:.2f}x |")
        record["sizes"][log2] = {"casts": casts, "optimizer": opt}
        del casts, opt
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
