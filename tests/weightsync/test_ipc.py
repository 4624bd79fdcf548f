"""The colocated transfer group (``weightsync.ipc``): handles instead of bytes. Host buffers travel
as shared memory (run here, in one process and across processes through the fleet tests in
``test_delta_sync.py``); CUDA buffers as CUDA IPC handles, which need two processes on one GPU
(the test at the end runs on a lent GPU and skips elsewhere)."""

import json
import subprocess
import sys
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_sr.net import free_port
from dist_sr.weightsync.ipc import IpcError, IpcGroup
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
    assert buf.data_ptr() == sender._staging.data_ptr() and buf.untyped_storage().is_shared()
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
