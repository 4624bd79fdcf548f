"""Whether the engines hold what the trainer sent: after a sync, each engine's report against the
trainer's digest entries (``verify_engines``: only matching engines are resumed and marked
ready); after rollouts, whether an engine is still the one that was verified
(``changed_engines``: a restart or any control event since shows in its workers' ``mark``).
"""

from __future__ import annotations

import logging
from typing import Sequence

from .fleet import Failure, Fleet, State, state_after

log = logging.getLogger(__name__)


def mark(reports: list[dict]) -> list:
    """Who the workers are now: each one's (rank, boot id, control events)."""
    # ordered by repr: a worker not yet in a group reports rank None beside others' integers
    return sorted(([r.get("rank"), r.get("boot"), r.get("events")] for r in reports), key=repr)


def differing(reports: list[dict], expected: dict) -> list[str]:
    """The tensors whose digest in any worker's report is not the trainer's (or is on one side only)."""
    return sorted(
        {
            n
            for r in reports
            for n in set(expected) | set(r.get("digests", {}))
            if r.get("digests", {}).get(n) != expected.get(n)
        }
    )


def verify_engines(
    fleet: Fleet, urls: Sequence[str], version: int, entries: dict | None
) -> tuple[list[str], list[str]]:
    """Rank 0: the report of each member engine (of ``urls``, not down) against the trainer's
    digest entries (``None``: only that the engine completed ``version``); only matching engines
    are resumed and marked ready. Returns (ready URLs, problems)."""
    expected = None if entries is None else {n: [d, list(s), f"{v:016x}"] for n, (d, s, v) in entries.items()}
    ready, problems = [], []
    for e in fleet.engines:
        if e.state == State.DOWN or e.url not in urls:
            continue
        try:
            reports = e.control.report()
        except Exception as exc:  # noqa: BLE001  (a report that is not one: the engine is down)
            e.state, e.reason = state_after(exc), fleet.failed(e.control, exc).reason
            problems.append(e.reason)
            continue
        bad = [] if expected is None else differing(reports, expected)
        stale = [r.get("rank") for r in reports if str(r.get("version")) != str(version) or not r.get("complete")]
        if bad or stale:
            e.state = State.PENDING
            e.reason = (
                f"weights differ from the trainer's after sync {version}: {bad[:8]}{' ...' if len(bad) > 8 else ''}"
                if bad
                else f"workers {stale} did not complete sync {version}"
            )
            problems.append(f"{e.url}: {e.reason}")
            log.error("engine %s gets no rollouts: %s", e.url, e.reason)
            continue
        try:
            e.control.resume()
        except Exception as exc:  # noqa: BLE001
            e.state, e.reason = state_after(exc), fleet.failed(e.control, exc).reason
            problems.append(e.reason)
            continue
        e.state, e.version, e.reason = State.READY, version, ""
        e.mark = mark(reports)
        held = {r.get("held") for r in reports}
        e.held = held.pop() if len(held) == 1 else None
        ready.append(e.url)
    return ready, problems


def changed_engines(fleet: Fleet, urls: Sequence[str], marks: dict, version: int | None) -> list[str]:
    """Any trainer rank: the engines of ``urls`` that are no longer exactly what sync ``version``
    verified (``marks``: url -> its ``mark`` then; an engine that does not answer counts as
    changed), each with the reason."""
    problems = []
    for url in urls:
        try:
            reports = fleet.control(url).report()
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{url}: {Failure.of(fleet.control(url), exc).reason}")
            continue
        if mark(reports) != marks.get(url):
            problems.append(f"{url}: restarted or changed by a control event after weight sync {version} was verified")
    return problems
