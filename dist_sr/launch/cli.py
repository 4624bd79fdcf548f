"""``dist-sr``: train, compare, inspect rounding keys.

dist-sr compare [CONFIG]             precision comparison (embedded default without CONFIG)
dist-sr train [CONFIG] [--set k=v]   one GRPO run (embedded default without CONFIG); the options
                                     and checks of launch/train.py, which torchrun/deepspeed start
dist-sr key NAME --seed S --step T   print a parameter's stream key
dist-sr diagnose CHECKPOINT --lr LR  does round-to-nearest stick on this checkpoint (GGUF file, HF
                                     directory or smollm2) at this lr, and does SR fix it? A few real
                                     AdamW steps under each; a table, JSON and a figure. --forecast:
                                     predicted from the weights alone, streamed (7B-70B in minutes)
dist-sr k8s --config EXP.yaml -o DIR  render Kubernetes manifests (see dist_sr/launch/k8s.py)
dist-sr deepspeed-hook install       honour the DeepSpeed JSON's SR block in unmodified scripts
dist-sr doctor                       would SR attach here (DeepSpeed, FSDP2, TRL, verl, OpenRLHF), and
                                     if not, why: the start-up hook, the switch, versions, the launcher
dist-sr snapshot materialize DIR OUT the newest weight version the snapshots in DIR prove (a dense
                                     base plus its deltas), as a checkpoint an engine serves
"""

from __future__ import annotations

import argparse
import sys

from ..config import parse_overrides
from ..integrations import startup
from ..numerics.key import normalize_param_name, stream_key
from ..rl.compare import load_compare, report_comparison, run_comparison
from ..weightsync.disk.materialize import materialize
from . import doctor, k8s, planner


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="dist-sr", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)

    p_train = sub.add_parser("train", help="one GRPO run (the options of launch/train.py)")
    p_train.add_argument(
        "config_file",
        nargs="?",
        metavar="CONFIG",
        help="experiment YAML (default: the embedded quickstart); same as --config",
    )
    planner.add_arguments(p_train)

    p_cmp = sub.add_parser("compare", help="every precision x seeds, then report.md + figure.png")
    p_cmp.add_argument("config", nargs="?", help="comparison YAML (default: the embedded quickstart comparison)")
    p_cmp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a top-level field, e.g. --set 'seeds=[0]' --set parallel=1",
    )
    p_cmp.add_argument(
        "--report-only", action="store_true", help="rewrite the report from finished runs (and those archive_dir holds)"
    )
    p_cmp.add_argument("--no-progress", action="store_true")

    p_diag = sub.add_parser("diagnose", help="weight sticking on your checkpoint: RTN vs SR, per parameter group")
    p_diag.add_argument("checkpoint", help="a GGUF file, a Hugging Face directory, or smollm2 (the shipped GGUF)")
    p_diag.add_argument("--lr", type=float, required=True, help="the AdamW learning rate you train with")
    p_diag.add_argument("--steps", type=int, default=4, help="optimizer steps under each rounding (default 4)")
    p_diag.add_argument("--batch", type=int, default=16, help="samples per step (default 16)")
    p_diag.add_argument(
        "--samples", help='JSONL of {"prompt": ..., "completion": ...} (default: the built-in chat-add task)'
    )
    p_diag.add_argument("--seed", type=int, default=0, help="which samples make the batches")
    p_diag.add_argument("--out", default="runs/diagnose", help="where diagnose.json and diagnose.png go")
    p_diag.add_argument("--cache-dir", default="runs/cache", help="where the checkpoint's BF16 cast is kept")
    p_diag.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    p_diag.add_argument(
        "--forecast",
        action="store_true",
        help="predict from the weights alone (streams a safetensors checkpoint, no training: 7B-70B in minutes)",
    )
    p_diag.add_argument("--compare", action="store_true", help="with --forecast: also measure, and print both")
    p_diag.add_argument("--no-progress", action="store_true")

    p_key = sub.add_parser("key", help="print the stream key of a parameter")
    p_key.add_argument("name")
    p_key.add_argument("--seed", type=int, required=True)
    p_key.add_argument("--step", type=int, default=0)
    p_key.add_argument("--mode", default="stochastic", choices=["stochastic", "dither"])

    p_snap = sub.add_parser("snapshot", help="rebuild the newest verified weight version from snapshots")
    snap_sub = p_snap.add_subparsers(dest="snapshot_command", required=True)
    p_mat = snap_sub.add_parser("materialize", help="base + deltas -> a dense checkpoint an engine serves")
    p_mat.add_argument("snapshot_dir", help="rollout.vllm.snapshot_dir of the job")
    p_mat.add_argument(
        "out", help="where to write the checkpoint: a new directory or one materialize wrote (replaced atomically)"
    )

    p_k8s = sub.add_parser("k8s", help="render Kubernetes manifests from an experiment config", add_help=False)
    p_k8s.add_argument("args", nargs=argparse.REMAINDER)

    p_hook = sub.add_parser(
        "deepspeed-hook", help="install|uninstall|status of the deepspeed.initialize hook", add_help=False
    )
    p_hook.add_argument("args", nargs=argparse.REMAINDER)

    p_doc = sub.add_parser("doctor", help="would SR attach in this environment, and if not, why", add_help=False)
    p_doc.add_argument("args", nargs=argparse.REMAINDER)

    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["deepspeed-hook"]:
        return startup.main(argv[1:])
    if argv[:1] == ["k8s"]:
        return k8s.main(argv[1:])
    if argv[:1] == ["doctor"]:
        return doctor.main(argv[1:])
    args = ap.parse_args(argv)
    if args.command == "train":
        if args.config_file and args.config and args.config_file != args.config:
            print("dist-sr train: give the config once (positionally or with --config)", file=sys.stderr)
            return 2
        args.config = args.config or args.config_file
        return planner.run(args, prog="dist-sr train")
    return planner.refusing("dist-sr", _command, args)


