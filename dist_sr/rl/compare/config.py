"""A comparison's settings (``CompareConfig``, read by ``load_compare``) and the runs they name:
each cell (a run at one learning rate) from each start checkpoint with each seed, its directory
and its experiment."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import load_document
from ..config import ConfigError, ExperimentConfig, from_dict, load_experiment
from ..cpu_math import check_isa
from ..metrics import read_metrics
from ..rundir import check_resume_config, holds_a_run


@dataclass
class RunSpec:
    name: str
    precision: str = "bf16-sr"
    lr_scale: float = 1.0
    shadow_jitter: bool = False
    seeds: list[int] | None = None  # this run's RL seeds (None: the comparison's); fewer for a slow run
    lrs: list[float] | None = None  # the sweep's learning rates this run trains at (None: every one of lrs)


@dataclass
class LrSettings:
    """What differs at one learning rate of the sweep: a low rate needs more steps to move the
    policy, and its claims are read at its own steps."""

    lr: float
    steps: int | None = None  # grpo.steps at this rate (None: the experiment's)
    report_steps: list[int] | None = None  # the steps its tables and claim checks read (None: report_steps)


def _default_runs() -> list[RunSpec]:
    return [
        RunSpec("fp32", "fp32"),
        RunSpec("fp16", "fp16", seeds=[0]),  # ~4x the others' time on a CPU: one seed per start checkpoint
        RunSpec("bf16", "bf16"),
        RunSpec("bf16-sr", "bf16-sr"),
        RunSpec("bf16-offgrid", "bf16", shadow_jitter=True),
    ]


def _int_list(values, what: str) -> None:
    if (
        not values
        or not isinstance(values, list)
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in values)
    ):
        raise ConfigError(f"{what} must be a non-empty list of ints, got {values!r}")
    if len(set(values)) != len(values):
        raise ConfigError(f"{what} has duplicates: {values!r}")


@dataclass
class CompareConfig:
    experiment: dict[str, Any] = field(default_factory=dict)  # overrides of the experiment defaults
    experiment_file: str | None = None  # or a YAML file (relative to this one)
    start_seeds: list[int] = field(default_factory=lambda: [0, 1, 2])  # warm-up seeds: one start checkpoint each
    seeds: list[int] = field(default_factory=lambda: [0, 1])  # RL seeds, each from every start checkpoint
    lrs: list[float] = field(default_factory=list)  # a sweep: every run at each lr (x its lr_scale)
    runs: list[RunSpec] = field(default_factory=_default_runs)
    parallel: int = 2
    threads: int = 1  # torch threads of each run (parallel x threads: the cores the comparison uses)
    threshold: float = 0.05  # accuracy gain for "steps to threshold" and matched-accuracy KL
    report_steps: list[int] = field(default_factory=lambda: [100, 200, 300])
    per_lr: list[LrSettings] = field(default_factory=list)  # steps and report steps at a rate of lrs
    # the largest trainer-engine gap (a run's mean |log p_trainer - log p_engine| per sampled token,
    # mean over its steps) at which a run still counts as on-policy; a claim involving a run above
    # it is refused, not checked
    on_policy_gap: float = 0.05
    reference: str = "bf16-sr"  # the run others are compared with in the goal checks
    output_dir: str = "runs/compare"
    # where finished runs are kept between machines or sessions (their metrics.jsonl and config.yaml,
    # and each start checkpoint's digest; archive.py): a run archived there is restored, not trained
    # again. null: none
    archive_dir: str | None = None
    # pin the workers' CPU kernels to one instruction set (rl/cpu_math.py: avx2, avx512, or auto, AVX2
    # on x86-64); null (default): each library picks the CPU's widest, several times faster for BF16
    cpu_isa: str | None = None

    def __post_init__(self):
        check_isa(self.cpu_isa)
        _int_list(self.seeds, "seeds")
        _int_list(self.start_seeds, "start_seeds")
        if not isinstance(self.lrs, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in self.lrs
        ):
            raise ConfigError(f"lrs must be a list of positive learning rates (empty: no sweep), got {self.lrs!r}")
        if len(set(self.lrs)) != len(self.lrs):
            raise ConfigError(f"lrs has duplicates: {self.lrs!r}")
        if self.parallel < 1:
            raise ConfigError(f"parallel must be >= 1 (training processes at a time), got {self.parallel}")
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1 (torch threads per run), got {self.threads}")
        if not self.on_policy_gap > 0:
            raise ConfigError(f"on_policy_gap must be > 0 (mean |dlogp| per token), got {self.on_policy_gap}")


@dataclass(frozen=True)
class Cell:
    """One column of the comparison: a run, at one learning rate of the sweep (``lr`` None: the
    experiment's), trained from every start checkpoint with every seed."""

    label: str
    spec: RunSpec
    lr: float | None = None


def cells(cfg: CompareConfig) -> list[Cell]:
    if not cfg.lrs:
        return [Cell(spec.name, spec) for spec in cfg.runs]
    return [
        Cell(label(spec.name, lr), spec, float(lr))
        for lr in cfg.lrs
        for spec in cfg.runs
        if spec.lrs is None or float(lr) in spec.lrs
    ]


def lr_settings(cfg: CompareConfig, lr: float | None) -> LrSettings | None:
    return next((p for p in cfg.per_lr if lr is not None and p.lr == lr), None)


def report_steps(cfg: CompareConfig, lr: float | None) -> list[int]:
    """The steps a cell at ``lr`` is reported and checked at."""
    at = lr_settings(cfg, lr)
    return at.report_steps if at is not None and at.report_steps else cfg.report_steps


def run_seeds(cfg: CompareConfig, cell: Cell) -> list[int]:
    return cfg.seeds if cell.spec.seeds is None else cell.spec.seeds


def label(name: str, lr: float | None) -> str:
    return name if lr is None else f"{name}@{lr:g}"


def load_compare(source: str | Path | None = None, overrides: dict | None = None) -> CompareConfig:
    data: dict = {}
    base = Path(".")
    if source is not None:
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"compare config {path} does not exist")
        data = load_document(path)
        base = path.parent
    for k, v in (overrides or {}).items():
        data[k] = v
    runs = data.pop("runs", None)
    per_lr = data.pop("per_lr", None)
    cfg = from_dict(CompareConfig, data)
    if per_lr is not None:
        if not isinstance(per_lr, list):
            raise ConfigError("per_lr: expected a list of {lr, steps, report_steps}")
        cfg.per_lr = [from_dict(LrSettings, p, f"per_lr[{i}]") for i, p in enumerate(per_lr)]
    if runs is not None:
        if not isinstance(runs, list) or not runs:
            raise ConfigError("runs: expected a non-empty list of {name, precision, lr_scale, shadow_jitter}")
        cfg.runs = [from_dict(RunSpec, r, f"runs[{i}]") for i, r in enumerate(runs)]
        for i, spec in enumerate(cfg.runs):
            if spec.seeds is not None:
                _int_list(spec.seeds, f"runs[{i}].seeds")
            if spec.lrs is not None:
                spec.lrs = [float(v) for v in spec.lrs]
                if not spec.lrs or not set(spec.lrs) <= {float(v) for v in cfg.lrs}:
                    raise ConfigError(
                        f"runs[{i}].lrs={spec.lrs}: a run trains at some of the sweep's learning rates (lrs: "
                        f"{cfg.lrs}); list some of them, or leave runs[{i}].lrs out for every one"
                    )
    _check_per_lr(cfg)
    if cfg.experiment_file:
        cfg.experiment_file = str((base / cfg.experiment_file).resolve())
    names = [r.name for r in cfg.runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"runs: duplicate run names in {names}")
    if any("@" in n or "/" in n for n in names):
        raise ConfigError(f"runs: a run name may not contain '@' or '/' (used for sweeps and paths): {names}")
    if cfg.reference not in names:
        raise ConfigError(f"reference: {cfg.reference!r} is not one of the runs {names}")
    ref = next(spec for spec in cfg.runs if spec.name == cfg.reference)
    if ref.lrs is not None and set(ref.lrs) != {float(v) for v in cfg.lrs}:
        raise ConfigError(
            f"runs: the reference {cfg.reference!r} must train at every learning rate of lrs {cfg.lrs} (the "
            f"others are compared with it there); it has lrs {ref.lrs}"
        )
    for cell in cells(cfg):  # validate every run's experiment now, not after an hour of training
        exp = run_config(cfg, cell, cfg.start_seeds[0], cfg.seeds[0])
    warmed = exp.warmup.enabled and (exp.model.path is None or exp.warmup.pretrained)
    if len(cfg.start_seeds) > 1 and not warmed:
        raise ConfigError(
            f"start_seeds={cfg.start_seeds}: start checkpoints differ by their warm-up seed, but this "
            "experiment has no warm-up (model.path is set without warmup.pretrained, or warmup.enabled is "
            "false); set start_seeds: [0] and vary seeds, or warm the checkpoint up (warmup.pretrained: true)"
        )
    return cfg


