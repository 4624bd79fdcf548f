"""The training entry point behind ``launch/train.py`` and ``dist-sr train``: one planner.

One script for every way a job starts::

    python launch/train.py --config configs/quickstart.yaml                       # one process
    torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr HOST \\
        launch/train.py --config configs/grpo-fsdp2.yaml                          # torchrun
    deepspeed --num_gpus 8 launch/train.py --config configs/grpo-deepspeed-zero2.yaml \\
        --deepspeed_config configs/deepspeed/zero2-bf16-sr.json                  # deepspeed
    deepspeed --hostfile hosts launch/train.py ...                                # several nodes

The launchers describe the process group in the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); the deepspeed launcher also passes
``--local_rank``. The entry point checks the config against that world before any process group
exists, so a bad combination fails on every rank with the same message; then it joins the group
(nccl with CUDA, gloo without) and runs the GRPO trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import ConfigError, Refusal, load_document, parse_overrides
from ..engines import engine_class, engine_names
from ..engines.config import DistributedConfig
from ..engines.deepspeed.config import hyperparameter_conflicts, precision_of_config, shared_hyperparameters
from ..net import free_port
from ..rl.config import ExperimentConfig, GRPOConfig, load_experiment
from ..rl.trainer import check_world, train

BACKENDS = ("auto", "gloo", "nccl")


def build_parser(prog: str = "launch/train.py") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=prog, description="GRPO training with dist-sr under deepspeed, torchrun or one process."
    )
    add_arguments(ap)
    return ap


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The entry point's options (``dist-sr train`` takes the same, plus the config positionally)."""
    ap.add_argument("--config", help="experiment YAML (default: the embedded quickstart run)")
    ap.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        dest="deepspeed_config",
        metavar="JSON",
        help="DeepSpeed JSON (may hold a stochastic_rounding block); implies --engine deepspeed",
    )
    ap.add_argument(
        "--engine", choices=engine_names(), help="training engine (default: the config's distributed.engine)"
    )
    ap.add_argument(
        "--backend", choices=BACKENDS, default="auto", help="process-group backend: auto = nccl with CUDA, gloo without"
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set grpo.lr=1e-5 --set precision=bf16-sr",
    )
    ap.add_argument("--output-dir", help="run directory (overrides output_dir)")
    ap.add_argument(
        "--resume",
        action="store_const",
        const=True,
        default=False,
        help="continue from the run directory's checkpoint (an error if there is none)",
    )
    ap.add_argument(
        "--resume-or-start",
        dest="resume",
        action="store_const",
        const="auto",
        help="continue from the checkpoint if there is one, else start fresh (restartable jobs)",
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a run already in the output directory (its metrics and checkpoints)",
    )
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="check config and world, print the plan, exit")
    ap.add_argument(
        "--local_rank",
        "--local-rank",
        dest="local_rank",
        type=int,
        help="set by the deepspeed launcher; LOCAL_RANK in the environment takes precedence",
    )


@dataclass
class Plan:
    config: ExperimentConfig
    engine: str
    backend: str
    world: int
    rank: int
    local_rank: int
    launched: bool  # a launcher set WORLD_SIZE

    def describe(self) -> str:
        return (
            f"engine={self.engine} backend={self.backend} world={self.world} rank={self.rank} "
            f"local_rank={self.local_rank} precision={self.config.precision.precision} "
            f"rollout={self.config.rollout.engine} output_dir={self.config.output_dir}"
        )


def _int_env(env: dict, name: str) -> int | None:
    if name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={env[name]!r} is not an integer") from None


def config_source(args: argparse.Namespace) -> str | dict:
    """What ``load_experiment`` reads for ``--config``: the file (which must exist) or, without
    one, the embedded default."""
    if args.config and not Path(args.config).is_file():
        raise ConfigError(f"--config {args.config}: no such file")
    return args.config or {}


def plan(args: argparse.Namespace, env: dict | None = None, cuda: bool | None = None) -> Plan:
    """Resolve config + command line + launcher environment into what this process will run. The
    experiment is read once (with the overrides), the DeepSpeed JSON parsed once and what it says
    merged in where the experiment is silent, then validated once (``load_experiment``); the
    world's checks are the trainer's (``check_world``), asked here before anything starts."""
    env = dict(os.environ if env is None else env)
    if cuda is None:
        cuda = torch.cuda.is_available()
    overrides = parse_overrides(args.set)
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    document = load_document(config_source(args), overrides)
    ds = _deepspeed_json(args.deepspeed_config)
    configured = _section(document, "distributed").get("engine", DistributedConfig.engine)
    engine = args.engine or configured
    if ds is not None:
        engine = _deepspeed_json_engine(args.engine, configured)
        _section(document, "distributed")["deepspeed_config"] = args.deepspeed_config
    _section(document, "distributed")["engine"] = engine
    path = _section(document, "distributed").get("deepspeed_config")
    reads_json = engine_class(engine).reads_deepspeed_json and path
    if reads_json:
        ds = ds if ds is not None else _deepspeed_json(path)
        _adopt_from_deepspeed_json(document, ds, path)
    cfg = load_experiment(document)
    if reads_json:
        _check_agreement(cfg, ds, path)

    world = _int_env(env, "WORLD_SIZE")
    launched = world is not None
    world = world or 1
    rank = _int_env(env, "RANK") or 0
    local_rank = _int_env(env, "LOCAL_RANK")
    if local_rank is None:
        local_rank = args.local_rank if args.local_rank is not None else 0
    check_world(cfg, world)
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ConfigError("--backend nccl needs CUDA, and this process sees no GPU; use --backend gloo (or auto)")
    return Plan(cfg, engine, backend, world, rank, local_rank, launched)


