"""Triton kernels give the reference's bits: in Triton's interpreter on the CPU here, and on a
CUDA device where there is one (those cases skip cleanly without a GPU)."""

import os

import pytest
import torch

from dist_sr import ShadowAdamW, stochastic_round
from dist_sr.numerics import reference
from dist_sr.numerics.fused import AdamWHyper, adamw_reference_
from dist_sr.numerics.key import stream_key
from tests.conftest import bits16, f32_from_bits

triton = pytest.importorskip("triton")
from dist_sr.numerics import triton_kernels as tk  # noqa: E402

DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="CPU tensors need TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]


def ref_bits(x, key, offset):
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    reference.round_into(x.cpu().contiguous().view(-1), out, key, offset)
    return bits16(out)


@pytest.mark.parametrize("device", DEVICES)
def test_test_vectors(vectors, device):
    for case in vectors["cases"]:
        x = f32_from_bits([int(b, 16) for b in case["x_bits"]]).to(device)
        out = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
        key = int(case["stream_key"], 16) if case["stream_key"] else None
        tk.round_many([x], [out], [key], [case["offset"]])
        assert [f"{b:04x}" for b in bits16(out.cpu()).tolist()] == case["expected_bf16_bits"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keyed", [True, False])
def test_every_upper_half_with_edge_low_halves(device, keyed):
    upper = torch.arange(1 << 16, dtype=torch.int64) << 16
    bits = torch.cat([upper + low for low in (0x0000, 0x0001, 0x7FFF, 0x8000, 0xFFFF)])
    x = f32_from_bits(bits)
    key = stream_key(seed=3, step=4, param="w") if keyed else None
    out = torch.empty(x.numel(), dtype=torch.bfloat16, device=device)
    tk.round_many([x.to(device)], [out], [key], [12345])
    assert torch.equal(bits16(out.cpu()), ref_bits(x, key, 12345))


@pytest.mark.parametrize("device", DEVICES)
def test_many_tensors_in_one_launch(device):
    sizes = [1, 5, 1024, 1025, 3000, 0, 77]
    xs = [torch.randn(n).to(device) for n in sizes]
    outs = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in sizes]
    keys = [stream_key(seed=1, step=9, param=f"layer{i}.weight") for i in range(len(sizes))]
    keys[2] = None  # a nearest-rounded tensor in the same call
    offsets = [0, 3, 2**33 + 1, 17, 0, 0, 1000]
    tk.round_many(xs, outs, keys, offsets)
    for x, out, key, offset in zip(xs, outs, keys, offsets):
        assert torch.equal(bits16(out.cpu()), ref_bits(x, key, offset))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_fused_adamw_many_tensors(device, grad_dtype):
    items, expected = [], []
    for i, n in enumerate([3000, 1, 1024, 517]):
        g = torch.Generator().manual_seed(i)
        s, m, v = torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-6
        grad = torch.randn(n, generator=g).to(grad_dtype)
        h = AdamWHyper(1e-3 * (i + 1), 0.9, 0.999, 1e-8, 0.01, i + 1, 0.5 if i == 2 else 1.0)
        key = stream_key(seed=1, step=4, param=f"p{i}") if i != 1 else None
        ref = [s.clone(), m.clone(), v.clone(), torch.empty(n, dtype=torch.bfloat16)]
        adamw_reference_(ref[0], ref[1], ref[2], grad, ref[3], key, 7 * i, h)
        expected.append(ref)
        items.append((s.to(device), m.to(device), v.to(device), grad.to(device),
                      torch.empty(n, dtype=torch.bfloat16, device=device), key, 7 * i, h))
    tk.adamw_many_(items)
    for item, ref in zip(items, expected):
        for got, want in zip(item[:3], ref[:3]):
            assert torch.equal(got.cpu(), want)
        assert torch.equal(bits16(item[4].cpu()), bits16(ref[3]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_tensors_use_triton_and_match_the_cpu():
    x = torch.randn(1 << 22)
    gpu = stochastic_round(x.cuda(), seed=7, step=3, param="model.w", offset=11)
    cpu = stochastic_round(x, seed=7, step=3, param="model.w", offset=11)
    assert torch.equal(bits16(gpu.cpu()), bits16(cpu))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_shadow_adamw_on_cuda_matches_cpu():
    from torch import nn

    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16)).to(torch.bfloat16)
    gpu_model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 16)).to(torch.bfloat16).cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    opts = [ShadowAdamW(m.named_parameters(), lr=1e-3, seed=5) for m in (cpu_model, gpu_model)]
    x = torch.randn(32, 256).to(torch.bfloat16)
    for _ in range(3):
        for model, opt, inp in ((cpu_model, opts[0], x), (gpu_model, opts[1], x.cuda())):
            opt.zero_grad()
            model(inp).float().pow(2).mean().backward()
            # identical gradients on both devices, so only the optimizer's arithmetic is compared
        for pc, pg in zip(cpu_model.parameters(), gpu_model.parameters()):
            pg.grad.copy_(pc.grad)
        for opt in opts:
            opt.step()
    for pc, pg in zip(cpu_model.parameters(), gpu_model.parameters()):
        assert torch.equal(bits16(pc.data), bits16(pg.data.cpu()))


def test_cpu_tensors_without_interpreter_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="need CUDA tensors"):
        tk.round_many([torch.zeros(3)], [torch.zeros(3, dtype=torch.bfloat16)], [1], [0])
