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
from .key import check_mode, signed64, stream_key, stream_keys

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
    check_mode(mode)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    job = RoundingJob(param, x, _out_for(x, out), offset, row_stride)
    _validate(job)
    if x.numel() == 0:
        return job.out
    # one tensor: no batch, no table, no upload (the key travels as a kernel argument)
    key = None if mode == "nearest" else signed64(stream_key(seed=seed, step=step, param=param, mode=mode))
    src = x.detach().contiguous().view(-1)
    dst = job.out if job.out.is_contiguous() else torch.empty_like(job.out, memory_format=torch.contiguous_format)
    _ROUND_ONE[choose_backend(backend, param, x.device)](src, dst.view(-1), key, offset, _rows(job))
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
    per backend, and never reads a device value back."""

    def __init__(self, jobs: Sequence[RoundingJob] | Iterable[RoundingJob], *, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        self.jobs = list(jobs)
        self.backend = backend
        for job in self.jobs:
            _validate(job)
        self.names = [job.param for job in self.jobs]
        self._prepare()

    def _addresses(self) -> list[int]:
        return [t.data_ptr() for job in self.jobs for t in (job.x, job.out)]

    def _prepare(self) -> None:
        self._seen = self._addresses()
        self.xs, self.outs, self._copy_back = [], [], []
        self._by_backend: dict[str, list[int]] = {}
        for i, job in enumerate(self.jobs):
            self.xs.append(job.x.detach().contiguous().view(-1))
            dst = job.out
            if not dst.is_contiguous():
                dst = torch.empty_like(job.out, memory_format=torch.contiguous_format)
                self._copy_back.append((job.out, dst))
            self.outs.append(dst.view(-1))
            self._by_backend.setdefault(choose_backend(self.backend, job.param, self.xs[i].device), []).append(i)
        self._contiguous_x = all(job.x.is_contiguous() for job in self.jobs)
        self._launches: dict[str, object] = {}

    def run(self, *, seed: int, step: int, mode: str = "stochastic") -> None:
        check_mode(mode)
        if not self.jobs:
            return
        if not self._contiguous_x or self._addresses() != self._seen:
            self._prepare()  # a non-contiguous input is copied afresh; a replaced storage is re-read
        keys = stream_keys(self.names, seed=seed, step=step, mode=mode) if mode != "nearest" else None
        for chosen, idx in self._by_backend.items():
            _BACKEND_ROUNDERS[chosen](self, idx, keys)
        for out, dst in self._copy_back:
            out.copy_(dst)


    def run_on_device(self, device_step) -> None:
        """Round with the keys of step ``device_step.counter + 1``, derived on the device (CUDA,
        Triton backend, contiguous pieces): a step captured in a CUDA graph replays with the keys
        of the step it replays."""
        odd = set(self._by_backend) - {"triton"}
        if odd or any(job.row_stride is not None for job in self.jobs) or self._copy_back:
            raise ValueError("rounding with keys derived on the device needs contiguous CUDA pieces on the Triton "
                             f"backend (got backends {sorted(set(self._by_backend))})")
        if self._addresses() != self._seen:
            self._prepare()
        _round_triton(self, self._by_backend.get("triton", []), None, device_step)


def _rows(job: RoundingJob) -> tuple[int, int] | None:
    return None if job.row_stride is None else (job.x.shape[-1] if job.x.dim() else 1, job.row_stride)


def _round_reference(batch: RoundingBatch, idx, keys) -> None:
    for i in idx:
        job = batch.jobs[i]
        reference.round_into(batch.xs[i], batch.outs[i], None if keys is None else int(keys[i]) % (1 << 64),
                             job.offset, _rows(job))


def _round_cpu(batch: RoundingBatch, idx, keys) -> None:
    kernel = cpu_kernel.load()
    flat = []
    for i in idx:
        rows = _rows(batch.jobs[i])
        if rows is not None and keys is not None:
            kernel.round_rows(batch.xs[i], batch.outs[i], int(keys[i]), batch.jobs[i].offset, *rows)
        else:
            flat.append(i)
    if flat:
        kernel.round_tensors([batch.xs[i] for i in flat], [batch.outs[i] for i in flat], keys is not None,
                             [] if keys is None else keys[flat].tolist(), [batch.jobs[i].offset for i in flat])


def _round_triton(batch: RoundingBatch, idx, keys, device_step=None) -> None:
    from . import triton_launch

    flat = []
    for i in idx:
        rows = _rows(batch.jobs[i])
        if rows is not None and keys is not None:
            triton_launch.round_one(batch.xs[i], batch.outs[i], int(keys[i]), batch.jobs[i].offset, rows)
        else:
            flat.append(i)
    if not flat:
        return
    launch = batch._launches.get(("triton", tuple(flat)))
    if launch is None:
        launch = triton_launch.SRLaunch([batch.xs[i] for i in flat], [batch.outs[i] for i in flat],
                                        [batch.jobs[i].offset for i in flat])
        batch._launches[("triton", tuple(flat))] = launch
    if device_step is not None:
        launch(None, device_step, [batch.names[i] for i in flat])
    else:
        launch(None if keys is None else keys[flat])


_BACKEND_ROUNDERS = {"reference": _round_reference, "cpu": _round_cpu, "triton": _round_triton}


def _one_reference(x, out, key, offset, rows) -> None:
    reference.round_into(x, out, None if key is None else key % (1 << 64), offset, rows)


def _one_cpu(x, out, key, offset, rows) -> None:
    kernel = cpu_kernel.load()
    if rows is not None and key is not None:
        kernel.round_rows(x, out, key, offset, *rows)
    else:
        kernel.round_tensor(x, out, key is not None, 0 if key is None else key, offset)


def _one_triton(x, out, key, offset, rows) -> None:
    from . import triton_launch

    triton_launch.round_one(x, out, key, offset, rows)


_ROUND_ONE = {"reference": _one_reference, "cpu": _one_cpu, "triton": _one_triton}


_warned_no_triton = False


def triton_available() -> str | None:
    """None if the Triton kernels can be used, else why not."""
    try:
        import triton  # noqa: F401  (availability probe)
    except ImportError as exc:
        return f"triton is not installed ({exc})"
    return None


def choose_backend(backend: str, param: str, device: torch.device) -> str:
    """The backend that rounds ``param``'s tensors on ``device`` under the user's choice ``backend``."""
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
