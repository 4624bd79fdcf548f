"""A comparison's finished runs kept where a repository can carry them (``archive_dir``): each
run's metrics and recorded settings, and a digest of the start checkpoint it trained from.

A comparison longer than one machine's session goes on in the next one: runs archived there come
back instead of training again, and only where they fit. A run whose recorded settings differ from
the comparison's is refused, as a resume would be; a start checkpoint whose warm-up here gives
other weights than the archived runs trained from is refused, naming both digests, so runs from
two different start checkpoints are never reported as one."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from ..config import ConfigError, ExperimentConfig
from ..cpu_math import machine
from ..rundir import check_resume_config
from .config import CompareConfig, finished

KEPT = ("config.yaml", "metrics.jsonl")  # what a finished run needs to be reported (no checkpoints)


def archived(cfg: CompareConfig, exp: ExperimentConfig) -> Path:
    """Where ``exp``'s run is kept in the archive: the same relative path as under output_dir."""
    assert cfg.archive_dir is not None
    return Path(cfg.archive_dir) / Path(exp.output_dir).relative_to(cfg.output_dir)


def restore(cfg: CompareConfig, runs: list[ExperimentConfig]) -> list[ExperimentConfig]:
    """Copy every finished run the archive holds into output_dir where output_dir has not finished
    it (a run cut short there is replaced by its finished form); returns the runs restored. An
    archived run trained with other settings than ``runs`` name is refused."""
    if cfg.archive_dir is None:
        return []
    back = []
    for exp in runs:
        src = archived(cfg, exp)
        if not (src / "metrics.jsonl").exists() or finished(exp):
            continue
        if not (src / "config.yaml").exists():
            raise ConfigError(
                f"{src} holds metrics without the config.yaml they were trained with: the archive cannot "
                "say whether this run is the one the comparison asks for; restore the file or remove the run"
            )
        check_resume_config(src, exp)
        out = Path(exp.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            shutil.copyfile(src / name, out / name)
        if not finished(exp):
            raise ConfigError(
                f"{src} is archived as finished but its metrics end before step {exp.grpo.steps}: "
                "remove it from the archive to train the run again"
            )
        back.append(exp)
    return back


def store(cfg: CompareConfig, exp: ExperimentConfig, start_digest: str) -> None:
    """Keep the finished run of ``exp`` in the archive, with the digest of its start checkpoint."""
    if cfg.archive_dir is None:
        return
    record_start(cfg, exp, start_digest)
    dst = archived(cfg, exp)
    dst.mkdir(parents=True, exist_ok=True)
    for name in KEPT:  # config first: a run's metrics are never archived without their settings
        tmp = dst / f".{name}.tmp"
        shutil.copyfile(Path(exp.output_dir) / name, tmp)
        tmp.replace(dst / name)


def checkpoint_digest(path: str) -> str:
    """SHA-256 over a start checkpoint's weight files (their names and bytes, in name order); a
    hub id is named by itself."""
    root = Path(path)
    if not root.is_dir():
        return f"id:{path}"
    files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    if not files:
        raise ConfigError(f"start checkpoint {root} holds no weight files (*.safetensors, *.bin, *.pt)")
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with p.open("rb") as f:
            while block := f.read(1 << 24):
                h.update(block)
    return "sha256:" + h.hexdigest()


def _start_record(cfg: CompareConfig, start: int) -> Path:
    assert cfg.archive_dir is not None
    return Path(cfg.archive_dir) / f"start-{start}.json"


def record_start(cfg: CompareConfig, exp: ExperimentConfig, digest: str) -> None:
    """Write the digest of start checkpoint ``exp.warmup.seed`` beside the archived runs, or refuse
    one that differs from the digest already there."""
    if cfg.archive_dir is None:
        return
    path = _start_record(cfg, exp.warmup.seed)
    here = machine()
    if path.exists():
        kept = json.loads(path.read_text())
        if kept["digest"] != digest:
            raise ConfigError(
                f"start checkpoint {exp.warmup.seed} here has weights {digest}, but the runs archived in "
                f"{cfg.archive_dir} trained from {kept['digest']} ({path}), made on {kept.get('machine', '?')}; "
                f"this machine: {here}. The warm-up gave other bits (another CPU, instruction set or torch?), "
                "and runs from two start checkpoints cannot be reported as one: run where the archive was "
                "made, or set archive_dir to a new directory"
            )
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"start_seed": exp.warmup.seed, "digest": digest, "machine": here}
    path.write_text(json.dumps(record, indent=1) + "\n")