def _section(document: dict, name: str) -> dict:
    node = document.setdefault(name, {})
    if not isinstance(node, dict):
        raise ConfigError(f"config section {name}: expected a mapping, got {type(node).__name__}")
    return node


def _deepspeed_json(path: str | None) -> dict | None:
    """The DeepSpeed JSON at ``path``, parsed (None without one); refused by name when it is
    missing or not JSON."""
    if not path:
        return None
    ds_path = Path(path)
    if not ds_path.is_file():
        raise ConfigError(f"--deepspeed_config {ds_path}: no such file")
    try:
        ds = json.loads(ds_path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--deepspeed_config {ds_path}: not valid JSON ({exc})") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"--deepspeed_config {ds_path}: expected a JSON object, got {type(ds).__name__}")
    return ds


def _deepspeed_json_engine(asked: str | None, configured: str) -> str:
    """The engine a ``--deepspeed_config`` implies: the one that reads DeepSpeed JSON, unless the
    command line or the config chose another on purpose (a launched engine; one process is the
    default, not a choice)."""
    readers = [n for n in engine_names() if engine_class(n).reads_deepspeed_json]
    chosen = asked if asked is not None else configured
    chose_other = asked is not None or engine_class(configured).needs_process_group
    if chosen in readers:
        return chosen
    if chose_other or len(readers) != 1:
        raise ConfigError(
            f"--deepspeed_config was given but the engine is {chosen!r}: a DeepSpeed JSON only drives "
            f"distributed.engine={' or '.join(readers)} (drop it, or use --engine {readers[0] if readers else '?'})"
        )
    return readers[0]


def _adopt_from_deepspeed_json(document: dict, ds: dict, path: str) -> None:
    """What the experiment does not say, the DeepSpeed JSON does: its precision (so an existing
    DeepSpeed config turns SR on by itself) where the experiment has no ``precision`` section, and
    its lr, betas, eps, weight decay and clipping where the experiment sets none of them."""
    try:
        if "precision" not in document:
            document["precision"] = precision_of_config(ds)
        optimizer = _section(document, "grpo").get("optimizer", GRPOConfig.optimizer)
        theirs = shared_hyperparameters(ds, optimizer)
    except ValueError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    grpo = _section(document, "grpo")
    for field, value in theirs.items():
        grpo.setdefault(field, list(value) if field == "betas" else value)


def _check_agreement(cfg: ExperimentConfig, ds: dict, path: str) -> None:
    """The experiment and the DeepSpeed JSON must not disagree (the trainer would otherwise use one
    and silently drop the other): the precision, and each hyperparameter both state."""
    theirs = precision_of_config(ds)
    mine = cfg.precision
    if mine.precision != theirs["precision"] or ("seed" in theirs and theirs["seed"] != mine.seed):
        said = theirs["precision"] + (f" (seed {theirs['seed']})" if "seed" in theirs else "")
        raise ConfigError(
            f"precision {mine.precision} (seed {mine.seed}) in the experiment config contradicts "
            f"{path}, which says {said}; make them agree, or drop the experiment's precision "
            "section to take the DeepSpeed config's"
        )
    g = cfg.grpo
    values = dict(lr=g.lr, betas=g.betas, eps=g.eps, weight_decay=g.weight_decay, max_grad_norm=g.max_grad_norm)
    conflicts = hyperparameter_conflicts(ds, values, g.optimizer)
    if conflicts:
        raise ConfigError(
            f"the experiment and {path} disagree: {'; '.join(conflicts)}; make them equal, or drop "
            "one of the two (an unset experiment value takes the JSON's)"
        )


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def refusing(prog: str, fn, *args, **kwargs) -> int:
    """Run ``fn``; the project's own refusals (``dist_sr.config.Refusal``: a bad config, a missing
    secret, an unusable run directory, a checkpoint that does not verify, a model too large, a run
    that stopped training) become one line naming the problem and the fix, exit status 2. Anything
    else is a crash and keeps its traceback. Every command-line entry point goes through here."""
    try:
        return fn(*args, **kwargs)
    except Refusal as exc:
        print(f"{prog}: {exc.what}: {exc}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace, prog: str = "launch/train.py") -> int:
    """Plan, then train on this process's share of the world (every entry point ends here)."""
    return refusing(prog, _run, args, prog)


def _run(args: argparse.Namespace, prog: str) -> int:
    p = plan(args)
    if p.rank == 0 or args.dry_run:
        print(f"dist-sr launch: {p.describe()}", flush=True)
    if args.dry_run:
        return 0
    os.environ["LOCAL_RANK"] = str(p.local_rank)  # DeepSpeed reads it from the environment
    if engine_class(p.engine).needs_process_group and not p.launched:
        # A plain process running a distributed engine: a world of one on loopback.
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    try:
        path = train(
            p.config, progress=not args.no_progress, resume=args.resume, overwrite=args.overwrite, backend=p.backend
        )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if p.rank == 0:
        print(f"metrics: {path}")
    return 0
