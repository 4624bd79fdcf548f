"""What a weight sync moves, agreed by trainer and engines before any byte moves.

A sync is a list of buckets. Each bucket lists whole tensors (HF names, dtype, full shape), and
each tensor is a set of *pieces*: contiguous ranges ``[start, end)`` of the flattened full tensor,
each sent by one trainer rank (the *source*). Gather-then-broadcast has one source (trainer rank
0) holding every tensor whole; shard-direct has one source per trainer rank, each sending the
ranges it holds (an FSDP2 dim-0 shard, a ZeRO-3 partition, or a slice of a replica). In a bucket,
source ``m`` sends one flat byte buffer: its pieces, tensor by tensor, in plan order.

The digest is layout-free: the 64-bit sum over elements of a keyed mix of (global index, bits),
so each rank can digest what it holds and the sums add up to the digest of the full tensor,
whatever the sharding. A wrong byte, a misplaced piece or a missing piece changes it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from ..numerics.reference import _GAMMA, _MIX1, _MIX2, _shr

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_CHUNK = 1 << 18  # int64 temporaries of 2 MiB stay in cache
_MASK = (1 << 64) - 1


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"cannot send {dtype}: weights travel as {', '.join(DTYPES)}")
    return name


@dataclass
class Piece:
    src: int      # trainer rank that sends it
    start: int    # flat element range of the full tensor
    end: int


@dataclass
class TensorPlan:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece]

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
        return sum((p.end - p.start) * t.itemsize for t in self.tensors for p in t.pieces if p.src == src)

    def sources(self) -> list[int]:
        return sorted({p.src for t in self.tensors for p in t.pieces})


@dataclass
class SyncPlan:
    version: int
    senders: int                       # trainer ranks that send (1 = gather-then-broadcast)
    buckets: list[Bucket]
    digest: bool = True                # engines digest what they receive (for verification)

    def to_json(self) -> dict:
        return {"version": self.version, "senders": self.senders, "digest": self.digest,
                "buckets": [[[t.name, t.dtype, list(t.shape), [[p.src, p.start, p.end] for p in t.pieces]]
                             for t in b.tensors] for b in self.buckets]}

    @classmethod
    def from_json(cls, data: dict) -> "SyncPlan":
        buckets = [Bucket([TensorPlan(name, dtype, tuple(shape), [Piece(*p) for p in pieces])
                           for name, dtype, shape, pieces in b]) for b in data["buckets"]]
        return cls(int(data["version"]), int(data["senders"]), buckets, bool(data.get("digest", True)))

    def check(self) -> None:
        """Every tensor covered exactly once by its pieces (no gap, no overlap)."""
        for b in self.buckets:
            for t in b.tensors:
                covered = 0
                for p in sorted(t.pieces, key=lambda p: p.start):
                    if p.start != covered or p.end < p.start or not 0 <= p.src < self.senders:
                        raise ValueError(f"sync plan: {t.name} pieces {t.pieces} do not tile [0, {t.numel})")
                    covered = p.end
                if covered != t.numel:
                    raise ValueError(f"sync plan: {t.name} pieces cover {covered} of {t.numel} elements")


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


def piece_sum(values: torch.Tensor, start: int) -> int:
    """Layout-free digest contribution of flat ``values`` holding elements ``start..`` of a tensor:
    the sum mod 2^64 of ``mix(index * GAMMA + bits * MIX2)`` (one multiply-xorshift round)."""
    flat = values.reshape(-1)
    if flat.device.type == "cpu":
        from ..numerics import cpu_kernel

        kernel = cpu_kernel.loaded()
        if kernel is not None:  # the same sum in one multi-threaded pass (~10x faster)
            return kernel.piece_sum(flat.contiguous(), start) & _MASK
    return _piece_sum_torch(flat, start)


def _piece_sum_torch(flat: torch.Tensor, start: int) -> int:
    """The definition in torch (any device). The 64-bit terms are summed as two 32-bit halves in
    int64 on the device (exact: no overflow below 2^31 terms per flush), read back once per
    2^30 elements, so a GPU tensor costs a handful of synchronisations."""
    width = flat.element_size()
    words = flat.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])
    chunk = _CHUNK if words.device.type == "cpu" else _CHUNK * 16
    index_mix = torch.arange(chunk, dtype=torch.int64, device=words.device) * _GAMMA  # j * GAMMA, wrapping
    total = 0
    lo = hi = torch.zeros((), dtype=torch.int64, device=words.device)
    for s in range(0, words.numel(), chunk):
        v = words[s:s + chunk].to(torch.int64)
        z = index_mix[:v.numel()] + _signed_mul(start + s, _GAMMA) + v * _MIX2
        z = (z ^ _shr(z, 29)) * _MIX1
        z = z ^ _shr(z, 32)
        lo = lo + (z & 0xFFFFFFFF).sum()
        hi = hi + _shr(z, 32).sum()
        if (s // chunk + 1) % ((1 << 30) // chunk) == 0:  # flush before the halves could overflow
            total += int(lo) + (int(hi) << 32)
            lo = hi = torch.zeros_like(lo)
    total += int(lo) + (int(hi) << 32)
    return total & _MASK


def _signed_mul(a: int, b: int) -> int:
    """``a * b`` mod 2^64 as a signed 64-bit value (a Python int torch accepts as an int64 scalar)."""
    r = (a * b) & _MASK
    return r - (1 << 64) if r >= 1 << 63 else r


def combine(entries: dict[str, tuple[str, tuple[int, ...], int]]) -> str:
    """One digest over ``{name: (dtype, shape, sum)}``, independent of order."""
    h = hashlib.sha256()
    for name in sorted(entries):
        dtype, shape, s = entries[name]
        h.update(f"{name}|{dtype}|{list(shape)}|{s & _MASK:016x}\n".encode())
    return h.hexdigest()


def tensor_sums(named: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """Digest entries of whole tensors."""
    return {n: (dtype_name(t.dtype), tuple(t.shape), piece_sum(t.detach().contiguous(), 0)) for n, t in named.items()}
