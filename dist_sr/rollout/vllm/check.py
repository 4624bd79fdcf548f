"""Trainer side of the held-weights check: does every worker of an engine hold the bits the
trainer meant it to hold, tensor by tensor?

The workers' ``dist_sr_held_weights`` answers (``held.report``) are compared with the trainer's
digest entries (``{name: (dtype, shape, sum)}``: the keyed BF16 working weights, summed from the
FP32 masters on every trainer rank, not from what was sent, so an exporter that pushed a master
cast to nearest is caught). Per tensor, the strongest evidence available decides:

- **held**: the elements read back from the parameters, combined over the workers (replicas must
  agree, tensor-parallel slices must cover every element once), equal the trainer's;
- **as loaded**: the tensor could not be read back on any worker (a repacked CPU linear, a name
  the model maps elsewhere), but every worker was handed exactly the trainer's bits;
- otherwise it is a problem, named: never loaded, handed other bits (the transfer or the
  exporter changed them), held other values than handed (the load dropped or changed it), held
  only partly (a loader took the wrong slice, a stage dropped a layer), replicas that disagree.

An engine started from dummy weights that no push has reached says so ("no weights from the
trainer yet"), and is never reported verified.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...config import ConfigError, Refusal
from .readback import combine_readbacks

Entries = dict[str, tuple[str, tuple[int, ...], int]]
WAITING = "no weights from the trainer yet"
VERIFY_ENV = "DIST_SR_VERIFY"  # what a failed check does in a peer's loop: "stop" (default) or "warn"


def verify_mode(env=None) -> str:
    """``DIST_SR_VERIFY``: ``stop`` (a failed check stops the step, the default) or ``warn``."""
    raw = (os.environ if env is None else env).get(VERIFY_ENV, "stop").strip().lower() or "stop"
    if raw not in ("stop", "warn"):
        raise ConfigError(
            f"{VERIFY_ENV}={raw!r}: say 'stop' (a rollout engine that does not hold the trainer's bits stops "
            "the step) or 'warn' (log it and train on)"
        )
    return raw


class HeldWeightsMismatch(Refusal, RuntimeError):
    """An engine does not hold the trainer's bits; the message names the engine and tensors."""

    what = "held weights differ"


@dataclass(frozen=True)
class Problem:
    tensor: str
    reason: str


@dataclass(frozen=True)
class EngineCheck:
    """One engine's answer to "do you hold what the trainer holds?"."""

    engine: str
    held: tuple[str, ...]  # verified by reading the parameters back
    as_loaded: dict[str, str]  # verified only as handed to load_weights: tensor -> why not read back
    problems: tuple[Problem, ...]
    workers: int
    start: str  # the load format the engine started from (e.g. "dummy", "auto")
    waiting: bool = False  # started from dummy weights and no push reached it
    unanswered: str | None = None  # workers of the engine that did not answer (``answered_by_every_worker``)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.waiting and self.unanswered is None

    def summary(self) -> str:
        return f"{self.engine}: {self.detail()}"

    def detail(self) -> str:
        """The summary without the engine's name."""
        if self.unanswered is not None:
            return self.unanswered
        if self.waiting:
            return f"{WAITING} (started with load format {self.start!r}, nothing pushed)"
        if self.problems:
            first = "; ".join(f"{p.tensor}: {p.reason}" for p in self.problems[:3])
            return (
                f"{len(self.problems)} tensor(s) not held as the trainer holds them "
                f"({first}{'; ...' if len(self.problems) > 3 else ''})"
            )
        return (
            f"verified {len(self.held) + len(self.as_loaded)} tensors on {self.workers} worker(s): "
            f"{len(self.held)} read back from the parameters, {len(self.as_loaded)} only as loaded"
        )

    def metrics(self) -> dict[str, float]:
        return {
            "verified": float(self.ok),
            "workers_answered": float(self.workers),
            "tensors_read_back": float(len(self.held)),
            "tensors_as_loaded": float(len(self.as_loaded)),
            "tensors_differ": float(len(self.problems)),
        }


def entries_of(recorded: dict) -> Entries:
    """Digest entries from a report's ``{name: [dtype, shape, hex sum, ...]}``."""
    return {n: (v[0], tuple(v[1]), int(v[2], 16)) for n, v in recorded.items()}


def answered_by_every_worker(workers: list[dict]) -> str | None:
    """None if the answers come from every worker of the engine, one each: its tensor x pipeline
    parallel workers (as the workers say, ``plugin.dist_sr_held_weights``'s ``worker``) times the
    data-parallel engines behind its server (as the server says, ``"server"``); else what is
    missing. Answers without the workers' record (a model checked outside vLLM) are not counted."""
    where = [w.get("worker") for w in workers]
    if not where or any(not isinstance(w, dict) for w in where):
        return None
    first = where[0]
    tp, pp = int(first.get("tensor_parallel_size", 1)), int(first.get("pipeline_parallel_size", 1))
    engines = max(int((w.get("server") or {}).get("engines", 1)) for w in workers)
    expected = tp * pp * engines
    seen = {(int(w.get("data_parallel_rank", 0)), int(w.get("rank", 0))) for w in where}
    if len(workers) == expected and len(seen) == expected:
        return None
    answering = sorted({dp for dp, _ in seen})
    missing = sorted(set(range(engines)) - set(answering))
    return (
        f"{len(workers)} answer(s) from {len(seen)} distinct worker(s), of an engine of {expected} workers (tensor "
        f"{tp} x pipeline {pp} x {engines} data-parallel engine(s))"
        + (f"; data-parallel engines {missing} did not answer" if missing else "")
        + ": the workers that did not answer are not verified (this vLLM's client cannot ask every "
        "data-parallel engine; run one API server per data-parallel rank, each its own engine URL, "
        "or a vLLM whose client has call_utility_all_async)"
    )


