"""``stochastic_round``: the public FP32 -> BF16 keyed rounding, dispatched to a backend.

Backends give bitwise identical results: ``"reference"`` (pure torch, any device), ``"cpu"`` (the
compiled C++ kernel) and ``"triton"`` (CUDA). ``"auto"`` picks the fastest one available for the
tensor's device; a missing fast path falls back to the reference with a one-time warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from . import cpu_kernel, reference
from .key import check_mode, stream_key

BACKENDS = ("auto", "reference", "cpu", "triton")


@dataclass(frozen=True)
class RoundingJob:
    """One FP32 piece of parameter ``param`` to be rounded into the BF16 tensor ``out`` (same shape).

    By default the piece is elements ``[offset, offset + x.numel())`` of the flattened parameter.
    With ``row_stride``, it is a strided block (a column shard): ``x`` viewed as
    ``[-1, x.shape[-1]]`` has element ``(r, c)`` at global index ``offset + r * row_stride + c``.
    """

    param: str
    x: torch.Tensor
    out: torch.Tensor
    offset: int = 0
    row_stride: int | None = None


def stochastic_round(
    x: torch.Tensor,
    *,
    seed: int,
    step: int,
    param: str,
    offset: int = 0,
    mode: str = "stochastic",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    row_stride: int | None = None,
) -> torch.Tensor:
    """Round FP32 ``x`` to BF16 with random bits keyed by (seed, step, param, element index).

    ``x`` holds elements ``[offset, offset + x.numel())`` of the flattened (row-major) full
    parameter named ``param`` (its state-dict name; wrapper prefixes are ignored). The result
    depends only on those and on ``x``: rounding any split of a parameter piece by piece with
    the right offsets gives the bits of rounding it whole.

    Modes: ``"nearest"`` (round to nearest even, as ``x.to(torch.bfloat16)``), ``"stochastic"``
    (fresh bits every step), ``"dither"`` (bits ignore ``step``). Every NaN becomes the BF16 NaN
    ``0x7FC0``; +-Inf, -0 and subnormals are exact; values beyond the largest finite BF16 round
    to it or to Inf as if Inf were the next BF16 value (``2^128``).

    ``row_stride`` describes a strided shard without copying it (see ``RoundingJob``): a column
    shard ``w[:, c0:c1]`` of a ``[R, C]`` weight is ``offset=c0, row_stride=C``.

    Returns ``out`` (BF16, same shape as ``x``), allocated if not given.
    """
    job = RoundingJob(param, x, _out_for(x, out), offset, row_stride)
    round_jobs([job], seed=seed, step=step, mode=mode, backend=backend)
    return job.out


def round_jobs(
    jobs: Sequence[RoundingJob] | Iterable[RoundingJob],
    *,
    seed: int,
    step: int,
    mode: str = "stochastic",
    backend: str = "auto",
) -> None:
    """Round many pieces at one (seed, step, mode) with as few kernel calls as possible."""
    check_mode(mode)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    keyed = mode != "nearest"
    batches: dict[str, list[tuple[torch.Tensor, torch.Tensor, int | None, int]]] = {"cpu": [], "triton": []}
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    for job in jobs:
        _validate(job)
        key = stream_key(seed=seed, step=step, param=job.param, mode=mode) if keyed else None
        x = job.x.detach().contiguous().view(-1)
        dst = job.out
        if not dst.is_contiguous():
            dst = torch.empty_like(job.out, memory_format=torch.contiguous_format)
            copy_back.append((job.out, dst))
        chosen = _choose(backend, job.param, x.device)
        if job.row_stride is not None and keyed:
            rows = (job.x.shape[-1] if job.x.dim() else 1, job.row_stride)
            if chosen == "cpu":
                cpu_kernel.load().round_rows(x, dst.view(-1), _as_int64(key), job.offset, *rows)
            elif chosen == "triton":
                from . import triton_kernels

                triton_kernels.round_many([x], [dst.view(-1)], [key], [job.offset], rows=[rows])
            else:
                reference.round_into(x, dst.view(-1), key, job.offset, rows)
        elif chosen == "reference":
            reference.round_into(x, dst.view(-1), key, job.offset)
        else:
            batches[chosen].append((x, dst.view(-1), key, job.offset))
    if batches["cpu"]:
        b = batches["cpu"]
        cpu_kernel.load().round_tensors([i[0] for i in b], [i[1] for i in b], keyed,
                                        [_as_int64(i[2]) if keyed else 0 for i in b], [i[3] for i in b])
    if batches["triton"]:
        from . import triton_kernels

        b = batches["triton"]
        triton_kernels.round_many([i[0] for i in b], [i[1] for i in b], [i[2] for i in b], [i[3] for i in b])
    for out, dst in copy_back:
        out.copy_(dst)


_warned_no_triton = False


def triton_available() -> str | None:
    """None if the Triton kernels can be used, else why not."""
    try:
        import triton  # noqa: F401  (availability probe)
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    return None


def _choose(backend: str, param: str, device: torch.device) -> str:
    global _warned_no_triton
    if backend == "reference":
        return "reference"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend 'cpu' needs CPU tensors; {param!r} is on {device}")
        cpu_kernel.load()  # raises KernelUnavailable with the reason
        return "cpu"
    if backend == "triton":
        why = triton_available()
        if why:
            raise RuntimeError(f"backend 'triton' unavailable: {why}")
        return "triton"
    if device.type == "cpu":
        return "cpu" if cpu_kernel.get() is not None else "reference"
    if device.type == "cuda":
        why = triton_available()
        if why is None:
            return "triton"
        if not _warned_no_triton:
            _warned_no_triton = True
            warnings.warn(f"dist_sr: Triton rounding kernel unavailable ({why}); using the pure-torch reference, "
                          "which gives the same bits more slowly", RuntimeWarning, stacklevel=4)
    return "reference"


def _as_int64(key: int) -> int:
    return key - (1 << 64) if key >= 1 << 63 else key


def _out_for(x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if out is None:
        return torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    return out


def _validate(job: RoundingJob) -> None:
    x, out = job.x, job.out
    if x.dtype != torch.float32:
        raise TypeError(
            f"stochastic_round needs a float32 input for {job.param!r}, got {x.dtype}; keep FP32 "
            "shadow weights and round those (a BF16/FP16 tensor has no bits left to round)"
        )
    if out.dtype != torch.bfloat16:
        raise TypeError(f"out for {job.param!r} must be bfloat16, got {out.dtype}")
    if out.shape != x.shape:
        raise ValueError(f"out for {job.param!r} has shape {tuple(out.shape)}, x has {tuple(x.shape)}")
    if out.device != x.device:
        raise ValueError(f"out for {job.param!r} is on {out.device}, x is on {x.device}")
    if job.row_stride is not None:
        row_len = x.shape[-1] if x.dim() else 1
        if not isinstance(job.row_stride, int) or job.row_stride < row_len:
            raise ValueError(f"row_stride for {job.param!r} must be an int >= the row length {row_len}, got {job.row_stride!r}")
    if not isinstance(job.offset, int) or isinstance(job.offset, bool) or job.offset < 0:
        raise ValueError(f"offset for {job.param!r} must be a non-negative int, got {job.offset!r}")
    if job.offset + x.numel() > 1 << 62:
        raise ValueError(f"offset {job.offset} + numel {x.numel()} for {job.param!r} exceeds 2^62 elements")
