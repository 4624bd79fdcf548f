"""Fault injection for crash-consistency tests: ``DIST_SR_FAULT=NAME:K`` makes this process
SIGKILL itself the K-th time it reaches ``point(NAME)`` (like a node lost at that instant: no
cleanup, no flush). Unset, a point costs one dictionary lookup.

Points: ``checkpoint.written`` (new checkpoint on disk under a temporary name),
``checkpoint.rotated`` (the old one moved aside, the new one not yet in place),
``checkpoint.done``, ``checkpoint.quarantined`` (a refused checkpoint moved to ``refused/``,
its reason not yet written), ``metrics.written`` (a step's record appended), ``sync.bucket`` (a weight
sync between two buckets), ``materialize.staged`` (a checkpoint written beside OUT, not yet moved there).
"""

from __future__ import annotations

import os
import signal

ENV = "DIST_SR_FAULT"
_hits: dict[str, int] = {}


def point(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, _, count = spec.partition(":")
    if target != name:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
