"""The transfer groups by device: one code path for gloo (host buffers) and NCCL (CUDA buffers),
chosen by where the trainer's weights live, signed with the rest of the init info, and refused by
name where the engine has no CUDA device. The gloo path is what every fleet test runs; NCCL needs
two GPUs (it refuses two ranks on one device), so no machine lent so far ran it."""

import dataclasses

import pytest
import torch

from dist_sr.config import ConfigError
from dist_sr.rollout.vllm.config import FleetConfig
from dist_sr.sources import ReplicatedSource
from dist_sr.weightsync import auth
from dist_sr.weightsync.engine.receiver import InitInfo, WeightReceiver
from dist_sr.weightsync.trainer.groups import choose_backend
from dist_sr.weightsync.trainer.sync import WeightSync
from dist_sr.weightsync.transport import Channel, Packer, transfer_group

SECRET = b"k" * 32


def _signed(**fields) -> InitInfo:
    info = InitInfo(master_address="127.0.0.1", master_port=29999, rank_offset=1, world_size=2, **fields)
    return dataclasses.replace(info, auth=auth.sign_payload(SECRET, "init_info", info.fields()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_an_engine_without_cuda_refuses_nccl_by_name_and_keeps_its_groups():
    r = WeightReceiver(secret=SECRET)
    before = (r.groups, r.state, r.events)
    with pytest.raises(ValueError, match="'nccl' needs a CUDA device, and this engine has none.*backend: gloo"):
        r.init(_signed(backend="nccl"))
    assert (r.groups, r.state, r.events) == before  # refused before joining anything
    with pytest.raises(ValueError, match="'nccl' needs a CUDA device"):
        transfer_group(None, 0, 0, 0, 2, 5.0, prefix="p", backend="nccl")


def test_the_backend_is_signed_and_checked_with_the_other_fields():
    r = WeightReceiver(secret=SECRET)
    info = _signed(backend="gloo")
    with pytest.raises(auth.AuthError, match="bad signature on init_info"):
        r.init(dataclasses.replace(info, backend="nccl"))  # a relay cannot switch the backend
    with pytest.raises(ValueError, match="init_info.backend='mpi'"):
        r.init(_signed(backend="mpi"))
    with pytest.raises(ValueError, match="unknown weight-transfer backend 'mpi'"):
        transfer_group(None, 0, 0, 0, 2, 5.0, prefix="p", backend="mpi")
    with pytest.raises(ConfigError, match="rollout.vllm.backend"):
        FleetConfig(backend="ucc")


def test_auto_picks_gloo_for_weights_in_host_memory():
    ws = WeightSync(ReplicatedSource(torch.nn.Linear(4, 4)), [], secret=SECRET)
    assert ws.backend == "auto" and choose_backend(ws.backend, ws.source) == "gloo"
    assert choose_backend("nccl", ws.source) == "nccl"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_auto_picks_nccl_for_weights_on_a_gpu_and_buckets_are_staged_there():
    ws = WeightSync(ReplicatedSource(torch.nn.Linear(4, 4).cuda()), [], secret=SECRET)
    assert choose_backend(ws.backend, ws.source) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device())
    buf = Packer().pack([torch.ones(3, device=device), torch.zeros(2, device=device)], 20, Channel(None, device))
    assert buf.device == device and buf.numel() == 20


def test_a_bucket_is_staged_on_the_channels_device():
    cpu = torch.device("cpu")
    chunks = [torch.ones(3), torch.zeros(2, dtype=torch.bfloat16)]
    buf = Packer().pack(chunks, 16, Channel(None, cpu))
    assert buf.device == cpu and buf.numel() == 16
    assert torch.equal(buf[:12].view(torch.float32), chunks[0]) and torch.equal(
        buf[12:].view(torch.bfloat16), chunks[1]
    )
    with pytest.raises(RuntimeError, match="the plan says 15"):
        Packer().pack(chunks, 15, Channel(None, cpu))


def test_the_next_bucket_is_packed_beside_the_one_on_the_wire_not_over_it():
    """The sender packs bucket i+1 while bucket i is still being broadcast: the two use different
    staging buffers, so packing the next leaves the one on the wire as it was; the one after
    reuses the first (the sender has waited for its broadcast by then)."""
    cpu, packer = torch.device("cpu"), Packer()
    first = packer.pack([torch.full((4,), 1.0), torch.full((4,), 2.0)], 32, Channel(None, cpu), slot=0)
    wire = first.clone()
    second = packer.pack([torch.full((4,), 3.0), torch.full((4,), 4.0)], 32, Channel(None, cpu), slot=1)
    assert torch.equal(first, wire) and first.data_ptr() != second.data_ptr()
    third = packer.pack([torch.full((8,), 5.0)] * 2, 64, Channel(None, cpu), slot=0)  # grows its slot
    assert torch.equal(third.view(torch.float32), torch.full((16,), 5.0))
    assert torch.equal(second.view(torch.float32), torch.tensor([3.0] * 4 + [4.0] * 4))
