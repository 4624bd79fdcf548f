"""How a run's BF16 and FP16 products are computed on a CPU (``cpu_matmul``), timed side by side.

One forward and backward of a SmolLM2-135M-shaped Llama (random weights, built from its config)
on a batch of GRPO-like sequences, in one round-robin loop: the model in FP32; in BF16 and FP16
with torch's own kernels (``native``); and in BF16 and FP16 with ``fp32-accumulate`` (each product
an FP32 GEMM of the widened operands, rounded once: dist_sr/rl/cpu_math.py). On a CPU without
BF16/FP16 matrix units (no AVX512_BF16, AMX or AVX512_FP16) the native low-precision kernels take a
scalar fallback; with them, native is the one to use.

    python bench/cpu_matmul.py [--layers 30] [--batch 8] [--seq 48] [--threads 1] [--rounds 3]

Prints ``cpu_matmul: <dtype> <setting>: <seconds> s (<ratio>x FP32)`` per candidate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import round_robin  # noqa: E402

from dist_sr.rl.cpu_math import cpu_matmul  # noqa: E402


def smollm2_shape(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def step_of(model, ids: torch.Tensor, setting: str):
    def step() -> None:
        with cpu_matmul(setting):
            loss = model(ids).logits.float().logsumexp(-1).mean()
            loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = smollm2_shape(args.layers)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    candidates = {("float32", "native"): step_of(base, ids, "native")}
    for name in args.dtypes:
        low = smollm2_shape(args.layers).to(getattr(torch, name))
        for setting in ("native", "fp32-accumulate"):
            candidates[(name, setting)] = step_of(low, ids, setting)
    times = round_robin({f"{d} {s}": fn for (d, s), fn in candidates.items()}, args.rounds)
    fp32 = times["float32 native"]
    isa = torch.backends.cpu.get_cpu_capability()
    print(f"cpu_matmul: torch's kernels {isa}, {args.threads} thread(s), batch {args.batch}x{args.seq}")
    for label, seconds in times.items():
        print(f"cpu_matmul: {label}: {seconds:.2f} s ({seconds / fp32:.2f}x FP32)")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": None}, "seconds": times}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
