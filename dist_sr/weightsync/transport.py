"""The weight-transfer groups: one group per sending trainer rank, stateless (independent of
``torch.distributed``'s default group, which trainer and engines each already use for themselves).
A group is a ``Channel``: gloo with buffers in host memory, NCCL with buffers on the current
CUDA device, or ``ipc`` for engines colocated with the trainer (``weightsync.ipc``: handles to a
shared buffer, CUDA IPC on a GPU, shared memory on a host); everything below takes the channel
and allocates where it says, so every backend runs the same code (no CUDA call outside
``transfer_group``, ``cuda_device`` and the ipc group's own module).

Group ``m`` holds trainer rank ``m`` (as group rank 0) and every engine worker (group ranks
``1..W``, each engine at its own rank offset). Trainer rank 0 hosts the rendezvous store, listening
on the configured address only; every rebuild of the fleet uses a fresh ``generation`` prefix, so
stale keys never meet new members, under a prefix derived from the sync secret
(``auth.store_prefix``), so a process without it cannot find or plant the groups' keys.
Buckets are received as one flat byte buffer per source, so a sync is a few large collectives.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..numerics.digest import DTYPES
from .ipc import IpcGroup, segment_tag
from .plan import Bucket


def listen_socket(host: str, port: int, wait_s: float = 60.0) -> socket.socket:
    """A socket listening on ``host:port`` only (not every interface). A host name is resolved
    (retried for ``wait_s``: a pod's own DNS record can lag its start)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            break
        except socket.gaierror as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"weight-transfer store: cannot resolve group_host {host!r} ({exc}); set "
                    "rollout.vllm.group_host to an address of trainer rank 0"
                ) from None
            time.sleep(1)
    s = socket.socket(family, kind, proto)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(addr)
    except OSError as exc:
        s.close()
        raise RuntimeError(
            f"weight-transfer store: cannot listen on {host}:{port} ({exc}); group_host must be an "
            "address of trainer rank 0's machine, and the port free"
        ) from None
    s.listen(1024)
    return s


