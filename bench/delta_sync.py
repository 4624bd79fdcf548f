"""Bytes per weight sync, dense vs grid-step delta (``dist_sr.numerics.delta``), per precision, on
real GRPO steps of the quickstart model, and the codec's speed on one CPU core.

    .venv/bin/python bench/delta_sync.py                 # ~3 minutes on 2 CPU cores
    .venv/bin/python bench/delta_sync.py --steps 60 --large

For each precision (fp32, bf16, bf16-sr, bf16-dither, and bf16-offgrid: round-to-nearest from
FP32 shadows moved off the BF16 grid at start), GRPO runs ``--steps`` steps of
``configs/quickstart.yaml`` from its warm-up checkpoint. After every optimizer step the rollout
engine is handed the 16-bit weights a sync would send (the working weights; for fp32 the FP32
weights cast to BF16 round-to-nearest, what an engine serving BF16 gets), as one flat bucket,
and the bench codes that version against the previous one, applies the delta to a held copy
(checked bitwise against the sent version) and times both on one thread. ``--large`` adds
synthetic Adam-sized steps on the 11.5M-parameter shapes of ``configs/large.yaml``
(keyed SR vs round-to-nearest of the same FP32 shadows) and a 64M-element bucket for speed.

Dense bytes are the 16-bit bucket; the delta's are its wire form (``Delta.nbytes``), summed over
the steps; beside them, the bytes of the peers' (index, value) delta syncs (vLLM's ``sparse_nccl``,
verl's ``delta_sharded``: an int32 index and the 16-bit value per changed element, built by
``dist_sr.weightsync.trainer.sparse``) on the same versions. Ends with one line per precision:
``delta-sync: <precision>: dense <B> bytes, delta <B> bytes (1/<ratio>), encode <GB/s>, decode <GB/s>``
(rates in GB of BF16 per second). Results go to bench/results/delta_sync.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dist_sr.numerics import delta  # noqa: E402
from dist_sr.weightsync.trainer.sparse import SparseUnsupported, sparse_patch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = [
    ("fp32", "fp32", False),
    ("bf16", "bf16", False),
    ("bf16-sr", "bf16-sr", False),
    ("bf16-dither", "bf16-dither", False),
    ("bf16-offgrid", "bf16", True),
]


def _timed(fn, repeat: int, device: str = "cpu") -> float:
    """Median seconds of ``fn()`` on one thread (on a GPU: synchronised, the kernels' time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    try:
        times = []
        fn()  # warm-up (a GPU compiles the kernels here)
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)


class Meter:
    """Codes each version sent against the last one; sums bytes and times."""

    def __init__(self, repeat: int):
        self.repeat = repeat
        self.prev: torch.Tensor | None = None
        self.held: torch.Tensor | None = None
        self.dense = self.coded = self.changed = self.escapes = self.elements = self.pairs = 0
        self.encode_s = self.decode_s = 0.0
        self.layouts: dict[str, int] = {}

    def send(self, bucket: torch.Tensor) -> None:
        if self.prev is None:  # the first sync is dense
            self.prev, self.held = bucket.clone(), bucket.clone()
            return
        d = delta.encode(self.prev, bucket)
        self.encode_s += _timed(lambda: delta.encode(self.prev, bucket), self.repeat)
        work = self.held.clone()
        self.decode_s += _timed(lambda: delta.apply_(work.copy_(self.held), d), self.repeat)
        delta.apply_(self.held, delta.Delta.from_bytes(d.to_bytes()))
        if not torch.equal(self.held.view(torch.int16), bucket.view(torch.int16)):
            raise AssertionError("the delta did not reproduce the version sent")
        self.dense += 2 * bucket.numel()
        self.coded += d.nbytes
        try:  # what vLLM's sparse_nccl / verl's delta_sharded would send: int32 index + value per change
            self.pairs += sparse_patch("bucket", self.prev, bucket, (bucket.numel(),)).nbytes
        except SparseUnsupported:  # a NaN: the peers sync it dense
            self.pairs += 2 * bucket.numel()
        self.changed += d.changed
        self.escapes += d.escapes
        self.elements += bucket.numel()
        self.layouts[d.layout] = self.layouts.get(d.layout, 0) + 1
        self.prev.copy_(bucket)

    def row(self, name: str, source: str) -> dict:
        return {
            "precision": name,
            "source": source,
            "dense_bytes": self.dense,
            "delta_bytes": self.coded,
            "ratio": self.dense / max(self.coded, 1),
            "pairs_bytes": self.pairs,
            "pairs_ratio": self.dense / max(self.pairs, 1),
            "changed_frac": self.changed / max(self.elements, 1),
            "escape_frac": self.escapes / max(self.changed, 1),
            "layouts": self.layouts,
            "encode_gbs": self.dense / max(self.encode_s, 1e-12) / 1e9,
            "decode_gbs": self.dense / max(self.decode_s, 1e-12) / 1e9,
        }