def check_engine(engine: str, workers: list[dict], expected: Entries) -> EngineCheck:
    """Compare every worker's ``dist_sr_held_weights`` answer of ``engine`` with ``expected``. An
    engine whose workers did not all answer is not verified (``answered_by_every_worker``); each
    data-parallel engine behind one server is a whole replica, checked on its own and named in
    its problems."""
    unanswered = answered_by_every_worker(workers)
    if unanswered is not None:
        start = str((workers[0].get("start") or {}).get("load_format")) if workers else "?"
        return EngineCheck(engine, (), {}, (), len(workers), start, unanswered=unanswered)
    replicas: dict[int, list[dict]] = {}
    for w in workers:
        replicas.setdefault(int((w.get("worker") or {}).get("data_parallel_rank", 0)), []).append(w)
    if len(replicas) == 1:
        return _check_replica(engine, workers, expected, "")
    checks = [
        _check_replica(engine, ws, expected, f"data-parallel engine {dp}: ") for dp, ws in sorted(replicas.items())
    ]
    held = [n for n in expected if all(n in c.held for c in checks)]
    as_loaded = {n: why for c in checks for n, why in c.as_loaded.items() if not any(n in d.held for d in checks)}
    return EngineCheck(
        engine,
        tuple(held),
        as_loaded,
        tuple(p for c in checks for p in c.problems),
        len(workers),
        checks[0].start,
        waiting=any(c.waiting for c in checks),
    )


def _check_replica(engine: str, workers: list[dict], expected: Entries, where: str) -> EngineCheck:
    """``check_engine`` on the workers of one whole model (its TP x PP workers); problems start
    with ``where`` (which data-parallel engine) and name the worker where one can be told apart."""
    starts = [w.get("start") or {} for w in workers]
    start = str(starts[0].get("load_format")) if starts else "?"
    loaded = [entries_of(w.get("digests", {})) for w in workers]
    if expected and all(s.get("load_format") == "dummy" and not s.get("pushes") for s in starts):
        if not any(loaded):
            return EngineCheck(engine, (), {}, (), len(workers), start, waiting=True)
    ranks = [(w.get("worker") or {}).get("rank", i) for i, w in enumerate(workers)]
    held, as_loaded, problems = [], {}, []
    for name, (dtype, shape, total) in expected.items():
        reason = _as_loaded_problem(name, (dtype, shape, total), loaded, ranks)
        if reason is not None:
            problems.append(Problem(name, where + reason))
            continue
        readers = [(r, w["readback"][name]) for r, w in zip(ranks, workers) if name in w.get("readback", {})]
        parts = [part for _, part in readers]
        if not parts:
            why = {w.get("unreadable", {}).get(name) for w in workers} - {None}
            as_loaded[name] = "; ".join(sorted(why)) or "no worker reads it back"
            continue
        numel = 1
        for d in shape:
            numel *= int(d)
        got = combine_readbacks(name, numel, parts)
        whole = [r for r, part in readers if int(part[3]) == numel]  # workers holding every element
        wrong = [r for r, part in readers if r in whole and (part[0] != dtype or int(part[2], 16) != total)]
        differs = any(p[0] != dtype for p in parts) or got.sum != total
        if got.problem is not None or (got.covered == numel and differs):
            who = f"worker(s) {wrong} hold other values than the trainer's" if wrong else None
            if got.problem is not None:
                problems.append(Problem(name, where + (f"{got.problem}: {who}" if who else got.problem)))
            else:
                problems.append(
                    Problem(
                        name,
                        where
                        + (who or "the parameters hold other values than the trainer's")
                        + " (the load dropped or changed it)",
                    )
                )
        elif got.covered != numel:
            problems.append(
                Problem(
                    name,
                    where + f"held only in part: {got.covered} of {numel} elements on the workers that hold it (a "
                    "tensor-parallel loader took the wrong slice, or a worker dropped it)",
                )
            )
        else:
            held.append(name)
    return EngineCheck(engine, tuple(held), as_loaded, tuple(problems), len(workers), start)


def _as_loaded_problem(name: str, want: tuple, loaded: list[Entries], ranks: list) -> str | None:
    for rank, entries in zip(ranks, loaded):
        got = entries.get(name)
        if got is None:
            return f"never loaded by worker {rank}"
        if got != want:
            form = "" if got[:2] == want[:2] else f" ({got[0]} {list(got[1])}, not {want[0]} {list(want[1])})"
            return (
                f"worker {rank} was handed other bits than the trainer's{form}: a master cast to nearest, "
                "another version, or a transfer that changed them"
            )
    return None


def require(checks: list[EngineCheck], *, warn_only: bool = False, log=None) -> None:
    """Raise ``HeldWeightsMismatch`` naming every engine that failed its check (or, with
    ``warn_only``, log it as a warning and go on)."""
    bad = [c for c in checks if not c.ok]
    if not bad:
        return
    message = "dist-sr held-weights check: " + " | ".join(c.summary() for c in bad)
    if warn_only:
        if log is not None:
            log.warning("%s (warn only: training goes on)", message)
        return
    raise HeldWeightsMismatch(message)