def open_store(host: str, port: int, *, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The groups' store: the master listens on ``host`` only; others connect to it."""
    fd = listen_socket(host, port).detach() if is_master else None
    return dist.TCPStore(
        host,
        port,
        is_master=is_master,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        use_libuv=True,
        **({"master_listen_fd": fd} if is_master else {}),
    )


BACKENDS = ("gloo", "nccl", "ipc")


@dataclass(frozen=True)
class Channel:
    """One transfer group and the device its buffers live on."""

    group: object
    device: torch.device

    @property
    def backend(self) -> str:
        if isinstance(self.group, IpcGroup):
            return "ipc"
        return "gloo" if self.device.type == "cpu" else "nccl"

    def shutdown(self) -> None:
        self.group.shutdown()


def cuda_device(what: str = "this process") -> torch.device:
    """The current CUDA device, or a ``ValueError`` naming the fix."""
    if not torch.cuda.is_available():
        raise ValueError(
            f"the weight-transfer backend 'nccl' needs a CUDA device, and {what} has none: use "
            "rollout.vllm.backend: gloo (or auto, which picks gloo for CPU tensors)"
        )
    return torch.device("cuda", torch.cuda.current_device())


def transfer_group(
    store: dist.Store,
    generation: int,
    src: int,
    rank: int,
    world: int,
    timeout_s: float,
    *,
    prefix: str,
    backend: str = "gloo",
) -> Channel:
    """Group ``src`` of ``generation`` on ``backend``: ``rank`` among ``world`` members; ``prefix``
    from ``auth.store_prefix``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-transfer backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "nccl" or (backend == "ipc" and torch.cuda.is_available()):
        device = cuda_device()
    else:
        device = torch.device("cpu")
    prefixed = dist.PrefixStore(f"{prefix}/{generation}/group{src}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "ipc":  # colocated: no process group, handles through the store
        return Channel(IpcGroup(prefixed, rank, world, timeout_s, device, tag=segment_tag(prefix)), device)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout  # a collective that never returns is aborted by NCCL's watchdog
        return Channel(dist.ProcessGroupNCCL(prefixed, rank, world, opts), device)
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    if iface:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface)]
        return Channel(dist.ProcessGroupGloo(prefixed, rank, world, opts), device)
    return Channel(dist.ProcessGroupGloo(prefixed, rank, world, timeout), device)


def broadcast(channel: Channel, buffer: torch.Tensor):
    """Start a broadcast of ``buffer`` (on the channel's device) from group rank 0 (the trainer);
    returns the work handle (on NCCL, waiting orders the current stream after it)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return channel.group.broadcast([buffer], opts)


class Packer:
    """Sender side: one contiguous byte buffer per bucket (a lone contiguous tensor is sent in
    place). Two staging buffers, used in turn (``slot``), so the next bucket is packed while the
    last is on the wire; each is reused across syncs, so its pages are touched once."""

    SLOTS = 2

    def __init__(self):
        self._staging: list[torch.Tensor | None] = [None] * self.SLOTS

    def pack(self, chunks: list[torch.Tensor], nbytes: int, channel: Channel, slot: int = 0) -> torch.Tensor:
        """The chunks as one byte buffer on the channel's device, in staging buffer ``slot`` (the
        caller waits for that buffer's last broadcast first); an ``ipc`` channel's: its shared
        staging buffer, which the broadcast then publishes without another copy."""
        size = sum(c.numel() * c.element_size() for c in chunks)
        if size != nbytes:
            raise RuntimeError(f"bucket buffer has {size} bytes, the plan says {nbytes}")
        device = channel.device
        if isinstance(channel.group, IpcGroup):
            buf = channel.group.staging(nbytes)
        elif len(chunks) == 1 and chunks[0].is_contiguous() and chunks[0].device == device:
            return chunks[0].reshape(-1).view(torch.uint8)
        else:
            staging = self._staging[slot]
            if staging is None or staging.numel() < nbytes or staging.device != device:
                self._staging[slot] = staging = None  # the old pages go before the new are taken
                staging = self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
            buf = staging[:nbytes]
        at = 0
        for c in chunks:
            b = c.reshape(-1).contiguous().view(torch.uint8)
            buf[at : at + b.numel()].copy_(b)
            at += b.numel()
        return buf


def post_bucket(channels: dict[int, Channel], bucket: Bucket):
    """Engine side: start receiving every source's buffer of ``bucket`` (returns buffers, works)."""
    buffers, works = {}, []
    for src in bucket.sources():
        buffers[src] = torch.empty(bucket.nbytes(src), dtype=torch.uint8, device=channels[src].device)
        works.append(broadcast(channels[src], buffers[src]))
    return buffers, works


def post_sizes(channels: dict[int, Channel], bucket: Bucket) -> dict:
    """Engine side of a delta bucket: start receiving each source's buffer length (it precedes
    the buffer); ``post_sized`` waits for them."""
    sizes = {}
    for src in bucket.sources():
        size = torch.zeros(1, dtype=torch.int64, device=channels[src].device)
        sizes[src] = (size, broadcast(channels[src], size))
    return sizes


def post_sized(channels: dict[int, Channel], bucket: Bucket, sizes: dict):
    """Engine side of a delta bucket: wait for the lengths ``post_sizes`` started receiving,
    check them against the bucket, and start receiving the buffers (returns buffers, works)."""
    buffers, works = {}, []
    for src, (size, work) in sizes.items():
        work.wait()
        spans = sum(1 for t in bucket.tensors for p in t.spans if p.src == src)
        if not 0 <= int(size) <= 16 * bucket.nbytes(src) + 128 * spans + 2**16:
            raise RuntimeError(f"delta bucket from trainer rank {src} claims {int(size)} bytes")
        buffers[src] = torch.empty(int(size), dtype=torch.uint8, device=channels[src].device)
        works.append(broadcast(channels[src], buffers[src]))
    return buffers, works


def send_sized(channel: Channel, payload: torch.Tensor):
    """Trainer side of a sized buffer: its length, then the bytes. Returns (the bytes sent, the
    payload's work handle: wait on it before ``payload`` is reused)."""
    payload = payload.to(channel.device)
    broadcast(channel, torch.tensor([payload.numel()], dtype=torch.int64, device=channel.device)).wait()
    return 8 + payload.numel(), broadcast(channel, payload)


def finish_bucket(bucket: Bucket, posted) -> list[tuple[str, torch.Tensor]]:
    """Wait for a posted bucket and assemble its full tensors (views into the buffer when a
    tensor arrives in one piece)."""
    buffers, works = posted
    for w in works:
        w.wait()
    cursor = {src: 0 for src in buffers}
    out = []
    for t in bucket.tensors:
        dtype, item = DTYPES[t.dtype], t.itemsize
        if len(t.spans) == 1:
            (p,) = t.spans
            raw = buffers[p.src][cursor[p.src] : cursor[p.src] + t.numel * item]
            cursor[p.src] += t.numel * item
            out.append((t.name, raw.view(dtype).view(t.shape)))
            continue
        full = torch.empty(t.numel, dtype=dtype, device=buffers[t.spans[0].src].device)
        for p in t.spans:
            n = (p.end - p.start) * item
            full[p.start : p.end] = buffers[p.src][cursor[p.src] : cursor[p.src] + n].view(dtype)
            cursor[p.src] += n
        out.append((t.name, full.view(t.shape)))
    return out


def receive_buckets(channels: dict[int, Channel], buckets: list[Bucket], sized: bool = False):
    """Yield each bucket's tensors, receiving the next bucket while the caller loads this one.

    ``sized`` (delta buckets, whose lengths are known only when they are sent): yield each
    bucket's raw buffers per source instead, for the caller to decode; the next bucket's lengths
    are posted before the caller decodes this one, so the trainer encodes bucket i + 1 while the
    engine decodes bucket i."""
    if not sized:
        posted = post_bucket(channels, buckets[0]) if buckets else None
        for i, bucket in enumerate(buckets):
            current = posted
            posted = post_bucket(channels, buckets[i + 1]) if i + 1 < len(buckets) else None
            yield finish_bucket(bucket, current)
        return
    posted = post_sized(channels, buckets[0], post_sizes(channels, buckets[0])) if buckets else None
    for i in range(len(buckets)):
        buffers, works = posted
        sizes = post_sizes(channels, buckets[i + 1]) if i + 1 < len(buckets) else None
        for w in works:
            w.wait()
        yield buffers
        posted = post_sized(channels, buckets[i + 1], sizes) if sizes is not None else None
