"""The colocated transfer group (``weightsync.ipc``): handles instead of bytes. Host buffers travel
as shared memory (run here, in one process and across processes through the fleet tests in
``test_delta_sync.py``); CUDA buffers as CUDA IPC handles, which need two processes on one GPU
(the test at the end runs on a lent GPU and skips elsewhere)."""

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_sr.net import free_port
from dist_sr.testing.vllm_engines import REPO
from dist_sr.weightsync import ipc
from dist_sr.weightsync.ipc import SHM_DIR, IpcError, IpcGroup
from dist_sr.weightsync.transport import Channel, Packer, receive_buckets, send_sized, transfer_group


def _store():
    return dist.TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )


def _client(master):
    """A store client of its own (as each process has: a client's calls are not concurrent)."""
    return dist.PrefixStore(
        "g", dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    )


def _pair(timeout_s=10.0, receivers=1):
    store = _store()
    cpu = torch.device("cpu")
    sender = IpcGroup(dist.PrefixStore("g", store), 0, 1 + receivers, timeout_s, cpu)
    sender.master = store  # keep the listening store alive with the group
    return sender, [IpcGroup(_client(store), r, 1 + receivers, timeout_s, cpu) for r in range(1, 1 + receivers)]


def _receive_in_thread(group, sizes, out, errors):
    def run():
        try:
            for n in sizes:
                buf = torch.empty(n, dtype=torch.uint8)
                group.broadcast([buf]).wait()
                out.append(buf)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t


def test_buffers_of_growing_size_arrive_bitwise_through_shared_memory_at_every_receiver():
    sender, receivers = _pair(receivers=2)
    g = torch.Generator().manual_seed(0)
    sizes = [5, 4096, 3, 70000, 70000, 1]
    payloads = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    outs, errors = [[], []], []
    threads = [_receive_in_thread(r, sizes, outs[i], errors) for i, r in enumerate(receivers)]
    for p in payloads:
        sender.broadcast([p.clone()]).wait()  # the sender's buffer may change once the work is done
    for t in threads:
        t.join()
    assert not errors
    for out in outs:
        assert [o.tolist() for o in out] == [p.tolist() for p in payloads]
    assert sender._staging.numel() == 70000 and len(receivers[0]._mapped) <= 2  # grown twice, old maps dropped
    assert not any(sender.store.check([k]) for k in ("0", "5", "5/ack/1"))  # keys removed once acknowledged


def test_a_packed_bucket_is_published_from_the_staging_buffer_without_another_copy():
    sender, (receiver,) = _pair()
    channel = Channel(sender, torch.device("cpu"))
    assert channel.backend == "ipc"
    chunks = [torch.arange(6, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16)]
    buf = Packer().pack(chunks, 30, channel)
    assert buf.data_ptr() == sender._staging.data_ptr() == sender._segment.tensor.data_ptr()
    out, errors = [], []
    t = _receive_in_thread(receiver, [30], out, errors)
    sender.broadcast([buf]).wait()
    t.join()
    assert not errors and torch.equal(out[0][:24].view(torch.float32), chunks[0])


def test_sized_buffers_and_pipelined_buckets_use_the_same_group():
    """``send_sized`` (length, then bytes) and the receiver's pipelined posts number messages alike."""
    sender, (receiver,) = _pair()
    tx, rx = Channel(sender, torch.device("cpu")), Channel(receiver, torch.device("cpu"))
    payloads = [torch.arange(n, dtype=torch.uint8) for n in (7, 300, 0, 12)]
    got, errors = [], []

    class _B:  # a delta bucket: one source, one tensor, the plan's size bound
        def __init__(self, n):
            self.tensors = []
            self.n = n

        def sources(self):
            return [0]

        def nbytes(self, src):
            return max(self.n, 1)

    def run():
        try:
            for raw in receive_buckets({0: rx}, [_B(len(p)) for p in payloads], sized=True):
                got.append(raw[0].clone())
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    for p in payloads:
        _, work = send_sized(tx, p)
        work.wait()
    t.join()
    assert not errors and [g.tolist() for g in got] == [p.tolist() for p in payloads]


def test_a_receiver_that_cannot_take_the_buffer_fails_the_sender_at_once_with_its_reason():
    sender, (receiver,) = _pair(timeout_s=30)
    out, errors = [], []
    t = _receive_in_thread(receiver, [8], out, errors)  # expects 8 bytes
    with pytest.raises(IpcError, match="refused: rank 1: .*published 9 bytes.*expects 8"):
        sender.broadcast([torch.zeros(9, dtype=torch.uint8)]).wait()
    t.join()
    assert len(errors) == 1 and "expects 8" in str(errors[0])


