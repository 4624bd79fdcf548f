"""Round where the master lives, then copy to where the working weight lives.

ZeRO with optimizer offload keeps its FP32 masters on the host and the BF16 weights on the
accelerator; ZeRO-3 with parameter offload keeps both on the host; FSDP2's ``CPUOffloadPolicy``
keeps the sharded masters on the host and all-gathers on the accelerator. A rounding job's input
and output share one device (``numerics.rounding`` refuses anything else), so every engine hands
its (FP32 flat, BF16 flat) pairs to one plan here, which decides per pair:

- master and working weight on one device: round straight into the working weight;
- on two devices: round on the master's device (the C++ kernel on the host, Triton on a GPU)
  into a BF16 staging buffer there, then one copy of the BF16 bytes to the working weight (2
  bytes per element over the link, half of what the FP32 master would move), non-blocking from
  pinned memory. The staging buffer is the engine's own where it has one (DeepSpeed's pinned
  BF16 buffer, which DeepSpeed then copies itself), else the plan's (pinned when the copy goes
  to CUDA), kept for the next step and given up by ``release``.

``PlacedRounding.routes`` records the device of every piece, which is how the tests on a machine
without a GPU check the plan for one (a ``meta`` tensor stands for a device without data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from ..numerics import RoundingBatch, RoundingJob


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + numel)`` of a flat partition belong to parameter ``param`` at
    global flat index ``offset``; with ``rows = (row_len, row_stride)`` they are whole rows of a
    column shard (row ``r`` at ``offset + r * row_stride``), else contiguous in the parameter."""

    param: str
    start: int
    numel: int
    offset: int
    rows: tuple[int, int] | None = None


@dataclass
class FlatTransfer:
    """One flat partition: FP32 ``source`` (the masters, 1-D) feeds BF16 ``dest`` (the working
    weights, 1-D, same length) at ``segments``; elements no segment covers (padding) are copied
    as they are when the plan fills gaps. ``staging``: a BF16 buffer on the source's device that
    the engine owns; ``copied_by`` names who moves it to ``dest`` during a step."""

    source: torch.Tensor
    dest: torch.Tensor
    segments: Sequence[Segment]
    staging: torch.Tensor | None = None
    copied_by: str = "dist-sr"


@dataclass(frozen=True)
class Route:
    """Where one parameter's piece is rounded and where its bits go: the devices of the FP32
    master, of the tensor the rounding writes (the master's, always) and of the working weight;
    ``copied_by`` is None when the rounding writes the working weight itself."""

    param: str
    master: str
    rounded_into: str
    working: str
    copied_by: str | None


