"""Colocated engines: a transfer group whose broadcast hands each receiver a handle to the
sender's buffer instead of sending its bytes (``rollout.vllm.backend: ipc``).

Trainer and engine share a machine (and, for CUDA, a GPU: the verl/TRL colocate layout). The
sender stages each buffer in one allocation of its own and publishes a handle to it under the
group's store prefix (derived from the sync secret, so only the job's processes find it): a CUDA
IPC handle for a CUDA staging buffer, a POSIX shared-memory name for a host one. Each receiver
maps the allocation (once; the mapping is kept while the staging buffer stays the same), copies
the published range into its own buffer on its device (device to device on a GPU: nothing goes
through host memory) and acknowledges; the sender's work completes when every receiver has
acknowledged, and only then may the staging buffer be written again. A receiver that cannot map
the handle (not on the sender's machine or GPU), or whose handle claims more bytes than the
allocation holds, acknowledges with the reason, and the sender fails with it at once.

Host segments are the sender's own files, ``/dev/shm/dist-sr-ipc-<tag>-<pid>-<n>`` (``<tag>``: a
one-way function of the store prefix; mode 0600), never torch's reference-counted ones, which any
process that maps them with another size can unlink. Only the sender unlinks: as soon as every
receiver acknowledged a transfer from a segment (all have mapped it; from then on no kill, not even
SIGKILL, can leave it behind: its memory goes with the last mapping), else when it is replaced,
closed, collected or the process exits. A kill before that leaves the name, which the job's next
sender removes (a segment whose lock nobody holds). The sender holds an exclusive ``flock`` on the
file while it lives; each receiver waits for it on a thread of its own and drops its mapping the
moment the sender lets go of the segment or dies, so a dead trainer's buffer is not kept in RAM
by the engines. (No SIGTERM handler: a Python handler runs only when the main thread returns to
Python, and a trainer blocked in a collective would stop dying on SIGTERM.)

Stream order (CUDA): the sender synchronizes its stream before publishing (the staging copy is
complete), a receiver synchronizes its own after copying, before acknowledging. Nothing is
unpickled: handles travel as JSON (byte strings in hex) and are checked before use.

The group implements the two calls ``transport`` makes of a process group: ``broadcast([t],
opts)`` returning a work with ``wait()``, and ``shutdown()``. Messages are numbered in call
order on every member, as collectives are.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch

MAX_MAPPINGS = 2  # mappings a receiver keeps per sender (the current staging buffer and one before)
SHM_DIR = Path("/dev/shm")
_SEGMENT = re.compile(r"dist-sr-ipc-([0-9a-f]{16})-([0-9]+)-([0-9a-f]{8})")
NO_TAG = "0" * 16  # groups built without a store prefix (tests)
ORPHAN_AGE_S = 10.0  # an unlocked segment older than this has no sender (a creator locks it at once)


class IpcError(RuntimeError):
    """A colocated transfer that could not complete (the message names the member and why)."""


def segment_tag(prefix: str) -> str:
    """The tag in a group's segment names: a one-way function of its store prefix (which only the
    job's processes can derive), so a receiver maps only its job's segments and a listing of
    ``/dev/shm`` gives nothing away."""
    return hashlib.sha256(b"dist-sr ipc segment\n" + prefix.encode()).hexdigest()[:16]


class _Segment:
    """Sender: a shared-memory file of its own, mapped as a flat uint8 tensor, with an exclusive
    ``flock`` held for its whole life (receivers learn from it that the sender let go or died)."""

    def __init__(self, tag: str, nbytes: int):
        _sweep(tag)
        self.name = f"dist-sr-ipc-{tag}-{os.getpid()}-{secrets.token_hex(4)}"
        self.path, self.size = SHM_DIR / self.name, max(nbytes, 1)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        self._release = weakref.finalize(self, _release, self.path, fd)  # also at exit
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            os.posix_fallocate(fd, 0, self.size)  # a full /dev/shm is an error here, not a SIGBUS mid-copy
        except OSError as exc:
            self.close()
            raise IpcError(
                f"cannot stage {self.size} bytes in {SHM_DIR} ({exc.strerror}): give the trainer's machine (its pod) "
                "a larger /dev/shm (docker --shm-size, a Kubernetes emptyDir of medium Memory), or use backend gloo"
            ) from None
        self.tensor = _map(self.path)  # through a descriptor of its own: closing ``fd`` drops the lock at once

    def handle(self) -> dict:
        return {"kind": "shm", "name": self.name, "size": self.size}

    def unlink(self) -> None:
        """Remove the name (every receiver has mapped the segment); the memory stays while mapped."""
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unlink and let go (receivers drop their mappings); the memory goes with the last one."""
        self._release()


