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


def _unverified(e, reports: list[dict], version: int, entries: dict | None, expected: dict | None) -> str:
    """Why engine ``e`` is not verified after sync ``version`` ("" when it is): a worker that did
    not report, a worker whose received digests are not the trainer's (named), a worker that did
    not complete the sync; then what the workers hold, read back from their parameters, where the
    engine's control plane can ask (``held_problem``)."""
    if e.workers and len(reports) != e.workers:
        return (
            f"{len(reports)} of its {e.workers} workers reported after sync {version}: the others are not verified "
            "(a data-parallel engine its server did not ask?)"
        )
    if expected is not None:
        bad = {r.get("rank"): differing([r], expected) for r in reports}
        bad = {rank: names for rank, names in bad.items() if names}
        if bad:
            rank, names = next(iter(bad.items()))
            more = f" (and {len(bad) - 1} more worker(s))" if len(bad) > 1 else ""
            return (
                f"weights differ from the trainer's after sync {version}: worker rank {rank}{more}: "
                f"{names[:8]}{' ...' if len(names) > 8 else ''}"
            )
    stale = [r.get("rank") for r in reports if str(r.get("version")) != str(version) or not r.get("complete")]
    if stale:
        return f"workers {stale} did not complete sync {version}"
    held_problem = getattr(e.control, "held_problem", None)
    if entries is not None and held_problem is not None:
        return held_problem(entries) or ""
    return ""


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
        try:
            e.reason = _unverified(e, reports, version, entries, expected)
        except Exception as exc:  # noqa: BLE001  (a held-weights answer that is not one: the engine is down)
            e.state, e.reason = state_after(exc), fleet.failed(e.control, exc).reason
            problems.append(e.reason)
            continue
        if e.reason:
            e.state = State.PENDING
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
