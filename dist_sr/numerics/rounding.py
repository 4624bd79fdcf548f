"""``stochastic_round``: the public FP32 -> BF16 keyed rounding, dispatched to a backend
(``numerics.backends``: every backend gives the reference's bits; ``"auto"`` picks the fastest
one for the tensor's device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from . import backends
from .key import check_mode, signed64, stream_key, stream_keys

BACKENDS = backends.names()  # the names a user may pass; see numerics.backends


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
    check_mode(mode)
    backends.check_name(backend)
    if row_stride is None and _plain(x, out, offset):  # the common call: a few attribute reads, then the launch
        if out is None:
            out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
        key = None if mode == "nearest" else signed64(stream_key(seed=seed, step=step, param=param, mode=mode))
        src = x.detach() if x.requires_grad else x
        chosen = backends.choose(backend, param, x.device)
        if chosen.shaped or src.dim() == 1:
            chosen.round_one(src, out, key, offset, None)
        else:
            chosen.round_one(src.view(-1), out.view(-1), key, offset, None)
        return out
    if out is not None and isinstance(x, torch.Tensor) and overlaps(x, out):  # round first, then write
        return out.copy_(
            stochastic_round(
                x, seed=seed, step=step, param=param, offset=offset, mode=mode, backend=backend, row_stride=row_stride
            )
        )
    job = RoundingJob(param, x, _out_for(x, out), offset, row_stride)
    _validate(job)
    if x.numel() == 0:
        return job.out
    # one tensor: no batch, no table, no upload (the key travels as a kernel argument)
    key = None if mode == "nearest" else signed64(stream_key(seed=seed, step=step, param=param, mode=mode))
    src = x.detach().contiguous().view(-1)
    dst = job.out if job.out.is_contiguous() else torch.empty_like(job.out, memory_format=torch.contiguous_format)
    backends.choose(backend, param, x.device).round_one(src, dst.view(-1), key, offset, _rows(job))
    if dst is not job.out:
        job.out.copy_(dst)
    return job.out


def round_jobs(
    jobs: Sequence[RoundingJob] | Iterable[RoundingJob],
    *,
    seed: int,
    step: int,
    mode: str = "stochastic",
    backend: str = "auto",
) -> None:
    """Round many pieces at one (seed, step, mode): one kernel call per backend for all of them
    (one C++ call for CPU tensors, one Triton launch for CUDA tensors; strided shards each their
    own). Code that rounds the same pieces every step keeps a ``RoundingBatch`` instead."""
    RoundingBatch(jobs, backend=backend).run(seed=seed, step=step, mode=mode)


class RoundingBatch:
    """A fixed list of pieces rounded again and again (an optimizer's working weights, a
    DeepSpeed partition). Checked and prepared once; ``run`` does O(pieces) host work (the keys
    and the pieces' addresses, to notice a tensor whose storage was replaced), one kernel call
    per backend, and never reads a device value back.

    Backends read ``xs``/``outs`` (flat, contiguous), ``offsets``, ``rows``, ``names`` and keep
    their launch state in ``launches``."""

    def __init__(self, jobs: Sequence[RoundingJob] | Iterable[RoundingJob], *, backend: str = "auto"):
        self.jobs = list(jobs)
        self.backend = backends.check_name(backend)
        for job in self.jobs:
            _validate(job)
        self.names = [job.param for job in self.jobs]
        self.offsets = [job.offset for job in self.jobs]
        self.rows = [_rows(job) for job in self.jobs]
        self._tensors = [t for job in self.jobs for t in (job.x, job.out)]
        self._prepare()

    def _addresses(self) -> list[int]:
        """Every piece's input and output address (one C-level pass: checked on every ``run``)."""
        return list(map(torch.Tensor.data_ptr, self._tensors))

    def _prepare(self) -> None:
        self._seen = self._addresses()
        self.xs, self.outs, self._copy_back = [], [], []
        self._by_backend: dict[str, list[int]] = {}
        with torch.no_grad():
            for i, job in enumerate(self.jobs):
                self.xs.append(job.x.detach().contiguous().view(-1))
                dst = job.out
                if not dst.is_contiguous():
                    dst = torch.empty_like(job.out, memory_format=torch.contiguous_format)
                    self._copy_back.append((job.out, dst))
                self.outs.append(dst.view(-1))
                chosen = backends.choose(self.backend, job.param, self.xs[i].device)
                self._by_backend.setdefault(chosen.name, []).append(i)
        self._contiguous_x = all(job.x.is_contiguous() for job in self.jobs)
        self.launches: dict = {}

    def run(self, *, seed: int, step: int, mode: str = "stochastic") -> None:
        check_mode(mode)
        if not self.jobs:
            return
        if not self._contiguous_x or self._addresses() != self._seen:
            self._prepare()  # a non-contiguous input is copied afresh; a replaced storage is re-read
        keys = None
        for name, idx in self._by_backend.items():
            backend = backends.get(name)
            if mode != "nearest" and backend.device_keys:  # hashed on the device: no per-name host work
                backend.round_batch(self, idx, backends.KeyStep(seed, step, mode))
                continue
            if keys is None and mode != "nearest":
                keys = stream_keys(self.names, seed=seed, step=step, mode=mode)
            backend.round_batch(self, idx, keys)
        for out, dst in self._copy_back:
            out.copy_(dst)

    def run_on_device(self, device_step: backends.DeviceStep) -> None:
        """Round with the keys of step ``device_step.counter + 1``, derived on the device (CUDA,
        Triton backend, contiguous pieces): a step captured in a CUDA graph replays with the keys
        of the step it replays."""
        if (
            not all(backends.get(n).device_keys for n in self._by_backend)
            or any(r is not None for r in self.rows)
            or self._copy_back
        ):
            raise ValueError(
                "rounding with keys derived on the device needs contiguous pieces on a backend that "
                f"derives keys on the device (Triton, CUDA); got {sorted(self._by_backend)}"
            )
        if self._addresses() != self._seen:
            self._prepare()
        for name, idx in self._by_backend.items():
            backends.get(name).round_batch(self, idx, None, device_step)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` intersect (same storage, overlapping bytes)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        extent = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1
        return t.data_ptr(), t.data_ptr() + extent * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _plain(x, out: torch.Tensor | None, offset) -> bool:
    """Whether a call needs none of the general path's handling: a non-empty contiguous FP32
    ``x`` at a valid offset, and ``out`` absent or a contiguous BF16 tensor of its shape, on its
    device, sharing no bytes with it. Anything else takes the general path, which checks and
    explains (the bits are the same either way)."""
    if not (
        isinstance(x, torch.Tensor)
        and x.dtype is torch.float32
        and x.is_contiguous()
        and type(offset) is int
        and offset >= 0
    ):
        return False
    n = x.numel()
    if n == 0 or offset + n > 1 << 62:
        return False
    if out is None:
        return True
    if not (
        isinstance(out, torch.Tensor)
        and out.dtype is torch.bfloat16
        and out.is_contiguous()
        and out.shape == x.shape
        and out.device == x.device
    ):
        return False
    xp, op = x.data_ptr(), out.data_ptr()
    return xp + 4 * n <= op or op + 2 * n <= xp  # disjoint bytes (contiguous spans)


def _rows(job: RoundingJob) -> tuple[int, int] | None:
    return None if job.row_stride is None else (job.x.shape[-1] if job.x.dim() else 1, job.row_stride)


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
            raise ValueError(
                f"row_stride for {job.param!r} must be an int >= the row length {row_len}, got {job.row_stride!r}"
            )
    if not isinstance(job.offset, int) or isinstance(job.offset, bool) or job.offset < 0:
        raise ValueError(f"offset for {job.param!r} must be a non-negative int, got {job.offset!r}")
    if overlaps(x, out):
        raise ValueError(
            f"out for {job.param!r} overlaps its input x in memory; give it a separate tensor "
            "(stochastic_round handles an overlapping out by rounding first)"
        )
    if job.offset + x.numel() > 1 << 62:
        raise ValueError(f"offset {job.offset} + numel {x.numel()} for {job.param!r} exceeds 2^62 elements")
