"""What a training engine is: the ``TrainingEngine`` protocol the RL trainer (and any other
caller) talks to, the settings an engine is built from, and the process-group set-up.

An engine owns a model's training step under one precision: ``module`` (forward and
generation), ``backward``, ``step`` (clip + optimizer step; returns the pre-clip gradient norm
and whether the step was taken), ``digest`` (of the working weights as the forward uses them;
collective), ``expected_digest`` (the same weights re-derived from the FP32 masters with the
rounding key, by an independent path; collective), ``weight_source`` (those weights as HF-named
tensors, for rollout engines),
``meter`` (sticking metrics where the working weights are local), ``save``/``load``,
``rank``/``world``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..optim import StickingMeter
from ..precision import PrecisionConfig
from ..sources import WeightSource
from .config import DistributedConfig
from .registry import engine_class


@dataclass
class TrainSettings:
    """Everything an engine is built from."""

    precision: PrecisionConfig
    distributed: DistributedConfig
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    optimizer: str = "adamw"  # a name in ``dist_sr.optim.OPTIMIZERS``
    max_grad_norm: float = 1.0
    batch_per_rank: int = 1  # sequences per rank per step (DeepSpeed's micro batch)

    @property
    def hyper(self) -> dict:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


class TrainingEngine(Protocol):
    """What the trainer asks of a training engine (``single``, ``fsdp2``, ``deepspeed``), built
    from ``TrainSettings`` and the model. Every method is called on every rank.

    Class attributes (what configs, launchers and renderers ask of an engine, never its name):
        needs_process_group: whether it runs under a launcher's process group (``init_distributed``
            joins it first; ranks shard the work). False: one process, world size 1.
        reads_deepspeed_json: whether a DeepSpeed JSON (``--deepspeed_config``,
            ``distributed.deepspeed_config``) configures it.
        trains_pure_bf16: whether it trains without FP32 masters (precision ``bf16-pure-sr``).

    Class methods:
        check_world(distributed, world): raise ``ConfigError`` for a world size this engine cannot
            run with ``distributed`` (a ``DistributedConfig``), before any process group exists.

    Attributes:
        module: the model whose forward the trainer runs (the working weights).
        rank, world: this process in the engine's group.
        meter: a ``StickingMeter`` for the precision's metrics, or None.

    Methods:
        backward(loss): gradients of ``loss`` (scaled if the precision scales losses).
        step(): clip to ``max_grad_norm`` and step; returns ``(grad_norm, stepped)``, ``stepped``
            False for a skipped step (non-finite gradient, loss-scale overflow).
        digest(): the layout-free digest of the working weights as the forward uses them.
        expected_digest(): the same, re-derived from the FP32 masters with the rounding key.
        weight_source(): the working weights for a weight sync (``sources.WeightSource``).
        save(path, step): a verified checkpoint under the run directory ``path``; refuses a bad
            state, never replaces a good checkpoint with one.
        load(path): the step of the newest checkpoint under ``path`` that verifies (loaded), or
            None if there is none; refused ones are moved to ``path/refused``.
    """

    module: torch.nn.Module
    rank: int
    world: int
    meter: StickingMeter | None
    needs_process_group: bool
    reads_deepspeed_json: bool
    trains_pure_bf16: bool

    @classmethod
    def check_world(cls, distributed: DistributedConfig, world: int) -> None: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> tuple[float, bool]: ...

    def digest(self) -> str: ...

    def expected_digest(self) -> str: ...

    def weight_source(self) -> WeightSource: ...

    def save(self, path: Path, step: int) -> None: ...

    def load(self, path: Path) -> int | None: ...


def init_distributed(engine: str, backend: str | None = None) -> None:
    """Join the process group the launcher (torchrun / deepspeed) describes in the environment,
    if ``engine`` needs one: nccl when CUDA is present, gloo otherwise (``backend`` overrides)."""
    if not engine_class(engine).needs_process_group or dist.is_initialized():
        return
    if "WORLD_SIZE" not in os.environ:
        raise ConfigError(
            f"distributed.engine={engine!r} needs a launcher (torchrun or deepspeed) that sets "
            "RANK/WORLD_SIZE/MASTER_ADDR, or the entry point launch/train.py; "
            "or use distributed.engine=single"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)


def training_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def make_engine(settings: TrainSettings, model: torch.nn.Module) -> TrainingEngine:
    """The registered engine ``settings.distributed.engine`` around ``model`` (joining the process
    group first when it needs one)."""
    init_distributed(settings.distributed.engine)
    return engine_class(settings.distributed.engine)(settings, model)
