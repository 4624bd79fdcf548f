"""Trainer side of the rollout fleet: HTTP control of N ``vllm serve`` engines, the weight sync
over the dist-sr backend, digest verification, and fault handling.

Every trainer rank calls ``WeightSync.sync(version)`` after each optimizer step (the ranks that
send must; the rest follow the decisions rank 0 broadcasts). Per sync, rank 0 drives each live
engine through pause -> start -> update (one HTTP call carrying the whole plan, on a worker
thread, while the trainer ranks send the buckets on the main thread) -> finish(weight_version)
-> reset prefix cache -> digest report -> resume. Everything has a timeout. An engine that
fails, hangs or reports a wrong digest gets no traffic: a failed engine is dropped and the group
is rebuilt with the survivors for a retry; a restarted engine rejoins at the next sync and
serves only after its digest matches.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .plan import Piece, SyncPlan, TensorPlan, combine, make_buckets, piece_sum
from .sources import add_rank_sums, layout_free_digest
from .transport import broadcast, gloo_group, open_store

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """An engine failed an HTTP call or a collective (names the engine)."""


class NoReadyEngineError(RuntimeError):
    pass


@dataclass
class Engine:
    url: str
    workers: int = 0                 # TP * PP (* DP): members of the transfer group
    state: str = "new"               # new | ready | pending | down
    version: int | None = None       # last weight version verified on this engine
    reason: str = ""                 # why it is not ready

    @property
    def name(self) -> str:
        return self.url


def http(url: str, path: str, body: dict | None = None, *, timeout: float, method: str | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode() or "{}"
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise EngineError(f"{url}{path}: HTTP {exc.code}: {detail}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, socket.timeout) as exc:
        raise EngineError(f"{url}{path}: {getattr(exc, 'reason', exc)}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"text": text}


@dataclass
class SyncResult:
    version: int
    digest: str
    ready: list[str]
    seconds: float
    bytes_sent: int
    attempts: int
    problems: list[str] = field(default_factory=list)


class WeightSync:
    """One trainer's weight sync to a fleet (every trainer rank holds one)."""

    def __init__(self, source, urls: list[str], *, transport: str = "broadcast", bucket_mb: float = 64.0,
                 timeout_s: float = 120.0, group_host: str | None = None, group_port: int = 29600,
                 trainer_group=None):
        if transport not in ("broadcast", "shard-direct"):
            raise ValueError(f"unknown transport {transport!r}; choose broadcast or shard-direct")
        self.source, self.transport = source, transport
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.timeout_s = timeout_s
        self.trainer_group = trainer_group
        self.rank = dist.get_rank(trainer_group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(trainer_group) if dist.is_initialized() else 1
        self.senders = self.world if transport == "shard-direct" else 1
        self.engines = [Engine(u) for u in urls]  # rank 0's view is authoritative
        self.group_host = group_host or "127.0.0.1"
        self.group_port = group_port
        self.store = None
        self.groups: dict[int, object] = {}
        self.members: list[tuple[str, int]] = []  # (url, workers) of the current group, in rank order
        self.generation = 0
        self.last: SyncResult | None = None

    # ---- collectives among trainer ranks -------------------------------------------------
    def _bcast(self, obj):
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.trainer_group)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        if self.world == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.trainer_group)
        return bool(flag.item())

    # ---- membership ------------------------------------------------------------------------
    def _probe(self) -> None:
        """Rank 0: which engines answer, and how many workers each has."""
        for e in self.engines:
            try:
                http(e.url, "/health", timeout=min(self.timeout_s, 10), method="GET")
                if e.state in ("new", "down") or not e.workers:  # a restarted engine may have a new TP size
                    e.workers = int(http(e.url, "/get_world_size", timeout=self.timeout_s)["world_size"])
                if e.state == "down":
                    e.state, e.reason = "pending", "restarted: waits for the current weights"
                elif e.state == "new":
                    e.state = "pending"
            except EngineError as exc:
                if e.state != "down":
                    log.warning("engine %s is down: %s", e.url, exc)
                e.state, e.reason = "down", str(exc)

    def _connect(self, members: list[tuple[str, int]]) -> list[str]:
        """All ranks: build the groups of a new generation with ``members``; returns the URLs that
        failed to join (rank 0)."""
        self.generation += 1
        self.groups, self.members = {}, members
        world = 1 + sum(w for _, w in members)
        if not members:
            return []
        if self.rank == 0 and self.store is None:
            self.store = open_store("0.0.0.0", self.group_port, is_master=True, timeout_s=self.timeout_s)
        failed, threads = [], []
        if self.rank == 0:
            offset = 1
            for url, workers in members:
                info = {"master_address": self.group_host, "master_port": self.group_port, "rank_offset": offset,
                        "world_size": world, "senders": self.senders, "generation": self.generation,
                        "timeout_s": self.timeout_s}
                offset += workers
                threads.append(self._call_async(url, "/init_weight_transfer_engine", {"init_info": info}, failed))
        if self.rank < self.senders:
            store = self.store if self.rank == 0 else open_store(self.group_host, self.group_port, is_master=False,
                                                                 timeout_s=self.timeout_s)
            try:
                self.groups[self.rank] = gloo_group(store, self.generation, self.rank, 0, world, self.timeout_s)
            except RuntimeError as exc:
                failed.append(f"trainer rank {self.rank}: {exc}")
        for t in threads:
            t.join()
        return failed

    def _call_async(self, url: str, path: str, body: dict, failures: list, timeout: float | None = None):
        def run():
            try:
                http(url, path, body, timeout=timeout or self.timeout_s)
            except EngineError as exc:
                failures.append(str(exc))  # the message starts with the engine's URL

        t = threading.Thread(target=run, daemon=True)
        t.start()
        return t

    # ---- the plan -------------------------------------------------------------------------
    def plan(self, version: int) -> SyncPlan:
        tensors = []
        for name, dtype, shape in self.source.metadata():
            if self.transport == "broadcast":
                pieces = [Piece(0, 0, math.prod(shape))]
            else:
                pieces = [Piece(r, *self._range_of(name, r)) for r in range(self.world)]
                pieces = [p for p in pieces if p.end > p.start] or [Piece(0, 0, 0)]
            tensors.append(TensorPlan(name, dtype, tuple(shape), pieces))
        plan = SyncPlan(version, self.senders, make_buckets(tensors, self.bucket_bytes))
        plan.check()
        return plan

    def _range_of(self, name: str, rank: int) -> tuple[int, int]:
        """Rank ``rank``'s flat range of ``name`` (the ranks exchange their ranges once, at the
        first shard-direct plan; the layout does not change during training)."""
        ranges = getattr(self, "_ranges", None)
        if ranges is None:
            mine = {n: (s, e) for n, s, e, _ in self.source.local_pieces([m[0] for m in self.source.metadata()])}
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
        for attempt in (1, 2, 3):
            members = None
            if self.rank == 0:
                self._probe()
                members = [(e.url, e.workers) for e in self.engines if e.state != "down"]
            members = self._bcast(members)
            if not members:
                raise NoReadyEngineError("no rollout engine is reachable: " + "; ".join(
                    f"{e.url}: {e.reason}" for e in self.engines))
            failed = []
            if members != self.members:
                failed = self._connect(members)
            ok = not failed and self._all_ok(True)
            if ok:
                ok, failed, sent, entries = self._transfer(version, on_bucket, verify)
            if self._all_ok(ok):
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
        self.last = SyncResult(version, self._bcast(digest), ready, time.perf_counter() - t0, sent, attempt, problems)
        if not ready:
            raise NoReadyEngineError(f"after weight sync {version} no engine holds the trainer's weights: {problems}")
        return self.last

    def _transfer(self, version: int, on_bucket=None, verify: bool = True):
        """All ranks: one attempt at moving every bucket. Returns (ok, failures, bytes, digest entries)."""
        plan = self.plan(version)
        plan.digest = verify
        failures: list[str] = []
        threads = []
        if self.rank == 0:
            for url, _ in self.members:
                try:
                    http(url, "/pause?mode=abort", {}, timeout=self.timeout_s)
                    http(url, "/start_weight_update", {}, timeout=self.timeout_s)
                except EngineError as exc:
                    failures.append(str(exc))
            if failures:
                return False, failures, 0, {}
            update_timeout = self.timeout_s * (1 + len(plan.buckets))
            body = {"update_info": {"plan": plan.to_json()}}
            for url, _ in self.members:
                threads.append(self._call_async(url, "/update_weights", body, failures, timeout=update_timeout))
        sums: dict[str, int] = {}
        sent = 0
        try:
            for index, bucket in enumerate(plan.buckets):
                if on_bucket is not None:
                    on_bucket(index, len(plan.buckets))
                names = [t.name for t in bucket.tensors]
                if self.transport == "broadcast":
                    full = self.source.gather(names)  # collective on every rank
                    pieces = [(n, 0, full[n].numel(), full[n].reshape(-1)) for n in names] if self.rank == 0 else []
                else:
                    pieces = [p for p in self.source.local_pieces(names) if p[2] > p[1]]
                chunks = [bits for _, _, _, bits in pieces]
                if verify:
                    sums.update({n: piece_sum(bits, s) for n, s, _, bits in pieces})
                if self.rank < self.senders:
                    buf = self._pack(chunks, bucket.nbytes(self.rank))
                    broadcast(self.groups[self.rank], buf).wait()
                    sent += buf.numel()
        except RuntimeError as exc:
            failures.append(f"trainer rank {self.rank}: {exc}")
        for t in threads:
            t.join()
        ok = not failures
        if self.rank == 0 and ok:
            for url, _ in self.members:
                try:
                    http(url, "/finish_weight_update", {"weight_version": str(version)}, timeout=self.timeout_s)
                    http(url, "/reset_prefix_cache", {}, timeout=self.timeout_s)
                except EngineError as exc:
                    failures.append(str(exc))
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
                reports = http(e.url, "/collective_rpc", {"method": "dist_sr_weight_report"},
                               timeout=self.timeout_s)["results"]
            except EngineError as exc:
                e.state, e.reason = "pending", str(exc)
                problems.append(str(exc))
                continue
            bad = [] if expected is None else sorted({n for r in reports for n in set(expected) | set(r.get("digests", {}))
                                                      if r.get("digests", {}).get(n) != expected.get(n)})
            stale = [r.get("rank") for r in reports if str(r.get("version")) != str(version) or not r.get("complete")]
            if bad or stale:
                e.state = "pending"
                e.reason = (f"weights differ from the trainer's after sync {version}: "
                            f"{bad[:8]}{' ...' if len(bad) > 8 else ''}" if bad else
                            f"workers {stale} did not complete sync {version}")
                problems.append(f"{e.url}: {e.reason}")
                log.error("engine %s gets no rollouts: %s", e.url, e.reason)
                continue
            try:
                http(e.url, "/resume", {}, timeout=self.timeout_s)
            except EngineError as exc:
                e.state, e.reason = "pending", str(exc)
                problems.append(str(exc))
                continue
            e.state, e.version, e.reason = "ready", version, ""
            ready.append(e.url)
        return ready, problems


    def _pack(self, chunks: list[torch.Tensor], nbytes: int) -> torch.Tensor:
        """One contiguous byte buffer of a bucket (a lone contiguous tensor is sent in place; the
        staging buffer is reused across syncs, so its pages are touched once)."""
        size = sum(c.numel() * c.element_size() for c in chunks)
        if size != nbytes:
            raise RuntimeError(f"bucket buffer has {size} bytes, the plan says {nbytes}")
        if len(chunks) == 1 and chunks[0].is_contiguous():
            return chunks[0].reshape(-1).view(torch.uint8)
        staging = getattr(self, "_staging", None)
        if staging is None or staging.numel() < nbytes:
            self._staging = staging = torch.empty(nbytes, dtype=torch.uint8)
        buf, at = staging[:nbytes], 0
        for c in chunks:
            b = c.reshape(-1).contiguous().view(torch.uint8)
            buf[at:at + b.numel()].copy_(b)
            at += b.numel()
        return buf