def _map(path: Path) -> torch.Tensor:
    """The whole file as a flat uint8 tensor (the mapping keeps a descriptor of its own)."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return torch.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size), dtype=torch.uint8)
    finally:
        os.close(fd)


def _release(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)  # drops the flock: every receiver's watcher wakes


def _sweep(tag: str) -> None:
    """Remove this job's segments whose sender died before every receiver had mapped them (nobody
    holds their lock)."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        m = _SEGMENT.fullmatch(name)
        if m is None or m.group(1) != tag:
            continue
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if time.time() - os.fstat(fd).st_ctime > ORPHAN_AGE_S:
                (SHM_DIR / name).unlink(missing_ok=True)
        except OSError:
            pass  # locked: its sender lives
        finally:
            os.close(fd)


def _share_cuda(staging: torch.Tensor) -> dict:
    """The JSON handle of the whole CUDA allocation behind ``staging`` (a flat uint8 tensor at
    offset 0 of its storage)."""
    device, handle, size, offset, ref, ref_offset, event, event_sync = staging.untyped_storage()._share_cuda_()
    return {
        "kind": "cuda",
        "device": int(device),
        "handle": handle.hex(),
        "size": int(size),
        "offset": int(offset),
        "ref": ref.hex(),
        "ref_offset": int(ref_offset),
        "event": event.hex() if event else None,
        "event_sync": bool(event_sync),
    }


def _check_handle(h: object, tag: str) -> dict:
    if not isinstance(h, dict) or h.get("kind") not in ("cuda", "shm"):
        raise IpcError(f"malformed IPC handle {h!r:.200}")
    ints = ("size",) + (("device", "offset", "ref_offset") if h["kind"] == "cuda" else ())
    if not all(isinstance(h.get(k), int) and not isinstance(h.get(k), bool) and h[k] >= 0 for k in ints):
        raise IpcError(f"malformed IPC handle: {', '.join(ints)} must be non-negative integers")
    strs = ("handle", "ref") if h["kind"] == "cuda" else ("name",)
    if not all(isinstance(h.get(k), str) and 0 < len(h[k]) <= 4096 for k in strs):
        raise IpcError(f"malformed IPC handle: {', '.join(strs)} must be short strings")
    if h["kind"] == "shm":
        m = _SEGMENT.fullmatch(h["name"])
        if m is None or m.group(1) != tag:
            raise IpcError(f"malformed IPC handle: {h['name']!r:.200} is not a shared-memory segment of this group")
    return h


