"""One attempt at moving a sync plan's buckets: the sending ranks' side (``Sender``: each bucket
dense, or as grid-step deltas against what this rank sent last) and rank 0's calls that take
every member engine through the update around it (``EngineUpdates``: pause, start, the update
on a thread while the buckets go out, then finish and reset the prefix cache).

The engines have at most the last bucket left to load once it is sent: one that has not answered
its update ``timeout_s`` later hangs (stopped, deadlocked) and is left out, not waited for.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ... import faults
from ...numerics import delta as delta_codec
from ...numerics.digest import piece_sums
from ...sources import WeightSource
from ..control import ControlPlane
from ..plan import SyncPlan
from ..transport import Packer, broadcast, send_sized
from .fleet import Failure, Fleet


@dataclass
class Attempt:
    """What one attempt did on this rank: ``ok`` (no failure here), the ``failures``, the bytes
    this rank sent, and the trainer's digest entries ``{name: (dtype, shape, sum)}`` (empty
    without verification)."""

    ok: bool
    failures: list[Failure]
    bytes_sent: int = 0
    entries: dict = field(default_factory=dict)


@dataclass
class Sent:
    """What this rank sent in one attempt: bytes, each tensor's digest sum (with verification),
    the pieces (the next delta base, once the sync completes) and the error that stopped it."""

    nbytes: int = 0
    sums: dict[str, int] = field(default_factory=dict)
    pieces: list = field(default_factory=list)
    error: RuntimeError | None = None


class Sender:
    """One trainer rank's side of the buckets. Every rank takes part (``broadcast`` gathers each
    bucket on every rank, rank 0 sends it; ``shard-direct``: each sending rank sends its own
    pieces). With ``delta`` it keeps a host copy of what it sent (``keep``), the base of the
    next sync's deltas."""

    def __init__(self, source: WeightSource, *, transport: str, rank: int, senders: int, delta: bool):
        self.source, self.transport = source, transport
        self.rank, self.senders = rank, senders
        self.delta = delta
        self.packer = Packer()
        self.base: dict[tuple[str, int], torch.Tensor] = {}  # what this rank last sent, per piece

    def send(self, plan: SyncPlan, group, *, base: int | None, verify: bool, on_bucket=None) -> Sent:
        """Every bucket of ``plan`` through ``group`` (this rank's, when it sends): dense, or as
        deltas against ``base``; ``on_bucket(i, n)`` before each. A ``RuntimeError`` of the
        transport stops it (``Sent.error``)."""
        out = Sent()
        overlap = group is not None and group.backend != "ipc"  # ipc publishes one shared staging buffer
        in_flight = None  # the previous bucket's broadcast: on the wire while this one is packed
        try:
            for index, bucket in enumerate(plan.buckets):
                if on_bucket is not None:
                    on_bucket(index, len(plan.buckets))
                if index:
                    faults.point("sync.bucket")
                names = [t.name for t in bucket.tensors]
                if self.transport == "broadcast":
                    full = self.source.gather(names)  # collective on every rank
                    pieces = [(n, 0, full[n].reshape(-1)) for n in names] if self.rank == 0 else []
                else:
                    pieces = [(p.name, p.start, p.bits) for p in self.source.local_pieces(names) if p.end > p.start]
                work = None
                if self.rank < self.senders:
                    chunks, sized = self._pieces_out(pieces, base)
                    if sized:
                        nbytes, work = send_sized(
                            group, torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
                        )
                    else:
                        buf = self.packer.pack(chunks, bucket.nbytes(self.rank), group, slot=index % Packer.SLOTS)
                        work, nbytes = broadcast(group, buf), buf.numel()
                    out.nbytes += nbytes
                    if self.delta:
                        out.pieces.extend((n, s, bits) for n, s, bits in pieces)
                if verify:  # while the bucket is on the wire (the sums read the pieces, not the buffer)
                    out.sums.update(zip([n for n, _, _ in pieces], piece_sums([(bits, s) for _, s, bits in pieces])))
                if in_flight is not None:  # its staging buffer is the next bucket's
                    in_flight.wait()
                in_flight = work
                if not overlap and work is not None:
                    work.wait()
                    in_flight = None
            if in_flight is not None:
                in_flight.wait()
        except RuntimeError as exc:
            out.error = exc
            if in_flight is not None:  # a retry may refill its buffer: the broadcast ends first
                with contextlib.suppress(RuntimeError):
                    in_flight.wait()
        return out

    def _pieces_out(self, pieces, base: int | None) -> tuple[list[torch.Tensor], bool]:
        """This rank's bucket as buffers to send: the pieces, or their deltas against ``base``."""
        if base is None:
            return [bits for _, _, bits in pieces], False
        blobs = []
        for name, start, bits in pieces:
            blobs.append(
                torch.frombuffer(
                    bytearray(delta_codec.encode(self.base[(name, start)], bits).to_bytes()), dtype=torch.uint8
                )
            )
        return blobs, True

    def keep(self, pieces) -> None:
        """``pieces`` (``Sent.pieces``) are what the engines that complete this sync hold from now on."""
        for name, start, bits in pieces:
            held = self.base.get((name, start))
            if held is None or held.shape != bits.shape or held.dtype != bits.dtype:
                self.base[(name, start)] = bits.detach().clone()
            else:
                held.copy_(bits)


class EngineUpdates:
    """Rank 0: the calls that take each member engine through one attempt's update; every
    failure goes to ``failures`` (the sending ranks' own too, in the order they happened)."""

    def __init__(self, fleet: Fleet, controls: list[ControlPlane], timeout_s: float):
        self.fleet, self.controls, self.timeout_s = fleet, controls, timeout_s
        self.failures: list[Failure] = []
        self.threads = []

    def begin(self, plan: SyncPlan) -> bool:
        """Pause each engine and start its update, then call its ``update`` (the whole plan) on a
        thread of its own; False, with nothing updating, if any engine refused."""
        for c in self.controls:
            try:
                c.pause()
                c.start_update()
            except Exception as exc:  # noqa: BLE001
                self.failures.append(self.fleet.failed(c, exc))
        if self.failures:
            return False
        update_timeout = self.timeout_s * (1 + len(plan.buckets))
        plan_json = plan.to_json()
        for c in self.controls:
            self.threads.append(
                self.fleet.call_async(c, lambda c=c: c.update(plan_json, update_timeout), self.failures)
            )
        return True

    def wait(self) -> None:
        """After the last bucket: each engine's update, ``timeout_s`` for all of them together."""
        deadline = time.monotonic() + self.timeout_s
        for c, t in zip(self.controls, self.threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                self.failures.append(
                    Failure(
                        c.name,
                        f"{c.name}: no answer to its update {self.timeout_s:.0f} s after the last bucket was "
                        "sent (the engine hangs); left out of this sync",
                    )
                )

    def finish(self, version: int) -> None:
        """Every engine updated: each finishes ``version`` and drops its prefix cache."""
        for c in self.controls:
            try:
                c.finish(version)
                c.reset_cache()
            except Exception as exc:  # noqa: BLE001
                self.failures.append(self.fleet.failed(c, exc))
