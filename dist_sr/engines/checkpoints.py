"""Checkpoint files every engine writes the same way: atomic replaces and a bounded history."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

KEEP_CHECKPOINTS = 2  # step directories kept under <run>/deepspeed/ and <run>/fsdp2/


def prune_checkpoints(root: Path) -> None:
    """Remove all but the newest ``KEEP_CHECKPOINTS`` complete ``step<N>`` directories."""
    done = sorted((d for d in root.glob("step*") if d.is_dir() and d.name[4:].isdigit()),
                  key=lambda d: int(d.name[4:]))
    for old in done[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(old, ignore_errors=True)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