def _bucket(model) -> torch.Tensor:
    """The 16-bit weights a sync sends, as one flat bucket."""
    parts = []
    for p in model.parameters():
        w = p.detach().reshape(-1)
        parts.append(w if w.element_size() == 2 else w.to(torch.bfloat16))
    return torch.cat(parts)


def grpo_rows(args) -> list[dict]:
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.trainer import train
    from dist_sr.rollout.embedded import EmbeddedEngine

    rows = []
    for name, precision, jitter in PRECISIONS:
        if args.precisions and name not in args.precisions:
            continue
        meter = Meter(args.repeat)

        class Capture(EmbeddedEngine):
            def sync_weights(self, version, verify=True):
                super().sync_weights(version, verify)
                meter.send(_bucket(self.model))

        with tempfile.TemporaryDirectory() as out:
            cfg = load_experiment(
                REPO / "configs" / "quickstart.yaml",
                {
                    "precision": precision,
                    "shadow_jitter": jitter,
                    "grpo.steps": args.steps,
                    "eval.every": 10**6,
                    "output_dir": out,
                    "checkpoint_every": 0,
                },
            )
            t0 = time.perf_counter()
            train(cfg, progress=False, make_engine=lambda model, tok: Capture(model, tok))
        row = meter.row(name, f"quickstart GRPO, {args.steps} steps")
        row["train_s"] = time.perf_counter() - t0
        rows.append(row)
        print(
            f"  {name}: changed/step {row['changed_frac']:.4f}, escapes {row['escape_frac']:.4f} of changes, "
            f"layouts {row['layouts']}",
            flush=True,
        )
    return rows


def large_rows(args) -> list[dict]:
    """Adam-sized steps on the large config's shapes: shadows ~ N(0, 0.02), each step moving every
    element by lr * N(0, 1) (Adam's normalised update), rounded keyed-SR and to nearest."""
    from dist_sr.numerics.rounding import stochastic_round
    from dist_sr.rl.config import load_experiment
    from dist_sr.rl.model import new_tiny

    cfg = load_experiment(REPO / "configs" / "large.yaml")
    model, _ = new_tiny(cfg.model)
    shapes = [(n, p.numel()) for n, p in model.named_parameters()]
    total = sum(k for _, k in shapes)
    g = torch.Generator().manual_seed(0)
    shadow = torch.randn(total, generator=g) * 0.02
    rows = []
    for name, mode in (("bf16-sr (synthetic)", "sr"), ("bf16 (synthetic)", "rtn")):
        meter = Meter(args.repeat)
        s = shadow.clone()
        for step in range(1, args.large_steps + 1):
            s += cfg.grpo.lr * torch.randn(total, generator=g)
            w = stochastic_round(s, seed=1, step=step, param="flat") if mode == "sr" else s.to(torch.bfloat16)
            meter.send(w)
        rows.append(meter.row(name, f"{total / 1e6:.1f}M params, lr {cfg.grpo.lr:g}, {args.large_steps} steps"))
    return rows