def _command(args: argparse.Namespace) -> int:
    if args.command == "compare":
        cfg = load_compare(args.config, parse_overrides(args.set))
        report = report_comparison(cfg) if args.report_only else run_comparison(cfg, progress=not args.no_progress)
        print(report.read_text())
        print(f"\nreport: {report}\nfigure: {report.parent / 'figure.png'}")
    elif args.command == "snapshot":
        m = materialize(args.snapshot_dir, args.out)
        for line in m.refused:
            print(f"dist-sr snapshot: refused {line}", file=sys.stderr)
        print(f"materialized version {m.version} (base v{m.base} + {m.deltas} deltas) into {m.path}, digest {m.digest}")
    elif args.command == "diagnose":
        _diagnose(args)
    elif args.command == "key":
        key = stream_key(seed=args.seed, step=args.step, param=args.name, mode=args.mode)
        print(f"{normalize_param_name(args.name)} {key:016x}")
    return 0


def _diagnose(args: argparse.Namespace) -> None:
    import torch

    from ..rl import diagnose

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.forecast:
        return _forecast(args)
    d = _measured(args)
    js, png = diagnose.write(d, args.out)
    print(diagnose.table(d))
    print(f"\njson: {js}\nfigure: {png}")
    print(d.last_line())


def _measured(args: argparse.Namespace):
    """The measured diagnosis (``rl.diagnose.diagnose``) the command line asks for."""
    from ..rl import diagnose

    return diagnose.diagnose(
        args.checkpoint,
        lr=args.lr,
        steps=args.steps,
        batch=args.batch,
        seed=args.seed,
        samples=args.samples,
        cache_dir=args.cache_dir,
        progress=not args.no_progress,
    )


def _forecast(args: argparse.Namespace) -> None:
    from pathlib import Path

    from ..rl import forecast
    from ..rl.checkpoint import bf16_start

    source = Path(args.checkpoint)
    streamable = source.suffix == ".safetensors" or (source.is_dir() and any(source.glob("*.safetensors")))
    start = source if streamable else bf16_start(args.checkpoint, args.cache_dir)  # GGUF: its BF16 cast
    f = forecast.forecast(start, lr=args.lr, steps=args.steps, progress=not args.no_progress)
    measured = _measured(args) if args.compare else None
    js = forecast.write(f, args.out, measured)
    print(forecast.table(f, measured))
    print(f"\njson: {js}")
    print(f.last_line())


if __name__ == "__main__":
    sys.exit(main())
