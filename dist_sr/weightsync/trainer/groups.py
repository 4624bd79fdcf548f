"""The trainer's side of the weight-transfer groups (``transport``): rank 0 hosts the store, and
each generation is one group per sending rank with every worker of every member engine, built
anew whenever the members change (an engine dropped, one back). Rank 0 asks each engine to join
(``init_transfer``, on a thread each) while the sending ranks join themselves."""

from __future__ import annotations

from ...sources import WeightSource
from ..transport import open_store, transfer_group
from .fleet import Failure, Fleet


def choose_backend(configured: str, source: WeightSource) -> str:
    """The groups' backend: as configured, or (``auto``) nccl when the weights are on CUDA. Every
    rank decides alike (a job's weights are all on one kind of device)."""
    if configured != "auto":
        return configured
    metas = source.metadata()
    pieces = source.local_pieces([metas[0][0]]) if metas else []
    return "nccl" if any(p.bits.device.type == "cuda" for p in pieces) else "gloo"


class TransferGroups:
    """One trainer rank's transfer groups: ``by_sender`` (the group of each sending rank this
    rank is in: its own), ``members`` ((url, workers) of the engines in them, in rank order) and
    the ``generation`` they were built in."""

    def __init__(
        self, *, rank: int, senders: int, host: str, port: int, store_prefix: str, timeout_s: float, backend: str
    ):
        self.rank, self.senders = rank, senders
        self.host, self.port = host, port  # rank 0's store listens here, and only here
        self.store_prefix = store_prefix
        self.timeout_s = timeout_s
        self.backend = backend  # as configured (auto | one of transport.BACKENDS)
        self.store = None
        self.by_sender: dict[int, object] = {}
        self.members: list[tuple[str, int]] = []
        self.generation = 0

    def urls(self) -> list[str]:
        return [u for u, _ in self.members]

    def mine(self):
        """This sending rank's group."""
        return self.by_sender[self.rank]

    def connect(self, members: list[tuple[str, int]], fleet: Fleet, source: WeightSource) -> list[Failure]:
        """All ranks: build the groups of a new generation with ``members``; returns the failures
        to join (rank 0: the engines'; a sending rank: its own)."""
        self.generation += 1
        self.by_sender, self.members = {}, members
        controls = {e.url: e.control for e in fleet.engines}
        world = 1 + sum(w for _, w in members)
        if not members:
            return []
        if self.rank == 0 and self.store is None:
            self.store = open_store(self.host, self.port, is_master=True, timeout_s=self.timeout_s)
        failed: list[Failure] = []
        threads = []
        backend = choose_backend(self.backend, source)
        if self.rank == 0:
            offset = 1
            for url, workers in members:
                info = {
                    "master_address": self.host,
                    "master_port": self.port,
                    "rank_offset": offset,
                    "world_size": world,
                    "senders": self.senders,
                    "generation": self.generation,
                    "timeout_s": self.timeout_s,
                    **({"backend": backend} if backend != "gloo" else {}),  # gloo unless named (InitInfo)
                }
                offset += workers
                threads.append(
                    fleet.call_async(controls[url], lambda c=controls[url], i=info: c.init_transfer(i), failed)
                )
        if self.rank < self.senders:
            store = (
                self.store
                if self.rank == 0
                else open_store(self.host, self.port, is_master=False, timeout_s=self.timeout_s)
            )
            try:
                self.by_sender[self.rank] = transfer_group(
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
                failed.append(Failure.of_trainer(self.rank, exc))
        for t in threads:
            t.join()
        return failed
