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
the handle (not on the sender's machine or GPU) acknowledges with the reason, and the sender
fails with it at once.

Stream order (CUDA): the sender synchronizes its stream before publishing (the staging copy is
complete), a receiver synchronizes its own after copying, before acknowledging. Nothing is
unpickled: handles travel as JSON (byte strings in hex) and are checked before use.

The group implements the two calls ``transport`` makes of a process group: ``broadcast([t],
opts)`` returning a work with ``wait()``, and ``shutdown()``. Messages are numbered in call
order on every member, as collectives are.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch

MAX_MAPPINGS = 2  # mappings a receiver keeps per sender (the current staging buffer and one before)


class IpcError(RuntimeError):
    """A colocated transfer that could not complete (the message names the member and why)."""


def _share(staging: torch.Tensor) -> dict:
    """The JSON handle of the whole allocation behind ``staging`` (a flat uint8 tensor at offset 0
    of its storage)."""
    storage = staging.untyped_storage()
    if staging.is_cuda:
        device, handle, size, offset, ref, ref_offset, event, event_sync = storage._share_cuda_()
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
    manager, handle, size = storage._share_filename_cpu_()
    return {"kind": "shm", "manager": manager.decode(), "handle": handle.decode(), "size": int(size)}


def _check_handle(h: object) -> dict:
    if not isinstance(h, dict) or h.get("kind") not in ("cuda", "shm"):
        raise IpcError(f"malformed IPC handle {h!r:.200}")
    ints = ("size",) + (("device", "offset", "ref_offset") if h["kind"] == "cuda" else ())
    if not all(isinstance(h.get(k), int) and not isinstance(h.get(k), bool) and h[k] >= 0 for k in ints):
        raise IpcError(f"malformed IPC handle: {', '.join(ints)} must be non-negative integers")
    strs = ("handle", "ref") if h["kind"] == "cuda" else ("manager", "handle")
    if not all(isinstance(h.get(k), str) and 0 < len(h[k]) <= 4096 for k in strs):
        raise IpcError(f"malformed IPC handle: {', '.join(strs)} must be short strings")
    return h


def _open(h: dict) -> torch.Tensor:
    """The sender's staging allocation as a flat uint8 tensor in this process."""
    if h["kind"] == "shm":
        storage = torch.UntypedStorage._new_shared_filename_cpu(h["manager"].encode(), h["handle"].encode(), h["size"])
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (h["size"],))
    if not torch.cuda.is_available():
        raise IpcError("the trainer shares CUDA memory and this engine has no CUDA device: use backend nccl or gloo")
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
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


class _Done:
    def wait(self, *_):
        return True


class _SenderWork:
    """Completes when every receiver acknowledged message ``seq`` (or fails with a receiver's reason)."""

    def __init__(self, group: "IpcGroup", seq: int):
        self.group, self.seq, self.done = group, seq, False

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
            raise IpcError(f"colocated transfer {self.seq}: no buffer from the trainer ({exc})") from None
        status = "ok"
        try:
            msg = json.loads(g.store.get(key))
            src = g.mapping(_check_handle(msg.get("handle")))
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
    group's prefixed store."""

    def __init__(self, store, rank: int, world: int, timeout_s: float, device: torch.device):
        self.store, self.rank, self.world = store, rank, world
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device
        self.seq = 0
        self.pending: _SenderWork | None = None
        self._staging: torch.Tensor | None = None
        self._handle: dict | None = None
        self._mapped: dict[str, torch.Tensor] = {}  # receiver: handle -> mapped allocation

    def staging(self, nbytes: int) -> torch.Tensor:
        """Sender: the first ``nbytes`` of the shared staging allocation (grown when too small;
        the previous transfer must be complete: its work waited)."""
        if self.pending is not None:
            self.pending.wait()
        if self._staging is None or self._staging.numel() < nbytes:
            staging = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
            if staging.device.type == "cpu":
                staging.share_memory_()
            self._staging, self._handle = staging, None
        return self._staging[:nbytes]

    def mapping(self, handle: dict) -> torch.Tensor:
        key = json.dumps(handle, sort_keys=True)
        if key not in self._mapped:
            while len(self._mapped) >= MAX_MAPPINGS:  # the oldest: a staging buffer the sender replaced
                self._mapped.pop(next(iter(self._mapped)))
            self._mapped[key] = _open(handle)
        return self._mapped[key]

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
            self._handle = _share(self._staging)
        self.store.set(str(seq), json.dumps({"handle": self._handle, "at": 0, "nbytes": data.numel()}))
        self.pending = _SenderWork(self, seq)
        return self.pending

    def shutdown(self) -> None:
        self._mapped.clear()
        self._staging = self._handle = None