def test_a_receiver_that_never_comes_times_out_with_a_clear_error():
    sender, _ = _pair(timeout_s=1)
    with pytest.raises(IpcError, match="not every engine took the buffer within 1s"):
        sender.broadcast([torch.zeros(4, dtype=torch.uint8)]).wait()


def test_a_malformed_handle_is_refused_before_anything_is_mapped():
    sender, (receiver,) = _pair(timeout_s=5)
    sender.store.set("0", json.dumps({"handle": {"kind": "shm", "manager": 1, "handle": "x", "size": 4}, "nbytes": 4}))
    with pytest.raises(IpcError, match="malformed IPC handle"):
        receiver.broadcast([torch.empty(4, dtype=torch.uint8)]).wait()
    assert sender.store.get("0/ack/1").decode().startswith("rank 1: malformed IPC handle")


@pytest.mark.parametrize("name", ["../../etc/passwd", "torch_1_2_3", f"dist-sr-ipc-{'1' * 16}-7-0123abcd"])
def test_a_handle_naming_anything_but_a_segment_of_this_group_is_refused(name):
    sender, (receiver,) = _pair(timeout_s=5)
    sender.store.set("0", json.dumps({"handle": {"kind": "shm", "name": name, "size": 4}, "at": 0, "nbytes": 4}))
    with pytest.raises(IpcError, match="not a shared-memory segment of this group"):
        receiver.broadcast([torch.empty(4, dtype=torch.uint8)]).wait()


def _segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith("dist-sr-ipc-")}


@pytest.mark.parametrize("claim", [2, 0.5])
def test_a_handle_claiming_another_size_than_the_segment_is_refused_and_the_segment_stays_usable(claim):
    sender, (hostile, honest) = _pair(timeout_s=5, receivers=2)
    staging = sender.staging(4096)
    staging.copy_(torch.arange(4096) % 251)
    handle = sender._segment.handle()
    lying = dict(handle, size=int(handle["size"] * claim))
    sender.store.set("0", json.dumps({"handle": lying, "at": 0, "nbytes": 16}))
    with pytest.raises(IpcError, match=f"claims {lying['size']} bytes, the segment {handle['name']} holds 4096"):
        hostile.broadcast([torch.empty(16, dtype=torch.uint8)]).wait()
    hostile.shutdown()  # a receiver that lets go never removes what it did not create
    assert handle["name"] in _segments()
    assert torch.equal(honest.mapping(handle), (torch.arange(4096) % 251).to(torch.uint8))  # later engines map it
    sender.shutdown()
    assert handle["name"] not in _segments()


def test_a_segment_is_unlinked_once_every_receiver_has_mapped_it():
    sender, receivers = _pair(receivers=2)
    sizes = [1000, 1000, 5000]
    outs, errors = [[], []], []
    threads = [_receive_in_thread(r, sizes, outs[i], errors) for i, r in enumerate(receivers)]
    names = []
    for n in sizes:
        sender.broadcast([torch.full((n,), n % 256, dtype=torch.uint8)]).wait()
        names.append(sender._segment.name)
        assert names[-1] not in _segments()  # gone from /dev/shm as soon as both took it
    for t in threads:
        t.join()
    assert not errors and names[0] == names[1] != names[2]  # grown once, re-used in between
    assert [[int(o[0]) for o in out] for out in outs] == [[232, 232, 136]] * 2


_TRAINER = """
import sys, time, torch, torch.distributed as dist
from datetime import timedelta
from dist_sr.weightsync.ipc import IpcGroup
port, n, send = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "send"
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
g = IpcGroup(dist.PrefixStore("g", store), 0, 2, 60, torch.device("cpu"), tag="ab" * 8)
if send:
    g.broadcast([torch.full((n,), 7, dtype=torch.uint8)]).wait()
else:
    g.staging(n)
print(g._segment.name, flush=True)
time.sleep(600)
"""


def _trainer(n: int, send: bool):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(port), str(n), "send" if send else "stage"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return proc, port


def _mapped_here(name: str) -> bool:
    return name in Path("/proc/self/maps").read_text()


