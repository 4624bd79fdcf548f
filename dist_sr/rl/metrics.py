"""A run's metrics file: one JSON object per step in ``metrics.jsonl`` (and TensorBoard scalars
when it is installed), and reading it back."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

from .. import faults
from ..config import ConfigError


class MetricsWriter:
    """Appends one JSON object per line (strict JSON: a NaN or Inf is written as null); mirrors
    the finite scalars to TensorBoard when it is installed. Resuming keeps the lines up to the
    checkpoint's step; a partial last line (a writer killed mid-line) is dropped with a warning."""

    def __init__(self, out_dir: Path, keep_until_step: int | None = None):
        self.path = out_dir / "metrics.jsonl"
        if keep_until_step is not None and self.path.exists():  # resuming: drop what comes after
            kept = [json.dumps(r) for r in read_metrics(self.path) if r["step"] <= keep_until_step]
            tmp = self.path.with_suffix(".jsonl.tmp")  # a crash here leaves the old file whole
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        elif keep_until_step is None:
            self.path.write_text("")
        self.tb = None
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, record: dict) -> None:
        record = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        faults.point("metrics.written")
        if self.tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self.tb.add_scalar(k, v, record["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``; a partial last line is dropped with a warning, a bad line
    before it is an error (the file was damaged, not cut short)."""
    lines = path.read_text().split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # no newline after it: the writer was killed mid-line
                warnings.warn(
                    f"dist_sr: {path}: dropping a partial last line ({line[:60]!r})", RuntimeWarning, stacklevel=2
                )
                continue
            raise ConfigError(
                f"{path}: line {i + 1} is not JSON ({line[:60]!r}); the metrics file is damaged"
            ) from None
    return records
