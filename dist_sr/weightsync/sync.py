"""The trainer's side of a weight sync: every trainer rank calls ``WeightSync.sync(version)``
after each optimizer step (the ranks that send must; the rest follow the decisions rank 0
broadcasts).

Per sync, rank 0 drives each live engine through its control plane: pause -> start -> update
(one call carrying the whole plan, on a worker thread, while the trainer ranks send the buckets
on the main thread) -> finish(weight_version) -> reset prefix cache -> digest report -> resume.
Everything has a timeout. An engine that fails, hangs or reports a wrong digest gets no
traffic: a failed engine is dropped and the groups are rebuilt with the survivors for a retry;
a restarted engine rejoins at the next sync and serves only after its digest matches. An engine
whose reply is not an answer (``control.MalformedReply``: a broken status line, a body cut short
or not UTF-8, the wrong JSON), or whose control plane raises anything else, is marked down with
its URL and the reason, and this sync's retries go on without it.

With ``delta=True`` the engines keep what they load, the sending ranks keep what they sent (a
host copy of their 16-bit pieces), and a sync whose every member verified the previous version
and still holds it sends grid-step deltas against it (``numerics.delta``: about 1/10 of the bytes
under SR, far less under round-to-nearest). Any other sync is dense: the first, a retry, one with
an engine that restarted, failed a digest or is behind (the members share one broadcast, so one
such engine makes the whole sync dense), or one with weights that are not 16-bit.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from .. import collectives, faults
from ..numerics import delta as delta_codec
from ..numerics.digest import combine, piece_sums
from ..sources import WeightSource, add_rank_sums, layout_free_digest
from . import auth
from .control import GROUP_PORT, TIMEOUT_S, ControlPlane, EngineError, MalformedReply, NoReadyEngineError
from .plan import Span, SyncPlan, TensorPlan, make_buckets
from .transport import BACKENDS, Packer, broadcast, open_store, send_sized, transfer_group

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One rollout engine as the sync sees it."""

    control: ControlPlane
    workers: int = 0  # TP * PP (* DP): members of the transfer groups
    state: str = "new"  # new | ready | pending | down
    version: int | None = None  # last weight version verified on this engine
    reason: str = ""  # why it is not ready
    mark: list | None = None  # each worker's (rank, boot, events) when its digests were verified
    held: int | None = None  # the version every worker says it keeps (a delta's base), if any

    @property
    def url(self) -> str:
        return self.control.name


@dataclass
class SyncResult:
    version: int
    digest: str
    ready: list[str]
    seconds: float
    bytes_sent: int
    attempts: int
    problems: list[str] = field(default_factory=list)
    marks: dict = field(default_factory=dict)  # url -> Member.mark of each ready engine
    delta_base: int | None = None  # the version the deltas were against (None: dense)