def speed_rows(args, device: str = "cpu", n: int = 1 << 26) -> list[dict]:
    """Encode/decode speed on a 64M-element bucket at SR's and RTN's change rates, beside memcpy
    (on ``cuda``: the Triton passes beside a device copy)."""
    g = torch.Generator().manual_seed(1)
    old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16).to(device)
    copy = torch.empty_like(old)
    memcpy = 2 * n / _timed(lambda: copy.copy_(old), 5, device) / 1e9
    rows = []
    for label, p in (("26% changed (SR)", 0.26), ("0.8% changed (RTN)", 0.008)):
        step = torch.where(torch.rand(n, generator=g) < 0.5, 1, -1) * (torch.rand(n, generator=g) < p)
        new = (old.view(torch.int16).to(torch.int32) + step.to(device)).to(torch.int16).view(torch.bfloat16)
        d = delta.encode(old, new)
        work = old.clone()
        enc = 2 * n / _timed(lambda: delta.encode(old, new), 5, device) / 1e9
        dec = 2 * n / _timed(lambda: delta.apply_(work, d), 5, device) / 1e9  # each run applies once more: same cost
        rows.append(
            {
                "case": label,
                "device": device,
                "elements": n,
                "ratio": 2 * n / d.nbytes,
                "encode_gbs": enc,
                "decode_gbs": dec,
                "memcpy_gbs": memcpy,
            }
        )
        print(
            f"  speed, {label}: 1/{2 * n / d.nbytes:.1f} of dense; encode {enc:.2f} GB/s, decode {dec:.2f} GB/s, "
            f"{'memcpy' if device == 'cpu' else 'device copy'} {memcpy:.2f} GB/s "
            f"({'one thread' if device == 'cpu' else torch.cuda.get_device_name()}; n = {n})",
            flush=True,
        )
    return rows


def _ratio(dense: int, sent: int) -> str:
    return f"1/{dense / sent:.1f}" if sent <= dense else f"{sent / dense:.2f}x"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="GRPO steps per precision (default 30)")
    ap.add_argument("--precisions", nargs="*", help="a subset of " + ", ".join(p for p, _, _ in PRECISIONS))
    ap.add_argument("--repeat", type=int, default=7, help="timing repeats per step (median)")
    ap.add_argument("--large", action="store_true", help="also the 11.5M-parameter synthetic steps and a speed run")
    ap.add_argument("--large-steps", type=int, default=5)
    ap.add_argument(
        "--device",
        default="cpu",
        help="cuda: only the codec's speed on the GPU (the Triton passes; encode includes moving the "
        "delta to the host, where the sync sends it)",
    )
    args = ap.parse_args(argv)
    if args.device != "cpu":
        rows = [r for bits in (26, 28) for r in speed_rows(args, args.device, 1 << bits)]
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"delta_sync_{args.device}.json").write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    from dist_sr.numerics.backends import cpu

    cpu.load_delta()  # the C++ codec (built once per environment); without it the torch reference runs
    print(f"delta-sync: real GRPO steps of configs/quickstart.yaml, {args.steps} per precision", flush=True)
    rows = grpo_rows(args)
    extra = {}
    if args.large:
        extra["large"] = large_rows(args)
        extra["speed"] = speed_rows(args)
        for r in extra["large"]:
            print(
                f"  {r['precision']}, {r['source']}: 1/{r['ratio']:.1f} of dense, changed/step "
                f"{r['changed_frac']:.4f}, escapes {r['escape_frac']:.4f} of changes; peers' pairs "
                f"{_ratio(r['dense_bytes'], r['pairs_bytes'])} of dense",
                flush=True,
            )
    for r in rows:  # the peers' (index, value) delta syncs on the same versions
        print(
            f"  peers' pairs, {r['precision']}: {r['pairs_bytes']} bytes ({_ratio(r['dense_bytes'], r['pairs_bytes'])} "
            f"of dense; the grid-step delta is {r['pairs_bytes'] / max(r['delta_bytes'], 1):.1f}x smaller)",
            flush=True,
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "delta_sync.json").write_text(json.dumps({"grpo": rows, **extra}, indent=1) + "\n")
    for r in rows:
        print(
            f"delta-sync: {r['precision']}: dense {r['dense_bytes']} bytes, delta {r['delta_bytes']} bytes "
            f"(1/{r['ratio']:.1f}), encode {r['encode_gbs']:.2f} GB/s, decode {r['decode_gbs']:.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
