"""Every rank of a DeepSpeed job agrees on how its BF16 weights are rounded, before the first step.

At each ``deepspeed.initialize`` that dist-sr's start-up hook sees (on or off, SR asked or not),
every rank posts its ``Record`` (seed, mode, whether SR attaches, dist-sr's version; its host and
hook state to name it) in the job's rendezvous store and reads every other rank's
(``collectives.posted``: a store exchange, not a collective, so a rank that runs no dist-sr code
cannot hang it or pair with it). The job stops, on every rank that sees it, naming the ranks and
the fix, when:

- the ranks disagree on (seed, mode, attached, version): a node the switch (``DIST_SR_SEED``) did
  not reach, one with another seed, mode or dist-sr, one with the hook turned off;
- a rank posts nothing within ``DIST_SR_AGREE_TIMEOUT`` seconds (default 120) while a rank asks for
  SR: it called ``deepspeed.initialize`` without dist-sr's hook (dist-sr not installed in its
  environment, or its ``.pth`` not processed) and would round to nearest.

A rank that posts nothing while no rank asks for SR is logged, and the job goes on.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
from dataclasses import asdict, dataclass

from ...collectives import posted, rank
from ...config import ConfigError, Refusal
from .config import MODE_ENV, SEED_ENV, SRConfig

log = logging.getLogger("dist_sr.deepspeed")
TIMEOUT_ENV = "DIST_SR_AGREE_TIMEOUT"
TIMEOUT_S = 120.0
_calls = itertools.count()  # every rank counts the initialize calls it sees, in the same order


class RanksDisagree(Refusal, RuntimeError):
    what = "ranks disagree"


@dataclass(frozen=True)
class Record:
    """What one rank will do at this ``deepspeed.initialize``."""

    rank: int
    host: str
    seed: int | None  # None: this rank is not asked for SR
    mode: str | None
    attached: bool  # SR will be attached to this engine (asked, and the engine trains)
    version: str  # dist-sr's
    hook: str  # "on", or why it is off

    @property
    def agreed(self) -> tuple:
        return (self.seed, self.mode, self.attached, self.version)

    def describe(self) -> str:
        if self.seed is None:
            sr = f'no SR asked ({SEED_ENV} unset, no "stochastic_rounding" block)'
        else:
            sr = f"SR seed {self.seed}, mode {self.mode}" + ("" if self.attached else ", not attached")
        return f"{sr}, dist-sr {self.version}, hook {self.hook}"


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("dist-sr")
    except PackageNotFoundError:
        return "unknown"


def timeout_s(env=None) -> float:
    env = os.environ if env is None else env
    raw = env.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: give the seconds a rank waits for the others (e.g. 120)")
    return value


def agree(sr: SRConfig | None, *, attached: bool = False, hook: str = "on") -> list[Record]:
    """Post this rank's record for this ``deepspeed.initialize`` and check every rank's (call it on
    every rank, after DeepSpeed built the engine and before SR is attached); returns the records,
    or raises ``RanksDisagree``."""
    n = next(_calls)
    mine = Record(
        rank=rank(),
        host=socket.gethostname(),
        seed=None if sr is None else sr.seed,
        mode=None if sr is None else sr.mode,
        attached=attached,
        version=version(),
        hook=hook,
    )
    wait = timeout_s()
    found = posted(f"dist_sr/agree/{n}", asdict(mine), wait)
    records = [None if r is None else Record(**r) for r in found]
    problem = disagreement(records, wait)
    if problem is not None:
        raise RanksDisagree(problem)
    missing = [r for r, rec in enumerate(records) if rec is None]
    if missing:
        log.warning(
            "dist-sr: ranks %s posted no record within %.0f s (no dist-sr hook there); no rank asks for SR",
            _ranks(missing),
            wait,
        )
    return [rec for rec in records if rec is not None]


def disagreement(records: list[Record | None], wait: float) -> str | None:
    """What is wrong with these ranks' records (None: a rank posted none), in words with the fix;
    None when every rank agrees, or when no rank asks for SR and only posts are missing."""
    present = [r for r in records if r is not None]
    missing = [i for i, r in enumerate(records) if r is None]
    asks = any(r.seed is not None for r in present)
    groups: dict[tuple, list[Record]] = {}
    for r in present:
        groups.setdefault(r.agreed, []).append(r)
    if not asks or (len(groups) == 1 and not missing):
        return None  # nobody asks for SR: every rank rounds to nearest, alike
    lines = [
        "dist-sr: the ranks of this DeepSpeed job do not agree on how the BF16 weights are rounded (some would "
        "train with keyed SR, others round-to-nearest or with another key); stopped before the first step:"
    ]
    for recs in groups.values():
        hosts = sorted({r.host for r in recs})
        lines.append(f"  rank {_ranks([r.rank for r in recs])} (host {', '.join(hosts)}): {recs[0].describe()}")
    if missing:
        lines.append(
            f"  rank {_ranks(missing)}: posted nothing within {wait:.0f} s: it called deepspeed.initialize "
            "without dist-sr's start-up hook"
        )
    lines.append("Fix: " + " ".join(_fixes(present, missing)))
    return "\n".join(lines)


def _fixes(present: list[Record], missing: list[int]) -> list[str]:
    fixes = []
    sr = [r for r in present if r.seed is not None]
    without = [r.rank for r in present if r.seed is None]
    if sr and without:
        fixes.append(
            f"{SEED_ENV} (or the JSON's block) reached rank {_ranks([r.rank for r in sr])} but not rank "
            f"{_ranks(without)}. Set it once where you launch and run the `deepspeed` launcher from an "
            f"environment with dist-sr installed (its hook adds {SEED_ENV} and {MODE_ENV} to what the launcher "
            f"exports to every node), or list {SEED_ENV}={sr[0].seed} in the .deepspeed_env where you launch, or "
            'put the "stochastic_rounding" block in the DeepSpeed JSON every rank reads.'
        )
    if len({(r.seed, r.mode) for r in sr}) > 1:
        fixes.append(
            f"The ranks asking for SR have different seeds or modes: set {SEED_ENV}/{MODE_ENV} once, where you "
            "launch, and not in a node's own environment."
        )
    if len({r.version for r in present}) > 1:
        fixes.append("Install the same dist-sr version on every node.")
    off = [r.rank for r in present if r.hook != "on"]
    if off:
        fixes.append(f"Unset DIST_SR_DEEPSPEED_HOOK for rank {_ranks(off)}.")
    if missing:
        fixes.append(
            f"On the node(s) of rank {_ranks(missing)}, run `dist-sr doctor` in the environment the job runs in, "
            "and pip install dist-sr (the same version) there: its wheel ships the start-up hook."
        )
    if not fixes:
        fixes.append("Make every rank's record above the same.")
    return fixes


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, ranks = [], sorted(ranks)
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)