def _open(h: dict) -> tuple[torch.Tensor, int | None]:
    """The sender's staging allocation as a flat uint8 tensor in this process, after checking its
    real size against the one the handle claims; and, for a host segment, a descriptor of it to
    wait on (the sender's lock)."""
    if h["kind"] == "shm":
        path = SHM_DIR / h["name"]
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # to wait on the sender's lock
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != h["size"]:
                raise IpcError(
                    f"the IPC handle claims {h['size']} bytes, the segment {h['name']} holds {st.st_size}: refused"
                )
            mapped = _map(path)
            if mapped.numel() != st.st_size:  # replaced between the two opens
                raise IpcError(f"the segment {h['name']} changed while it was mapped: refused")
            return mapped, fd
        except BaseException:
            os.close(fd)
            raise
    if not torch.cuda.is_available():
        raise IpcError("the trainer shares CUDA memory and this engine has no CUDA device: use backend nccl or gloo")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    mapped = rebuild_cuda_tensor(
        torch.Tensor,
        (h["size"],),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        h["device"],
        bytes.fromhex(h["handle"]),
        h["size"],
        h["offset"],
        False,
        bytes.fromhex(h["ref"]),
        h["ref_offset"],
        bytes.fromhex(h["event"]) if h.get("event") else None,
        h.get("event_sync", False),
    )
    real = _cuda_allocation_end(mapped.data_ptr())
    if real is not None and mapped.data_ptr() + h["size"] > real:
        raise IpcError(
            f"the IPC handle claims {h['size']} bytes, the CUDA allocation holds "
            f"{real - mapped.data_ptr()} from its start: refused"
        )
    return mapped, None


def _cuda_allocation_end(ptr: int) -> int | None:
    """The end address of the CUDA allocation holding ``ptr`` (the driver's
    ``cuMemGetAddressRange``), or None where the driver cannot say."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    if lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr)) != 0:
        return None
    if not base.value <= ptr < base.value + size.value:
        return None  # not a range that holds it: the driver cannot say
    return base.value + size.value


class _Done:
    def wait(self, *_):
        return True


class _SenderWork:
    """Completes when every receiver acknowledged message ``seq`` (or fails with a receiver's
    reason). Once all took it, every receiver has mapped the segment: its name is unlinked."""

    def __init__(self, group: "IpcGroup", seq: int):
        self.group, self.seq, self.done = group, seq, False
        self.segment = group._segment

    def wait(self, *_):
        if self.done:
            return True
        g = self.group
        keys = [f"{self.seq}/ack/{r}" for r in range(1, g.world)]
        try:
            g.store.wait(keys, g.timeout)
        except RuntimeError as exc:
            raise IpcError(
                f"colocated transfer {self.seq}: not every engine took the buffer within "
                f"{g.timeout.total_seconds():.0f}s ({exc})"
            ) from None
        refusals = [a for a in (g.store.get(k).decode() for k in keys) if a != "ok"]
        for k in (*keys, str(self.seq)):
            g.store.delete_key(k)
        self.done = True
        g.pending = None
        if refusals:
            raise IpcError(f"colocated transfer {self.seq} refused: {refusals[0]}")
        if self.segment is not None:
            self.segment.unlink()
        return True


class _ReceiverWork:
    """Maps the sender's buffer of message ``seq`` and copies it into ``out`` on ``wait``."""

    def __init__(self, group: "IpcGroup", seq: int, out: torch.Tensor):
        self.group, self.seq, self.out, self.done = group, seq, out, False

    def wait(self, *_):
        if self.done:
            return True
        g, key = self.group, str(self.seq)
        try:
            g.store.wait([key], g.timeout)
        except RuntimeError as exc:
            g.drop_mappings()  # the trainer is gone or stuck: its buffers are not kept
            raise IpcError(f"colocated transfer {self.seq}: no buffer from the trainer ({exc})") from None
        status = "ok"
        try:
            msg = json.loads(g.store.get(key))
            src = g.mapping(_check_handle(msg.get("handle"), g.tag))
            at, n = msg.get("at"), self.out.numel() * self.out.element_size()
            if msg.get("nbytes") != n or not isinstance(at, int) or at < 0 or at + n > src.numel():
                raise IpcError(
                    f"colocated transfer {self.seq}: the trainer published {msg.get('nbytes')} bytes at "
                    f"{at}, this engine expects {n} within {src.numel()}"
                )
            self.out.reshape(-1).view(torch.uint8).copy_(src[at : at + n])
            if self.out.is_cuda:
                torch.cuda.current_stream(self.out.device).synchronize()
        except Exception as exc:  # noqa: BLE001  (the sender hears the reason, then this rank raises it)
            status = f"rank {g.rank}: {exc}"[:2000]
            raise
        finally:
            g.store.set(f"{self.seq}/ack/{g.rank}", status)
            self.done = True
        return True