def _check_per_lr(cfg: CompareConfig) -> None:
    rates = {float(v) for v in cfg.lrs}
    for i, at in enumerate(cfg.per_lr):
        if at.lr not in rates:
            raise ConfigError(f"per_lr[{i}].lr={at.lr:g} is not one of the sweep's learning rates (lrs: {cfg.lrs})")
        if at.steps is not None and at.steps < 1:
            raise ConfigError(f"per_lr[{i}].steps must be >= 1, got {at.steps}")
        if at.report_steps is not None:
            _int_list(at.report_steps, f"per_lr[{i}].report_steps")
    if len({at.lr for at in cfg.per_lr}) != len(cfg.per_lr):
        raise ConfigError(f"per_lr names a learning rate twice: {[at.lr for at in cfg.per_lr]}")


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def run_dir(cfg: CompareConfig, cell: Cell, start: int, seed: int) -> Path:
    return Path(cfg.output_dir) / cell.label / f"start-{start}" / f"seed-{seed}"


def run_config(cfg: CompareConfig, cell: Cell, start: int, seed: int) -> ExperimentConfig:
    """The experiment of one run, start checkpoint and seed: the shared experiment plus the run's
    own settings."""
    data = load_document(Path(cfg.experiment_file)) if cfg.experiment_file else {}
    data = _deep_merge(data, cfg.experiment)
    base_lr = cell.lr if cell.lr is not None else load_experiment(data).grpo.lr
    at = lr_settings(cfg, cell.lr)
    return load_experiment(
        data,
        {
            **({"grpo.steps": at.steps} if at is not None and at.steps is not None else {}),
            "precision": cell.spec.precision,
            "grpo.lr": base_lr * cell.spec.lr_scale,
            "shadow_jitter": cell.spec.shadow_jitter,
            "seed": seed,
            "warmup.seed": start,
            "output_dir": str(run_dir(cfg, cell, start, seed)),
            "threads": cfg.threads,
        },
    )


def finished(cfg: ExperimentConfig) -> bool:
    """Whether the run of ``cfg`` trained to its last step; a finished run recorded with settings
    that change its math (config.yaml) is refused, not reused."""
    path = Path(cfg.output_dir) / "metrics.jsonl"
    if not path.exists():
        return False
    lines = read_metrics(path)
    done = bool(lines) and lines[-1]["step"] == cfg.grpo.steps and holds_a_run(Path(cfg.output_dir))
    if done:
        check_resume_config(Path(cfg.output_dir), cfg)
    return done
