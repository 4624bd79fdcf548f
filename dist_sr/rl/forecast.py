"""``dist-sr diagnose CHECKPOINT --lr LR --forecast``: how much of a checkpoint round-to-nearest
would leave stuck at a learning rate, predicted from the weights alone, for the checkpoints users
hold (7B-70B) on a CPU in minutes: no model, no training state, no gradients.

A run starts from the checkpoint's BF16 values (``checkpoint.bf16_start``), so each weight ``w``
sits on the BF16 grid, and round-to-nearest moves it only once its FP32 shadow has drifted more
than half the BF16 spacing to its nearer neighbour, ``h(w) = 2^(e - 8)`` for ``2^e <= |w| <
2^(e+1)`` (half that for ``|w| = 2^e``, whose neighbour toward zero is nearer). In its first
steps AdamW moves every element with a gradient by about ``lr`` (exactly ``lr`` in the first
step, where ``m / sqrt(v) = g / |g|``; at most ``lr`` times a factor near one after), so:

- **can move at step 1**: the share with ``h(w) < lr``; the weights round-to-nearest can move in
  the first step (the measured share is lower: not every element has a gradient);
- **can move within N steps**: the share with ``h(w) < N * lr`` (a drift of at most ``N * lr``);
  the rest, **stuck for N steps**, cannot have moved whatever the gradients;
- **steps until the median weight can move**: ``h`` of the median weight over ``lr`` (a lower
  bound: the measured drift per step is at most ``lr``).

``h`` depends only on the exponent field, so each tensor is read a block of rows at a time
(``safetensors``' lazy slices: at most ``chunk_bytes`` of it in memory), cast to BF16 as a run
would, and reduced to a histogram of its 256 exponents per parameter group; the shares for any
``lr`` and ``N`` follow from the histograms. ``compare`` runs the measured diagnosis
(``diagnose.diagnose``) on the same checkpoint and puts both side by side.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from ..config import ConfigError
from .diagnose import GROUPS, Diagnosis, group_of, pct

EXPONENTS = 256
BINS = 2 * EXPONENTS  # (exponent, whether the mantissa is zero): a power of two has half the spacing below it
CHUNK_BYTES = 256 << 20  # of a tensor read at a time
SAMPLE_PER_TENSOR = 20_000  # elements of each tensor kept for the median |w|


def half_spacing(exponent: torch.Tensor | int) -> torch.Tensor:
    """Half the BF16 spacing at a weight with biased exponent ``exponent`` (0: zero or subnormal,
    whose spacing is that of the smallest normal; 255: Inf or NaN, which never move)."""
    e = torch.as_tensor(exponent, dtype=torch.float64)
    h = torch.exp2(torch.clamp(e, min=1) - 135)
    return torch.where(e >= 255, torch.full_like(h, math.inf), h)


@dataclass
class GroupForecast:
    params: int = 0
    median_abs_weight: float = 0.0
    can_move_step1: float = 0.0  # share with h(w) < lr
    can_move_within: float = 0.0  # share with h(w) < steps * lr
    steps_to_move_median: float = math.inf  # h of the median weight / lr (a lower bound)

    @property
    def stuck(self) -> float:
        """The share round-to-nearest cannot have moved in ``steps`` steps, whatever the gradients."""
        return 1.0 - self.can_move_within


@dataclass
class Forecast:
    checkpoint: str
    lr: float
    steps: int
    tensors: int
    groups: dict[str, GroupForecast]
    overall: GroupForecast
    histograms: dict[str, list[int]] = field(default_factory=dict, repr=False)  # group -> exponent counts

    def last_line(self) -> str:
        o = self.overall
        return (
            f"forecast: round-to-nearest can move at most {pct(o.can_move_step1)} of BF16 weights in the first "
            f"step at lr {self.lr:g}; {pct(o.stuck)} cannot move in {self.steps} steps"
        )


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    """The safetensors files of ``checkpoint`` (a file, or a directory with ``model.safetensors``
    or a sharded index)."""
    path = Path(checkpoint)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ConfigError(f"--forecast reads safetensors checkpoints; {path} is not one (use diagnose without it)")
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(
            f"--forecast: no safetensors checkpoint at {path} (a .safetensors file, or a directory holding "
            "model.safetensors or model.safetensors.index.json)"
        )
    return files


def exponent_counts(block: torch.Tensor) -> torch.Tensor:
    """Counts of ``block``'s values cast to BF16 (as a run starts from it) by bin ``exponent +
    256 * (mantissa == 0)``: a power of two moves down by half its spacing above."""
    bits = block.reshape(-1).to(torch.bfloat16).view(torch.int16).to(torch.int32)
    return torch.bincount(((bits >> 7) & 0xFF) + EXPONENTS * ((bits & 0x7F) == 0), minlength=BINS)


def forecast(
    checkpoint: str | Path,
    *,
    lr: float,
    steps: int = 4,
    chunk_bytes: int = CHUNK_BYTES,
    progress: bool = True,
) -> Forecast:
    """Stream ``checkpoint`` tensor by tensor (at most ``chunk_bytes`` of one tensor at a time)."""
    from safetensors import safe_open

    if not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"--lr must be a positive learning rate, got {lr}")
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    counts = {g: torch.zeros(BINS, dtype=torch.int64) for g in GROUPS}
    samples: dict[str, list[torch.Tensor]] = {g: [] for g in GROUPS}
    tensors = 0
    files = checkpoint_files(checkpoint)
    with tqdm(desc="forecast", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    shape = piece.get_shape()
                    if not piece.get_dtype().startswith(("BF16", "F16", "F32", "F64")):
                        continue  # integer buffers (quantisation tables, position ids) are not trained
                    g = group_of(name)
                    rows = shape[0] if shape else 1
                    per_row = max(1, math.prod(shape[1:]) if len(shape) > 1 else 1)
                    step = max(1, chunk_bytes // (4 * per_row))
                    n = rows * per_row
                    stride = max(1, n // SAMPLE_PER_TENSOR)
                    for r0 in range(0, rows, step):
                        block = piece[r0 : r0 + step] if shape else piece[:]
                        counts[g] += exponent_counts(block)
                        flat = block.reshape(-1)
                        first = (-(r0 * per_row)) % stride  # the global stride, across blocks
                        samples[g].append(flat[first::stride].float().abs())
                    tensors += 1
                    bar.update(1)
    if tensors == 0:
        raise ConfigError(f"--forecast: {checkpoint} holds no floating-point tensors")
    groups = {g: _group(counts[g], samples[g], lr, steps) for g in GROUPS if int(counts[g].sum())}
    total = sum((counts[g] for g in GROUPS), torch.zeros(BINS, dtype=torch.int64))
    overall = _group(total, [s for g in GROUPS for s in samples[g]], lr, steps)
    return Forecast(str(checkpoint), lr, steps, tensors, groups, overall, {g: counts[g].tolist() for g in groups})


def _group(counts: torch.Tensor, samples: list[torch.Tensor], lr: float, steps: int) -> GroupForecast:
    n = int(counts.sum())
    up = half_spacing(torch.arange(EXPONENTS))
    nearest = torch.cat([up, torch.where(torch.arange(EXPONENTS) > 1, up / 2, up)])  # the nearer neighbour
    share = lambda bound: float(counts[nearest < bound].sum()) / n  # noqa: E731
    by_exponent = counts[:EXPONENTS] + counts[EXPONENTS:]
    cum = torch.cumsum(by_exponent, 0)
    median_exponent = int(torch.searchsorted(cum, torch.tensor((n + 1) // 2)))
    return GroupForecast(
        params=n,
        median_abs_weight=float(torch.cat(samples).median()) if samples else 0.0,
        can_move_step1=share(lr),
        can_move_within=share(steps * lr),
        steps_to_move_median=float(up[median_exponent]) / lr,
    )


def table(f: Forecast, measured: Diagnosis | None = None) -> str:
    """The forecast per group; with ``measured`` (the measured diagnosis of the same checkpoint,
    lr and steps) the measured counterparts beside each figure."""
    cols = [
        f"{'group':<11} {'params':>9} {'median|w|':>9}",
        f"{'can move at step 1':>18}",
        f"{f'can move in {f.steps} steps':>19}",
        f"{f'stuck {f.steps} steps':>14}",
        f"{'steps to move median w':>22}",
    ]
    if measured is not None:
        cols[1] += f" {'measured RTN step 1':>19}"
        cols[2] += f" {'measured moved once':>19}"
        cols[4] += f" {'measured':>9}"
    head = " ".join(cols)
    lines = [
        f"forecast: {f.checkpoint} ({f.tensors} tensors), lr {f.lr:g}, {f.steps} steps: from the weights alone "
        "(half the BF16 spacing at each weight against AdamW's early bound of about lr per step)",
        "",
        head,
        "-" * len(head),
    ]
    rows = [*f.groups.items(), ("overall", f.overall)]
    for g, r in rows:
        m = None if measured is None else (measured.overall if g == "overall" else measured.groups.get(g))
        line = f"{g:<11} {r.params / 1e6:>8.1f}M {r.median_abs_weight:>9.4f} {pct(r.can_move_step1):>18}"
        if measured is not None:
            line += f" {pct(m.moved_by_step['rtn'][0]) if m else '-':>19}"
        line += f" {pct(r.can_move_within):>19}"
        if measured is not None:
            line += f" {pct(m.rtn_moved_once) if m else '-':>19}"
        line += f" {pct(r.stuck):>14} {_steps(r.steps_to_move_median):>22}"
        if measured is not None:
            line += f" {_steps(m.rtn_steps_to_move_median) if m else '-':>9}"
        lines.append(line)
    lines += [
        "",
        "predicted figures bound the measured ones: at most as many weights move as can move, and the median "
        "weight needs at least as many steps as predicted",
    ]
    return "\n".join(lines)


def _steps(v: float | None) -> str:
    if v is None or not math.isfinite(v):
        return "never"
    return f"~{v:.3g}"


def write(f: Forecast, out_dir: str | Path, measured: Diagnosis | None = None) -> Path:
    """``forecast.json`` in ``out_dir`` (with the measured diagnosis beside it, if given)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {"forecast": asdict(f), "last_line": f.last_line()}
    if measured is not None:
        data["measured"] = asdict(measured)
    (out / "forecast.json").write_text(json.dumps(data, indent=1, default=str))
    return out / "forecast.json"