def gaps(segments: Sequence[Segment], numel: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``range(numel)`` no segment covers."""
    out, cursor = [], 0
    for s in sorted(segments, key=lambda s: s.start):
        if s.start > cursor:
            out.append((cursor, s.start))
        cursor = max(cursor, s.start + s.numel)
    if cursor < numel:
        out.append((cursor, numel))
    return out


def _job(seg: Segment, source: torch.Tensor, target: torch.Tensor) -> RoundingJob:
    x, out = source.narrow(0, seg.start, seg.numel), target.narrow(0, seg.start, seg.numel)
    if seg.rows is None:
        return RoundingJob(seg.param, x, out, seg.offset)
    row_len, row_stride = seg.rows
    return RoundingJob(seg.param, x.view(-1, row_len), out.view(-1, row_len), seg.offset, row_stride)


class PlacedRounding:
    """The keyed rounding of a fixed set of flat partitions, each on its master's device, with the
    copies that bring the bits to the working weights. Built once (it holds views of the
    partitions: rebuild it when a partition's storage is replaced, and ``release`` it before an
    offload so that nothing here keeps the old storage alive).

    ``fill_gaps``: copy uncovered elements as they are (an engine whose own copy this replaces).
    ``non_blocking``: copy from pinned staging without waiting (where the engine's own copy did
    not wait either). ``stage``: round through a staging buffer even where the devices agree
    (tests)."""

    def __init__(
        self,
        transfers: Sequence[FlatTransfer],
        *,
        backend: str = "auto",
        fill_gaps: bool = False,
        non_blocking: bool = True,
        stage: bool = False,
    ):
        self.non_blocking = non_blocking
        jobs: list[RoundingJob] = []
        self._gaps: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (dest, staging)
        self._pending: dict[int, object] = {}  # staging address -> the event its last copy recorded
        routes = {}
        for t in transfers:
            _check(t)
            staged = t.staging is not None or stage or t.source.device != t.dest.device
            target = t.dest
            if staged:
                target = t.staging if t.staging is not None else _staging_for(t.source, t.dest)
                self._copies.append((t.dest, target))
            for seg in t.segments:
                if seg.numel:
                    jobs.append(_job(seg, t.source, target))
                    routes.setdefault(
                        (seg.param, id(t)),
                        Route(
                            seg.param,
                            str(t.source.device),
                            str(target.device),
                            str(t.dest.device),
                            (t.copied_by if t.staging is not None else "dist-sr") if staged else None,
                        ),
                    )
            if fill_gaps:
                self._gaps += [(target[a:b], t.source[a:b]) for a, b in gaps(t.segments, t.source.numel())]
        self.routes: tuple[Route, ...] = tuple(routes.values())
        self._batch = RoundingBatch(jobs, backend=backend)

    @property
    def jobs(self) -> list[RoundingJob]:
        return self._batch.jobs

    def pieces(self) -> Iterator[tuple[str, torch.Tensor, int]]:
        """``(param, FP32 master piece, global offset)``, each contiguous in its parameter (a
        block of whole rows yields a piece per row)."""
        for job in self._batch.jobs:
            if job.row_stride is None:
                yield job.param, job.x, job.offset
            else:
                for r, row in enumerate(job.x):
                    yield job.param, row, job.offset + r * job.row_stride

    def run(self, *, seed: int, step: int, mode: str, copy: bool = True) -> None:
        """Round every piece with the key, fill the gaps, and (``copy``) move every staged
        partition to its working weights; ``copy=False`` leaves that to the engine (DeepSpeed
        copies its own buffer)."""
        for _, staging in self._copies:  # the last copy out of a pinned buffer must be done before it is rewritten
            event = self._pending.pop(staging.data_ptr(), None)
            if event is not None:
                event.synchronize()  # type: ignore[attr-defined]
        self._batch.run(seed=seed, step=step, mode=mode)
        for target, source in self._gaps:
            target.copy_(source)
        if copy:
            self.copy()

    def copy(self) -> None:
        """Copy every staged partition to its working weights (non-blocking from pinned memory)."""
        for dest, staging in self._copies:
            asynchronous = self.non_blocking and dest.is_cuda and staging.is_pinned()
            dest.copy_(staging, non_blocking=asynchronous)
            if asynchronous:
                event = torch.cuda.Event()
                event.record()
                self._pending[staging.data_ptr()] = event

    def release(self) -> None:
        """Drop every tensor the plan holds (views of the partitions, its staging buffers)."""
        self._batch = RoundingBatch([])
        self._gaps, self._copies, self._pending = [], [], {}


def _check(t: FlatTransfer) -> None:
    if t.source.dtype != torch.float32 or t.dest.dtype != torch.bfloat16:
        raise TypeError(f"a flat transfer rounds FP32 into BF16; got {t.source.dtype} -> {t.dest.dtype}")
    if t.source.dim() != 1 or t.dest.shape != t.source.shape:
        raise ValueError(
            f"a flat transfer needs a 1-D source and a destination of its shape; got "
            f"{tuple(t.source.shape)} -> {tuple(t.dest.shape)}"
        )
    if t.staging is not None and (
        t.staging.shape != t.source.shape or t.staging.device != t.source.device or t.staging.dtype != torch.bfloat16
    ):
        raise ValueError(
            f"a staging buffer must be BF16 of the source's shape on its device ({t.source.device}); got "
            f"{t.staging.dtype} {tuple(t.staging.shape)} on {t.staging.device}"
        )


def _staging_for(source: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """A BF16 buffer beside ``source``, pinned when the copy goes from the host to CUDA."""
    pin = source.device.type == "cpu" and dest.device.type == "cuda"
    return torch.empty(source.shape, dtype=torch.bfloat16, device=source.device, pin_memory=pin)
