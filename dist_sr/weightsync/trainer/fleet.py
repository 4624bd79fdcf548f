"""The rollout engines as a weight sync sees them: each one's ``State``, its ``Member`` record,
and a ``Failure`` named with the engine it belongs to.

An engine is ``new`` until it first answers, then ``pending`` (a member of the transfer groups,
waiting for weights the trainer verified on it), ``ready`` once its digests matched (only ready
engines get rollouts), and ``down`` when it does not answer or failed a sync; a down engine that
answers again is pending (a restart: it waits for the current weights). An engine that refused a
call (an HTTP error) stays pending; one whose reply was not an answer (``MalformedReply``), or
whose control plane raised anything else, is down, and stays down for the rest of the sync.
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass
from typing import Sequence

from ..control import ControlPlane, EngineError, MalformedReply

log = logging.getLogger(__name__)


class State(str, enum.Enum):
    """Where an engine stands (a ``str``: it compares equal to its value, e.g. ``"ready"``)."""

    NEW = "new"  # not probed yet
    PENDING = "pending"  # answers; gets no rollouts until a sync is verified on it
    READY = "ready"  # holds the weights the last sync verified: gets rollouts
    DOWN = "down"  # does not answer, or failed this sync


@dataclass(frozen=True)
class Failure:
    """One failure of a sync attempt: ``url`` the engine it belongs to (None: a trainer rank's
    own), ``reason`` the line reported, starting with the engine's name (or ``trainer rank N``)."""

    url: str | None
    reason: str

    @classmethod
    def of(cls, control: ControlPlane, exc: Exception) -> Failure:
        """An engine's failure: an ``EngineError`` names the engine already; anything else a
        control plane raised is named with its type."""
        line = str(exc) if isinstance(exc, EngineError) else f"{control.name}: {type(exc).__name__}: {exc}"
        return cls(control.name, line)

    @classmethod
    def of_trainer(cls, rank: int, exc: Exception) -> Failure:
        return cls(None, f"trainer rank {rank}: {exc}")


def state_after(exc: Exception) -> State:
    """An engine that refused a call (an HTTP error) stays a member, waiting for the next sync
    (``pending``); one whose reply was not an answer, or that failed otherwise, is ``down``."""
    return State.PENDING if isinstance(exc, EngineError) and not isinstance(exc, MalformedReply) else State.DOWN


@dataclass
class Member:
    """One rollout engine as the sync sees it."""

    control: ControlPlane
    workers: int = 0  # TP * PP (* DP): members of the transfer groups
    state: State = State.NEW
    version: int | None = None  # last weight version verified on this engine
    reason: str = ""  # why it is not ready
    mark: list | None = None  # each worker's (rank, boot, events) when its digests were verified
    held: int | None = None  # the version every worker says it keeps (a delta's base), if any

    @property
    def url(self) -> str:
        return self.control.name


class Fleet:
    """The engines of one trainer's sync (every trainer rank holds the list; rank 0's view is
    authoritative, and the others follow the decisions it broadcasts)."""

    def __init__(self, controls: Sequence[ControlPlane]):
        self.engines = [Member(c) for c in controls]
        self.unanswered: set[str] = set()  # rank 0: engines whose replies were not answers, this sync

    def start_sync(self) -> None:
        self.unanswered = set()

    def failed(self, control: ControlPlane, exc: Exception) -> Failure:
        """Rank 0: an engine's failure; an engine whose reply was not an answer stays down for
        the rest of this sync (its retries go on without it)."""
        if state_after(exc) == State.DOWN:
            self.unanswered.add(control.name)
        return Failure.of(control, exc)

    def probe(self) -> None:
        """Rank 0: which engines answer, and how many workers each has (those whose replies were
        not answers in this sync stay down until the next)."""
        for e in self.engines:
            if e.url in self.unanswered:
                e.state = State.DOWN
                continue
            try:
                e.control.health()
                if e.state in (State.NEW, State.DOWN) or not e.workers:  # a restarted engine may have a new TP size
                    e.workers = e.control.world_size()
                if e.state == State.DOWN:
                    e.state, e.reason = State.PENDING, "restarted: waits for the current weights"
                elif e.state == State.NEW:
                    e.state = State.PENDING
            except Exception as exc:  # noqa: BLE001  (whatever an engine's answer did, it is down: named)
                reason = self.failed(e.control, exc).reason
                if e.state != State.DOWN:
                    log.warning("engine %s is down: %s", e.url, reason)
                e.state, e.reason = State.DOWN, reason

    def live(self) -> list[tuple[str, int]]:
        """Rank 0: ``(url, workers)`` of every engine that is not down, the transfer groups' members."""
        return [(e.url, e.workers) for e in self.engines if e.state != State.DOWN]

    def drop(self, failures: Sequence[Failure]) -> None:
        """Rank 0: each engine named by a failure is down, with its failures as the reason."""
        for e in self.engines:
            reasons = [f.reason for f in failures if f.url == e.url]
            if reasons:
                e.state, e.reason = State.DOWN, "; ".join(reasons)[:2000]

    def control(self, url: str) -> ControlPlane:
        return next(e.control for e in self.engines if e.url == url)

    def call_async(self, control: ControlPlane, call, failures: list[Failure]) -> threading.Thread:
        """Rank 0: ``call()`` on a thread of its own (started); its failure, if any, goes to ``failures``."""

        def run():
            try:
                call()
            except Exception as exc:  # noqa: BLE001  (an engine's failure, named, whatever its kind)
                failures.append(self.failed(control, exc))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t