class IpcGroup:
    """Rank 0 sends (the trainer), ranks ``1..world-1`` receive (engine workers); ``store``: the
    group's prefixed store; ``tag``: ``segment_tag`` of its prefix (the names of its host segments)."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, device: torch.device, *, tag: str = NO_TAG):
        self.store, self.rank, self.world = store, rank, world
        self.timeout = timedelta(seconds=timeout_s)
        self.device, self.tag = device, tag
        self.seq = 0
        self.pending: _SenderWork | None = None
        self._staging: torch.Tensor | None = None
        self._segment: _Segment | None = None  # sender, host staging: the file behind ``_staging``
        self._handle: dict | None = None
        self._mapped: dict[str, torch.Tensor] = {}  # receiver: handle -> mapped allocation
        self._lock = threading.Lock()  # receiver: ``_mapped`` is also changed by the watchers

    def staging(self, nbytes: int) -> torch.Tensor:
        """Sender: the first ``nbytes`` of the shared staging allocation (grown when too small;
        the previous transfer must be complete: its work waited)."""
        if self.pending is not None:
            self.pending.wait()
        if self._staging is None or self._staging.numel() < nbytes:
            self._release_staging()
            if self.device.type == "cpu":
                self._segment = _Segment(self.tag, nbytes)
                self._staging = self._segment.tensor
            else:
                self._staging = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return self._staging[:nbytes]

    def _release_staging(self) -> None:
        if self._segment is not None:
            self._segment.close()
        self._staging = self._segment = self._handle = None

    def mapping(self, handle: dict) -> torch.Tensor:
        key = json.dumps(handle, sort_keys=True)
        with self._lock:
            if key in self._mapped:
                return self._mapped[key]
            while len(self._mapped) >= MAX_MAPPINGS:  # the oldest: a staging buffer the sender replaced
                self._mapped.pop(next(iter(self._mapped)))
            tensor, fd = _open(handle)
            self._mapped[key] = tensor
        if fd is not None:
            threading.Thread(
                target=_drop_when_released, args=(weakref.ref(self), key, fd), name="dist-sr-ipc-watch", daemon=True
            ).start()
        return tensor

    def drop_mappings(self) -> None:
        """Receiver: let go of every mapped buffer (its memory goes once nothing else maps it)."""
        with self._lock:
            self._mapped.clear()

    def broadcast(self, tensors: list[torch.Tensor], opts=None):
        (t,) = tensors
        seq, self.seq = self.seq, self.seq + 1
        if self.rank != 0:
            return _ReceiverWork(self, seq, t)
        data = t.reshape(-1).view(torch.uint8)
        staging = self._staging
        if staging is None or data.data_ptr() != staging.data_ptr():  # not packed in place: stage it
            staging = self.staging(data.numel())
            staging.copy_(data)
        if self.world == 1:
            return _Done()
        if staging.is_cuda:
            torch.cuda.current_stream(staging.device).synchronize()  # the bytes are there before anyone reads
        if self._handle is None:
            assert self._staging is not None
            self._handle = self._segment.handle() if self._segment is not None else _share_cuda(self._staging)
        self.store.set(str(seq), json.dumps({"handle": self._handle, "at": 0, "nbytes": data.numel()}))
        self.pending = _SenderWork(self, seq)
        return self.pending

    def shutdown(self) -> None:
        self.drop_mappings()
        self._release_staging()


def _drop_when_released(group_ref, key: str, fd: int) -> None:
    """Receiver's watcher of one host segment: waits for the sender's lock (held while the sender
    keeps the segment; the kernel drops it when the sender dies), then drops the mapping."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        pass
    finally:
        os.close(fd)
    group = group_ref()
    if group is not None:
        with group._lock:
            group._mapped.pop(key, None)