class WeightSync:
    """One trainer's weight sync to a fleet (every trainer rank holds one)."""

    def __init__(
        self,
        source: WeightSource,
        controls: Sequence[ControlPlane],
        *,
        transport: str = "broadcast",
        bucket_mb: float = 64.0,
        timeout_s: float = TIMEOUT_S,
        group_host: str | None = None,
        group_port: int = GROUP_PORT,
        trainer_group=None,
        secret: bytes | None = None,
        delta: bool = False,
        backend: str = "auto",
    ):
        if transport not in ("broadcast", "shard-direct"):
            raise ValueError(f"unknown transport {transport!r}; choose broadcast or shard-direct")
        if backend not in ("auto", *BACKENDS):
            raise ValueError(f"unknown weight-transfer backend {backend!r}; choose auto, {', '.join(BACKENDS)}")
        self.backend = backend  # auto: nccl when this rank's weights are on a CUDA device, else gloo
        self.source, self.transport = source, transport
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s = timeout_s
        self.trainer_group = trainer_group
        self.rank = dist.get_rank(trainer_group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(trainer_group) if dist.is_initialized() else 1
        self.senders = self.world if transport == "shard-direct" else 1
        self.engines = [Member(c) for c in controls]  # rank 0's view is authoritative
        self.packer = Packer()
        self.group_host = group_host or "127.0.0.1"  # rank 0's store listens here, and only here
        self.group_port = group_port
        self.store_prefix = auth.store_prefix(secret if secret is not None else auth.load())
        self.store = None
        self.groups: dict[int, object] = {}
        self.members: list[tuple[str, int]] = []  # (url, workers) of the current group, in rank order
        self.generation = 0
        self.last: SyncResult | None = None
        self.delta = delta
        if delta:
            from ..numerics.backends import cpu

            cpu.warm_up_in_background()  # the delta codec's kernel, built once per environment
        self.unanswered: set[str] = set()  # rank 0: engines whose replies were not answers, this sync
        self.base: dict[tuple[str, int], torch.Tensor] = {}  # what this rank last sent, per piece
        self.base_version: int | None = None

    # ---- collectives among trainer ranks -------------------------------------------------
    def _bcast(self, obj):
        return collectives.from_first(obj, self.trainer_group)

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every trainer rank (collective)."""
        return collectives.all_true(ok, self.trainer_group)

    # ---- membership ------------------------------------------------------------------------
    def _failed(self, control: ControlPlane, exc: Exception) -> str:
        """Rank 0: one line for an engine's failure (``_failure``); an engine whose reply was not
        an answer stays down for the rest of this sync (its retries go on without it)."""
        if _state_after(exc) == "down":
            self.unanswered.add(control.name)
        return _failure(control, exc)

    def _probe(self) -> None:
        """Rank 0: which engines answer, and how many workers each has (those whose replies were
        not answers in this sync stay down until the next)."""
        for e in self.engines:
            if e.url in self.unanswered:
                e.state = "down"
                continue
            try:
                e.control.health()
                if e.state in ("new", "down") or not e.workers:  # a restarted engine may have a new TP size
                    e.workers = e.control.world_size()
                if e.state == "down":
                    e.state, e.reason = "pending", "restarted: waits for the current weights"
                elif e.state == "new":
                    e.state = "pending"
            except Exception as exc:  # noqa: BLE001  (whatever an engine's answer did, it is down: named)
                reason = self._failed(e.control, exc)
                if e.state != "down":
                    log.warning("engine %s is down: %s", e.url, reason)
                e.state, e.reason = "down", reason

    def _connect(self, members: list[tuple[str, int]]) -> list[str]:
        """All ranks: build the groups of a new generation with ``members``; returns the URLs that
        failed to join (rank 0)."""
        self.generation += 1
        self.groups, self.members = {}, members
        controls = {e.url: e.control for e in self.engines}
        world = 1 + sum(w for _, w in members)
        if not members:
            return []
        if self.rank == 0 and self.store is None:
            self.store = open_store(self.group_host, self.group_port, is_master=True, timeout_s=self.timeout_s)
        failed, threads = [], []
        backend = self._backend()
        if self.rank == 0:
            offset = 1
            for url, workers in members:
                info = {
                    "master_address": self.group_host,
                    "master_port": self.group_port,
                    "rank_offset": offset,
                    "world_size": world,
                    "senders": self.senders,
                    "generation": self.generation,
                    "timeout_s": self.timeout_s,
                    **({"backend": backend} if backend != "gloo" else {}),  # gloo unless named (InitInfo)
                }
                offset += workers
                threads.append(
                    self._call_async(controls[url], lambda c=controls[url], i=info: c.init_transfer(i), failed)
                )
        if self.rank < self.senders:
            store = (
                self.store
                if self.rank == 0
                else open_store(self.group_host, self.group_port, is_master=False, timeout_s=self.timeout_s)
            )
            try:
                self.groups[self.rank] = transfer_group(
                    store,
                    self.generation,
                    self.rank,
                    0,
                    world,
                    self.timeout_s,
                    prefix=self.store_prefix,
                    backend=backend,
                )
            except RuntimeError as exc:
                failed.append(f"trainer rank {self.rank}: {exc}")
        for t in threads:
            t.join()
        return failed

    def _backend(self) -> str:
        """The group's backend: as configured, or (auto) nccl when the weights are on CUDA. Every
        rank decides alike (a job's weights are all on one kind of device)."""
        if self.backend != "auto":
            return self.backend
        metas = self.source.metadata()
        pieces = self.source.local_pieces([metas[0][0]]) if metas else []
        return "nccl" if any(p.bits.device.type == "cuda" for p in pieces) else "gloo"

    def _call_async(self, control: ControlPlane, call, failures: list):
        def run():
            try:
                call()
            except Exception as exc:  # noqa: BLE001  (an engine's failure, named, whatever its kind)
                failures.append(self._failed(control, exc))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    # ---- the plan -------------------------------------------------------------------------
    def plan(self, version: int, delta_base: int | None = None) -> SyncPlan:
        tensors = []
        for name, dtype, shape in self.source.metadata():
            if self.transport == "broadcast":
                spans = [Span(0, 0, math.prod(shape))]
            else:
                spans = [Span(r, *self._range_of(name, r)) for r in range(self.world)]
                spans = [p for p in spans if p.end > p.start] or [Span(0, 0, 0)]
            tensors.append(TensorPlan(name, dtype, tuple(shape), spans))
        plan = SyncPlan(
            version, self.senders, make_buckets(tensors, self.bucket_bytes), keep=self.delta, delta_base=delta_base
        )
        plan.check()
        return plan

    def _range_of(self, name: str, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s flat range of ``name`` (the ranks exchange their ranges once, at the
        first shard-direct plan; the layout does not change during training)."""
        ranges = getattr(self, "_ranges", None)
        if ranges is None:
            mine = {p.name: (p.start, p.end) for p in self.source.local_pieces([m[0] for m in self.source.metadata()])}
            all_ranges = [mine]
            if self.world > 1:
                all_ranges = [None] * self.world
                dist.all_gather_object(all_ranges, mine, group=self.trainer_group)
            self._ranges = ranges = all_ranges
        return ranges[rank][name]

    # ---- one sync -------------------------------------------------------------------------
    def sync(self, version: int, on_bucket=None, verify: bool = True) -> SyncResult:
        """Every trainer rank: send the current working weights as ``version``; ``on_bucket(i, n)``
        is called before each bucket (progress). ``verify=False`` skips the digests (both sides):
        engines that complete the update count as ready."""
        t0 = time.perf_counter()
        problems: list[str] = []
        last_base, self.base_version = self.base_version, None  # set again only by a whole sync
        self.unanswered = set()
        for attempt in (1, 2, 3):  # noqa: B007  (the last one is reported in the result)
            members = None
            if self.rank == 0:
                self._probe()
                members = [(e.url, e.workers) for e in self.engines if e.state != "down"]
            members = self._bcast(members)
            if not members:
                raise NoReadyEngineError(
                    "no rollout engine is reachable: " + "; ".join(f"{e.url}: {e.reason}" for e in self.engines)
                )
            failed = []
            if members != self.members:
                failed = self._connect(members)
            ok = not failed and self.all_ok(True)
            base = self._bcast(self._delta_base(attempt, last_base) if self.rank == 0 else None)
            if ok:
                ok, failed, sent, entries = self._transfer(version, on_bucket, verify, base)
            if self.all_ok(ok):
                break
            failed = self._bcast(failed)
            problems += failed
            if self.rank == 0:
                for e in self.engines:
                    if any(e.url in f for f in failed):
                        e.state, e.reason = "down", "; ".join(f for f in failed if e.url in f)[:2000]
            self.members = []  # rebuild the group with the survivors
        else:
            raise NoReadyEngineError(f"weight sync {version} failed three times: {problems[-6:]}")
        digest = combine(entries) if self.rank == 0 and verify else ""
        ready = []
        if self.rank == 0:
            ready, bad = self._verify(version, entries if verify else None)
            problems += bad
        ready = self._bcast(ready)
        marks = self._bcast({e.url: e.mark for e in self.engines if e.url in ready} if self.rank == 0 else None)
        self.last = SyncResult(
            version, self._bcast(digest), ready, time.perf_counter() - t0, sent, attempt, problems, marks, base
        )
        if not ready:
            raise NoReadyEngineError(f"after weight sync {version} no engine holds the trainer's weights: {problems}")
        self.base_version = version if self.delta else None
        return self.last

    def _delta_base(self, attempt: int, base: int | None) -> int | None:
        """Rank 0: the version this sync's deltas go against (``base``, what every rank sent last),
        or None for a dense sync."""
        if not self.delta or attempt != 1 or base is None:
            return None
        if any(t != "bfloat16" and t != "float16" for _, t, _ in self.source.metadata()):
            return None
        members = [e for e in self.engines if e.url in {u for u, _ in self.members}]
        if members and all(e.state == "ready" and e.version == base == e.held for e in members):
            return base
        return None

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

    def _keep(self, pieces) -> None:
        for name, start, bits in pieces:
            held = self.base.get((name, start))
            if held is None or held.shape != bits.shape or held.dtype != bits.dtype:
                self.base[(name, start)] = bits.detach().clone()
            else:
                held.copy_(bits)

    def _transfer(self, version: int, on_bucket=None, verify: bool = True, base: int | None = None):
        """All ranks: one attempt at moving every bucket. Returns (ok, failures, bytes, digest entries)."""
        plan = self.plan(version, base)
        plan.digest = verify
        failures: list[str] = []
        threads = []
        controls = [self._control(url) for url, _ in self.members] if self.rank == 0 else []
        if self.rank == 0:
            for c in controls:
                try:
                    c.pause()
                    c.start_update()
                except Exception as exc:  # noqa: BLE001
                    failures.append(self._failed(c, exc))
            if failures:
                return False, failures, 0, {}
            update_timeout = self.timeout_s * (1 + len(plan.buckets))
            plan_json = plan.to_json()
            for c in controls:
                threads.append(self._call_async(c, lambda c=c: c.update(plan_json, update_timeout), failures))
        sums: dict[str, int] = {}
        sent = 0
        kept: list = []
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
                            self.groups[self.rank], torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
                        )
                    else:
                        buf = self.packer.pack(chunks, bucket.nbytes(self.rank), self.groups[self.rank])
                        work, nbytes = broadcast(self.groups[self.rank], buf), buf.numel()
                    sent += nbytes
                    if self.delta:
                        kept.extend((n, s, bits) for n, s, bits in pieces)
                if verify:  # while the bucket is on the wire (the sums read the pieces, not the buffer)
                    sums.update(zip([n for n, _, _ in pieces], piece_sums([(bits, s) for _, s, bits in pieces])))
                if work is not None:
                    work.wait()
        except RuntimeError as exc:
            failures.append(f"trainer rank {self.rank}: {exc}")
        # the engines have at most the last bucket left to load: one that has not answered its
        # update within timeout_s hangs (stopped, deadlocked), and is left out, not waited for
        deadline = time.monotonic() + self.timeout_s
        for c, t in zip(controls, threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                failures.append(
                    f"{c.name}: no answer to its update {self.timeout_s:.0f} s after the last bucket was "
                    "sent (the engine hangs); left out of this sync"
                )
        if self.delta and self.rank < self.senders and not failures:
            self._keep(kept)  # what the engines that complete this sync hold from now on
        ok = not failures
        if self.rank == 0 and ok:
            for c in controls:
                try:
                    c.finish(version)
                    c.reset_cache()
                except Exception as exc:  # noqa: BLE001
                    failures.append(self._failed(c, exc))
            ok = not failures
        entries = add_rank_sums(sums, self.source.metadata(), self.world, self.trainer_group) if verify else {}
        return ok, failures, sent, entries

    def current_digest(self) -> str:
        """Every trainer rank: the layout-free digest of the working weights as they are now, from
        the pieces each rank holds (no gather)."""
        return layout_free_digest(self.source, self.world, self.trainer_group)

    def _verify(self, version: int, entries: dict | None) -> tuple[list[str], list[str]]:
        """Rank 0: each engine's report against the trainer's digest entries (``None``: only that
        the engine completed this version); only matching engines are resumed and marked ready."""
        expected = None if entries is None else {n: [d, list(s), f"{v:016x}"] for n, (d, s, v) in entries.items()}
        ready, problems = [], []
        for e in self.engines:
            if e.state == "down" or e.url not in [u for u, _ in self.members]:
                continue
            try:
                reports = e.control.report()
            except Exception as exc:  # noqa: BLE001  (a report that is not one: the engine is down)
                e.state, e.reason = _state_after(exc), self._failed(e.control, exc)
                problems.append(e.reason)
                continue
            bad = (
                []
                if expected is None
                else sorted(
                    {
                        n
                        for r in reports
                        for n in set(expected) | set(r.get("digests", {}))
                        if r.get("digests", {}).get(n) != expected.get(n)
                    }
                )
            )
            stale = [r.get("rank") for r in reports if str(r.get("version")) != str(version) or not r.get("complete")]
            if bad or stale:
                e.state = "pending"
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
                e.state, e.reason = _state_after(exc), self._failed(e.control, exc)
                problems.append(e.reason)
                continue
            e.state, e.version, e.reason = "ready", version, ""
            e.mark = _mark(reports)
            held = {r.get("held") for r in reports}
            e.held = held.pop() if len(held) == 1 else None
            ready.append(e.url)
        return ready, problems

    def changed(self, urls: Sequence[str]) -> list[str]:
        """Any trainer rank, after using ``urls`` for rollouts: the engines that are no longer
        exactly what the last sync verified (restarted, or any control event since; an engine
        that does not answer counts as changed), each with the reason."""
        problems = []
        for url in urls:
            try:
                reports = self._control(url).report()
            except Exception as exc:  # noqa: BLE001
                problems.append(f"{url}: {_failure(self._control(url), exc)}")
                continue
            if self.last is None or _mark(reports) != self.last.marks.get(url):
                problems.append(
                    f"{url}: restarted or changed by a control event after weight sync "
                    f"{self.last.version if self.last else None} was verified"
                )
        return problems

    def _control(self, url: str) -> ControlPlane:
        return next(e.control for e in self.engines if e.url == url)


def _mark(reports: list[dict]) -> list:
    # ordered by repr: a worker not yet in a group reports rank None beside others' integers
    return sorted(([r.get("rank"), r.get("boot"), r.get("events")] for r in reports), key=repr)


def _failure(control: ControlPlane, exc: Exception) -> str:
    """An engine's failure as one line starting with its name: an ``EngineError`` says it already;
    anything else a control plane raised is named with its type."""
    return str(exc) if isinstance(exc, EngineError) else f"{control.name}: {type(exc).__name__}: {exc}"


def _state_after(exc: Exception) -> str:
    """An engine that refused a call (an HTTP error) stays a member, waiting for the next sync
    (``pending``); one whose reply was not an answer, or that failed otherwise, is ``down``."""
    return "pending" if isinstance(exc, EngineError) and not isinstance(exc, MalformedReply) else "down"