def test_a_killed_trainer_leaves_nothing_in_shm_and_the_engine_drops_its_buffer_at_once():
    n = 8 << 20
    proc, port = _trainer(n, send=True)
    try:
        store = dist.PrefixStore("g", dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)))
        engine = IpcGroup(store, 1, 2, 60, torch.device("cpu"), tag="ab" * 8)
        out = torch.empty(n, dtype=torch.uint8)
        engine.broadcast([out]).wait()
        name = proc.stdout.readline().strip()
        assert int(out[-1]) == 7 and len(engine._mapped) == 1 and _mapped_here(name)
        assert name not in _segments()  # unlinked once the engine mapped it: a SIGKILL cannot leak it
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        while _mapped_here(name):  # the engine's watcher saw the trainer's lock go
            assert time.monotonic() < deadline, "the engine kept a dead trainer's buffer mapped"
            time.sleep(0.05)
        assert engine._mapped == {}
    finally:
        proc.kill()


def test_a_segment_whose_trainer_died_before_any_engine_mapped_it_is_removed_by_the_next_trainer(monkeypatch):
    proc, _ = _trainer(4096, send=False)
    try:
        name = proc.stdout.readline().strip()
        assert name in _segments()
        proc.kill()
        proc.wait()
        monkeypatch.setattr(ipc, "ORPHAN_AGE_S", 0.0)  # it was made a moment ago: no sender is still taking its lock
        other = IpcGroup(None, 0, 2, 5, torch.device("cpu"), tag="cd" * 8)
        other.staging(16)  # another job's sender leaves it alone
        assert name in _segments()
        sender = IpcGroup(None, 0, 2, 5, torch.device("cpu"), tag="ab" * 8)
        sender.staging(16)  # the job's next sender removes it; its own stays
        assert name not in _segments() and sender._segment.name in _segments()
        sender.shutdown()
        other.shutdown()
    finally:
        proc.kill()


def test_transfer_group_builds_an_ipc_channel_on_the_host_without_cuda():
    ch = transfer_group(_store(), 0, 0, 0, 2, 5.0, prefix="p", backend="ipc")
    assert ch.backend == "ipc" and ch.device == (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    )


_CUDA_RECEIVER = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from dist_sr.weightsync.ipc import IpcGroup
port, n = int(sys.argv[1]), int(sys.argv[2])
store = dist.PrefixStore("g", dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)))
g = IpcGroup(store, 1, 2, 60, torch.device("cuda", 0))
for i in range(3):
    buf = torch.empty(n, dtype=torch.uint8, device="cuda")
    g.broadcast([buf]).wait()
    print(int(buf.sum(dtype=torch.int64)), flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CUDA IPC: two processes on one GPU)")
def test_cuda_buffers_reach_another_process_by_ipc_handle_bitwise():
    store = _store()
    n = 3 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", _CUDA_RECEIVER, str(store.port), str(n)], stdout=subprocess.PIPE, text=True
    )
    sender = IpcGroup(dist.PrefixStore("g", store), 0, 2, 60, torch.device("cuda", 0))
    g = torch.Generator(device="cuda").manual_seed(0)
    sums = []
    for _ in range(3):
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda", generator=g)
        sums.append(int(data.sum(dtype=torch.int64)))
        sender.broadcast([data]).wait()
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and [int(x) for x in out.split()] == sums


_CUDA_LIAR_RECEIVER = """
import sys, torch, torch.distributed as dist
from datetime import timedelta
from dist_sr.weightsync.ipc import IpcError, IpcGroup
port, n = int(sys.argv[1]), int(sys.argv[2])
store = dist.PrefixStore("g", dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)))
g = IpcGroup(store, 1, 2, 60, torch.device("cuda", 0))
try:
    g.broadcast([torch.empty(n, dtype=torch.uint8, device="cuda")]).wait()
    print("accepted", flush=True)
except IpcError as exc:
    print("refused:", exc, flush=True)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (CUDA IPC: two processes on one GPU)")
def test_a_cuda_handle_claiming_more_than_its_allocation_is_refused():
    from dist_sr.weightsync.ipc import _share_cuda

    store = _store()
    n = 3 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", _CUDA_LIAR_RECEIVER, str(store.port), str(n)], stdout=subprocess.PIPE, text=True
    )
    sender = IpcGroup(dist.PrefixStore("g", store), 0, 2, 60, torch.device("cuda", 0))
    staging = sender.staging(n)
    torch.cuda.synchronize()
    handle = _share_cuda(sender._staging)
    lying = dict(handle, size=handle["size"] * 64)  # far past the allocator's segment
    sender.store.set("0", json.dumps({"handle": lying, "at": 0, "nbytes": n}))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.startswith("refused:") and f"claims {lying['size']} bytes" in out, out
    assert staging.numel() == n
