"""``dist-sr snapshot materialize`` with the C++ digest and delta kernels against the torch paths
it used before (the same bytes), side by side in one run.

    .venv/bin/python bench/materialize.py [--millions 16] [--deltas 5] [--repeats 3]

Writes a dense base and ``--deltas`` grid-step deltas of a BF16 model of ``--millions`` million
elements (keyed SR steps of Adam size, as a trainer with ``snapshot_deltas`` writes them), then
times ``materialize`` in fresh processes, once with the kernels and once with
``DIST_SR_DISABLE_CPU_KERNEL=1`` (the torch paths), ``--repeats`` times each (median), and
checks that both wrote the same files. The time is ``materialize``'s alone (imports and the
kernels' load excluded; a first build in a new environment is not timed). Ends with one line:
``materialize: <N>M elements, <D> deltas: torch <s> s, kernels <s> s (<ratio>x)``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dist_sr.numerics.rounding import stochastic_round  # noqa: E402
from dist_sr.sources import ReplicatedSource  # noqa: E402
from dist_sr.weightsync.disk.snapshot import Snapshots  # noqa: E402

_RUN = (
    "import sys, time\n"
    "from dist_sr.numerics.backends import cpu\n"
    "from dist_sr.weightsync.disk.materialize import materialize\n"
    "cpu.warm_up()\n"
    "t0 = time.perf_counter()\n"
    "m = materialize(sys.argv[1], sys.argv[2])\n"
    "print(time.perf_counter() - t0, m.version, cpu.loaded() is not None)\n"
)


def write_chain(root: Path, millions: float, deltas: int) -> None:
    torch.manual_seed(0)
    rows = 1024
    cols = int(millions * 2**20 / rows / 8)
    model = torch.nn.Sequential(*[torch.nn.Linear(cols, rows, bias=False) for _ in range(8)]).to(torch.bfloat16)
    shadows = {n: p.detach().float() for n, p in model.named_parameters()}
    snaps = Snapshots(root, deltas=True, bucket_mb=64)
    gen = torch.Generator().manual_seed(1)
    for v in range(deltas + 1):
        with torch.no_grad():
            for n, p in model.named_parameters():
                shadows[n] += 1e-3 * shadows[n].abs().mean() * torch.randn(p.shape, generator=gen)
                p.copy_(stochastic_round(shadows[n], seed=3, step=v, param=n))
        snaps.write(ReplicatedSource(model), v)


def tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--millions", type=float, default=16.0, help="model elements, in units of 2^20")
    ap.add_argument("--deltas", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dist-sr-materialize-") as tmp:
        root = Path(tmp) / "snapshots"
        write_chain(root, args.millions, args.deltas)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        times: dict[str, list[float]] = {"torch": [], "kernels": []}
        trees = {}
        for _ in range(args.repeats):
            for name, extra in (("torch", {"DIST_SR_DISABLE_CPU_KERNEL": "1"}), ("kernels", {})):
                out = Path(tmp) / name
                r = subprocess.run(
                    [sys.executable, "-c", _RUN, str(root), str(out)],
                    env={**env, **extra},
                    capture_output=True,
                    text=True,
                    check=True,
                )
                secs, version, kernel = r.stdout.split()
                assert int(version) == args.deltas and (kernel == "True") == (name == "kernels"), r.stdout
                times[name].append(float(secs))
                trees[name] = tree_digest(out)
        assert trees["torch"] == trees["kernels"], "the two paths wrote different files"
        t, k = statistics.median(times["torch"]), statistics.median(times["kernels"])
        for name, ts in times.items():
            print(f"{name:8s} " + " ".join(f"{x:.2f}" for x in ts) + " s")
        print(
            f"materialize: {args.millions:g}M elements, {args.deltas} deltas: torch {t:.2f} s, "
            f"kernels {k:.2f} s ({t / k:.1f}x); same files"
        )


if __name__ == "__main__":
    main()
