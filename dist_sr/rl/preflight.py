"""Checks that run before any compute: a run that cannot finish is refused in its first second,
not after its warm-up, its model load or its first ``checkpoint_every`` steps.

- secrets: the checkpoint key (and the sync secret where a rollout fleet needs one) readable and
  long enough;
- the run directory: a directory (or creatable), writable, with free space for one checkpoint;
- memory: the model, its working copies, gradients and optimizer state against what this
  machine (or GPU) has for this process, with the numbers in the message.

Each failure is a ``Refusal`` (one line from the command line, naming the problem and the fix).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ConfigError, Refusal
from ..engines import engine_class
from ..engines.checkpoints import manifest_key
from ..rollout import rollout_engine_class
from .checkpoint import SMOLLM2, resolve
from .checkpoint import hf_config as checkpoint_config
from .config import ExperimentConfig


class RunDirectoryError(Refusal, OSError):
    """The run directory cannot hold this run."""

    what = "run directory"


class TooLarge(Refusal, MemoryError):
    """The model and its training state do not fit in this process's memory."""

    what = "too large"


def check_secrets(cfg: ExperimentConfig) -> None:
    """The checkpoint manifests' key (read and length-checked now, not at the first save), and what
    the rollout engine checks before compute (a fleet's sync secret)."""
    manifest_key()
    rollout_engine_class(cfg.rollout.engine).preflight(cfg.rollout)


def check_run_dir(out_dir: Path, need_bytes: int) -> None:
    """``out_dir`` is a directory (created if missing), this process can write it, and its file
    system has ``need_bytes`` free (one checkpoint)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RunDirectoryError(f"output_dir {out_dir} exists and is not a directory; choose another output_dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out_dir, prefix=".dist-sr-write-check-"):
            pass
    except OSError as exc:
        raise RunDirectoryError(
            f"output_dir {out_dir} cannot be created or written ({exc.strerror or exc}); choose a writable output_dir"
        ) from None
    free = shutil.disk_usage(out_dir).free
    if free < need_bytes:
        raise RunDirectoryError(
            f"output_dir {out_dir} has {_gb(free)} free, and one checkpoint of this run takes "
            f"about {_gb(need_bytes)}; free space there or choose another output_dir"
        )


@dataclass(frozen=True)
class Footprint:
    """Bytes of one training process's state, per parameter and in all."""

    params: int
    bytes_per_param: int
    shards: int = 1  # processes the state is spread over (a sharded engine's world): a floor per process

    @property
    def total(self) -> int:
        return self.params * self.bytes_per_param // self.shards

    @property
    def checkpoint(self) -> int:
        """One checkpoint: the working weights, FP32 shadows and two Adam moments (what is saved)."""
        return self.params * 16 + (1 << 20)


def bytes_per_param(cfg: ExperimentConfig) -> int:
    """Per parameter: the FP32 load, the working weights and their gradients, FP32 shadows and
    theirs, two Adam moments, and the FP32 reference copy of the start weights. Activations come
    on top (the estimate is a floor, so a refusal is never wrong)."""
    spec = cfg.precision.spec
    working = torch.finfo(spec.working_dtype).bits // 8
    shadow = 8 if spec.shadows else 0  # FP32 shadow + its gradient
    moments = 4 if spec.pure and cfg.precision.moment_dtype == "bf16" else 8
    return working * 2 + shadow + moments + 4  # + the FP32 reference model


def count_parameters(cfg: ExperimentConfig) -> int:
    """The policy's parameter count, from its config alone (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if cfg.model.path is None:
        from .model import build_tiny
        from .tokenizer import char_tokenizer

        with torch.device("meta"):
            model = build_tiny(cfg.model, char_tokenizer())
    else:
        if cfg.model.path == SMOLLM2 or Path(cfg.model.path).is_file():  # a GGUF file: its metadata
            hf_config = checkpoint_config(resolve(cfg.model.path))
            if hasattr(hf_config, "quantization_config"):
                del hf_config.quantization_config  # the run trains the dequantized BF16 cast
        else:
            try:
                hf_config = AutoConfig.from_pretrained(cfg.model.path)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"model.path {cfg.model.path!r}: no readable model config ({exc})") from None
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


def available_memory() -> tuple[int, str]:
    """Bytes this process may still use, and where that number comes from: the free memory of
    its GPU, else the machine's available memory (``MemAvailable``, or the cgroup limit if
    lower) shared by the processes of this node (``LOCAL_WORLD_SIZE``)."""
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        return free, f"free memory of {torch.cuda.get_device_name()}"
    avail, where = _meminfo_available(), "available memory (MemAvailable)"
    limit = _cgroup_left()
    if limit is not None and limit < avail:
        avail, where = limit, "the cgroup's memory limit less its usage"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if local > 1:
        return avail // local, f"{where} / {local} processes on this node"
    return avail, where


def check_memory(cfg: ExperimentConfig, footprint: Footprint, available: tuple[int, str] | None = None) -> None:
    have, where = available if available is not None else available_memory()
    if footprint.total > have:
        raise TooLarge(
            f"the model has {footprint.params / 1e6:.1f}M parameters; training it with precision "
            f"{cfg.precision.precision} holds at least {footprint.bytes_per_param} bytes per parameter "
            f"({_gb(footprint.total)} for this process before activations), "
            f"but this process has {_gb(have)} ({where}); "
            "use a smaller model, or more processes (distributed.engine fsdp2 or deepspeed ZeRO-3 shard "
            "the state) or machines"
        )


def preflight(cfg: ExperimentConfig, out_dir: Path) -> Footprint:
    """Every check that can run before compute (each rank runs them); returns the footprint."""
    check_secrets(cfg)
    sharded = engine_class(cfg.distributed.engine).needs_process_group
    world = int(os.environ.get("WORLD_SIZE", "1") or 1) if sharded else 1
    footprint = Footprint(count_parameters(cfg), bytes_per_param(cfg), world)
    check_memory(cfg, footprint)
    check_run_dir(out_dir, footprint.checkpoint)
    return footprint


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cgroup_left() -> int | None:
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None


def _gb(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
