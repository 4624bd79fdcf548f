"""What a weight sync moves, agreed by trainer and engines before any byte moves.

A sync is a list of buckets. Each bucket lists whole tensors (HF names, dtype, full shape), and
each tensor is a set of *spans*: contiguous ranges ``[start, end)`` of the flattened full tensor,
each sent by one trainer rank (the *source*). Gather-then-broadcast has one source (trainer rank
0) holding every tensor whole; shard-direct has one source per trainer rank, each sending the
ranges it holds (an FSDP2 dim-0 shard, a ZeRO-3 partition, or a slice of a replica). In a bucket,
source ``m`` sends one flat byte buffer: its spans, tensor by tensor, in plan order. Both sides
verify with the layout-free digest (``numerics.digest``).

Delta syncs: with ``keep`` the engines keep what they load (a host copy of the 16-bit weights);
with ``delta_base`` set, every span is sent as a grid-step delta (``numerics.delta``) against that
version, which every member must hold, and each source's bucket buffer is preceded by its length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..numerics.digest import DTYPES


@dataclass
class Span:
    src: int  # trainer rank that sends it
    start: int  # flat element range of the full tensor
    end: int


@dataclass
class TensorPlan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    spans: list[Span]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()


@dataclass
class Bucket:
    tensors: list[TensorPlan] = field(default_factory=list)

    def nbytes(self, src: int) -> int:
        """Bytes source ``src`` sends in this bucket."""
        return sum((p.end - p.start) * t.itemsize for t in self.tensors for p in t.spans if p.src == src)

    def sources(self) -> list[int]:
        return sorted({p.src for t in self.tensors for p in t.spans})


@dataclass
class SyncPlan:
    version: int
    senders: int  # trainer ranks that send (1 = gather-then-broadcast)
    buckets: list[Bucket]
    digest: bool = True  # engines digest what they receive (for verification)
    keep: bool = False  # engines keep a copy of what they load (a later delta's base)
    delta_base: int | None = None  # spans are deltas against this version (None: dense)

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "senders": self.senders,
            "digest": self.digest,
            "keep": self.keep,
            "delta_base": self.delta_base,
            "buckets": [
                [[t.name, t.dtype, list(t.shape), [[p.src, p.start, p.end] for p in t.spans]] for t in b.tensors]
                for b in self.buckets
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> "SyncPlan":
        buckets = [
            Bucket(
                [TensorPlan(name, dtype, tuple(shape), [Span(*p) for p in spans]) for name, dtype, shape, spans in b]
            )
            for b in data["buckets"]
        ]
        base = data.get("delta_base")
        return cls(
            int(data["version"]),
            int(data["senders"]),
            buckets,
            bool(data.get("digest", True)),
            bool(data.get("keep", False)),
            None if base is None else int(base),
        )

    def check(self) -> None:
        """Every tensor covered exactly once by its spans (no gap, no overlap)."""
        for b in self.buckets:
            for t in b.tensors:
                covered = 0
                for p in sorted(t.spans, key=lambda p: p.start):
                    if p.start != covered or p.end < p.start or not 0 <= p.src < self.senders:
                        raise ValueError(f"sync plan: {t.name} spans {t.spans} do not tile [0, {t.numel})")
                    covered = p.end
                if covered != t.numel:
                    raise ValueError(f"sync plan: {t.name} spans cover {covered} of {t.numel} elements")


def make_buckets(tensors: list[TensorPlan], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors packed into buckets of about ``bucket_bytes`` (a larger tensor is a
    bucket of its own), in the given order."""
    buckets, current, size = [], Bucket(), 0
    for t in tensors:
        nbytes = t.numel * t.itemsize
        if current.tensors and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = Bucket(), 0
        current.tensors.append(t)
        size += nbytes
    if current.tensors:
        buckets.append(current)
    return buckets
