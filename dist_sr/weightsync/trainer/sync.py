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

``WeightSync`` coordinates; the jobs are modules of their own: the engines and their states
(``fleet``), the transfer groups (``groups``), one attempt at moving the buckets (``transfer``)
and the digest checks (``verify``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch.distributed as dist

from ... import collectives
from ...numerics.digest import combine
from ...sources import WeightSource, add_rank_sums, layout_free_digest
from .. import auth
from ..control import GROUP_PORT, TIMEOUT_S, ControlPlane, NoReadyEngineError
from ..plan import Span, SyncPlan, TensorPlan, make_buckets
from ..transport import BACKENDS
from .fleet import Failure, Fleet, Member, State
from .groups import TransferGroups
from .transfer import Attempt, EngineUpdates, Sender
from .verify import changed_engines, verify_engines


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
        self.fleet = Fleet(controls)
        self.group_host = group_host or "127.0.0.1"  # rank 0's store listens here, and only here
        self.group_port = group_port
        self.groups = TransferGroups(
            rank=self.rank,
            senders=self.senders,
            host=self.group_host,
            port=self.group_port,
            store_prefix=auth.store_prefix(secret if secret is not None else auth.load()),
            timeout_s=timeout_s,
            backend=backend,
        )
        self.last: SyncResult | None = None
        self.delta = delta
        if delta:
            from ...numerics import warm_up_kernels_in_background

            warm_up_kernels_in_background()  # the delta codec's kernel, built once per environment
        self.sender = Sender(source, transport=transport, rank=self.rank, senders=self.senders, delta=delta)
        self.base_version: int | None = None  # the version every sending rank last sent whole (delta)
        # shard-direct: each rank's flat range of each tensor, exchanged at the first plan (the
        # layout does not change during training)
        self.ranges: list[dict[str, tuple[int, int]]] | None = None

    @property
    def engines(self) -> list[Member]:
        """Every engine's record (rank 0's view is authoritative)."""
        return self.fleet.engines

    # ---- collectives among trainer ranks -------------------------------------------------
    def _bcast(self, obj):
        return collectives.from_first(obj, self.trainer_group)

    def all_ok(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every trainer rank (collective)."""
        return collectives.all_true(ok, self.trainer_group)

    # ---- the plan -------------------------------------------------------------------------
    def plan(self, version: int, delta_base: int | None = None) -> SyncPlan:
        tensors = []
        for name, dtype, shape in self.source.metadata():
            if self.transport == "broadcast":
                spans = [Span(0, 0, math.prod(shape))]
            else:
                ranges = self._ranges()
                spans = [Span(r, *ranges[r][name]) for r in range(self.world)]
                spans = [p for p in spans if p.end > p.start] or [Span(0, 0, 0)]
            tensors.append(TensorPlan(name, dtype, tuple(shape), spans))
        plan = SyncPlan(
            version, self.senders, make_buckets(tensors, self.bucket_bytes), keep=self.delta, delta_base=delta_base
        )
        plan.check()
        return plan

    def _ranges(self) -> list[dict[str, tuple[int, int]]]:
        """Every rank's flat range of each tensor (collective the first time: ``self.ranges``)."""
        if self.ranges is None:
            mine = {p.name: (p.start, p.end) for p in self.source.local_pieces([m[0] for m in self.source.metadata()])}
            self.ranges = collectives.gathered(mine, self.trainer_group)
        return self.ranges

    # ---- one sync -------------------------------------------------------------------------
    def sync(self, version: int, on_bucket=None, verify: bool = True) -> SyncResult:
        """Every trainer rank: send the current working weights as ``version``; ``on_bucket(i, n)``
        is called before each bucket (progress). ``verify=False`` skips the digests (both sides):
        engines that complete the update count as ready."""
        t0 = time.perf_counter()
        problems: list[str] = []
        last_base, self.base_version = self.base_version, None  # set again only by a whole sync
        self.fleet.start_sync()
        for attempt in (1, 2, 3):  # noqa: B007  (the last one is reported in the result)
            members = None
            if self.rank == 0:
                self.fleet.probe()
                members = self.fleet.live()
            members = self._bcast(members)
            if not members:
                raise NoReadyEngineError(
                    "no rollout engine is reachable: " + "; ".join(f"{e.url}: {e.reason}" for e in self.engines)
                )
            failed: list[Failure] = []
            if members != self.groups.members:
                failed = self.groups.connect(members, self.fleet, self.source)
            ok = not failed and self.all_ok(True)
            base = self._bcast(self._delta_base(attempt, last_base) if self.rank == 0 else None)
            if ok:
                moved = self._transfer(version, on_bucket, verify, base)
                ok, failed = moved.ok, moved.failures
            if self.all_ok(ok):
                break
            failed = self._bcast(failed)
            problems += [f.reason for f in failed]
            if self.rank == 0:
                self.fleet.drop(failed)
            self.groups.members = []  # rebuild the group with the survivors
        else:
            raise NoReadyEngineError(f"weight sync {version} failed three times: {problems[-6:]}")
        digest = combine(moved.entries) if self.rank == 0 and verify else ""
        ready = []
        if self.rank == 0:
            ready, bad = self._verify(version, moved.entries if verify else None)
            problems += bad
        ready = self._bcast(ready)
        marks = self._bcast({e.url: e.mark for e in self.engines if e.url in ready} if self.rank == 0 else None)
        self.last = SyncResult(
            version,
            self._bcast(digest),
            ready,
            time.perf_counter() - t0,
            moved.bytes_sent,
            attempt,
            problems,
            marks,
            base,
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
        members = [e for e in self.engines if e.url in set(self.groups.urls())]
        if members and all(e.state == State.READY and e.version == base == e.held for e in members):
            return base
        return None

    def _transfer(self, version: int, on_bucket=None, verify: bool = True, base: int | None = None) -> Attempt:
        """All ranks: one attempt at moving every bucket, rank 0 taking the engines through it."""
        plan = self.plan(version, base)
        plan.digest = verify
        controls = [self.fleet.control(url) for url in self.groups.urls()] if self.rank == 0 else []
        engines = EngineUpdates(self.fleet, controls, self.timeout_s)
        # every rank learns whether the engines began: a rank that sent buckets to engines that
        # were never asked for them would wait in the transfer, then in a collective rank 0 skips
        if not self._bcast(engines.begin(plan) if self.rank == 0 else None):
            return Attempt(False, engines.failures)
        group = self.groups.mine() if self.rank < self.senders else None
        sent = self.sender.send(plan, group, base=base, verify=verify, on_bucket=on_bucket)
        if sent.error is not None:
            engines.failures.append(Failure.of_trainer(self.rank, sent.error))
        engines.wait()
        if self.delta and self.rank < self.senders and not engines.failures:
            self.sender.keep(sent.pieces)  # what the engines that complete this sync hold from now on
        ok = not engines.failures
        if self.rank == 0 and ok:
            engines.finish(version)
            ok = not engines.failures
        entries = add_rank_sums(sent.sums, self.source.metadata(), self.world, self.trainer_group) if verify else {}
        return Attempt(ok, engines.failures, sent.nbytes, entries)

    def _verify(self, version: int, entries: dict | None) -> tuple[list[str], list[str]]:
        """Rank 0: ``verify.verify_engines`` over this generation's members."""
        return verify_engines(self.fleet, self.groups.urls(), version, entries)

    def current_digest(self) -> str:
        """Every trainer rank: the layout-free digest of the working weights as they are now, from
        the pieces each rank holds (no gather)."""
        return layout_free_digest(self.source, self.world, self.trainer_group)

    def changed(self, urls: Sequence[str]) -> list[str]:
        """Any trainer rank, after using ``urls`` for rollouts: the engines that are no longer
        exactly what the last sync verified (restarted, or any control event since; an engine
        that does not answer counts as changed), each with the reason."""
        if self.last is None:
            return changed_engines(self.fleet, urls, {}, None)
        return changed_engines(self.fleet, urls, self.last.marks, self.last.version)
