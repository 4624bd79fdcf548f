"""Grid-step deltas (dist_sr.numerics.delta): exact for every bit pattern, the C++ kernel and the
Triton passes (in Triton's interpreter here; on the GPU where there is one) byte for byte the torch
reference, sizes as the format says, damaged deltas refused or caught alike on every path."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dist_sr.config import Refusal
from dist_sr.numerics import delta
from dist_sr.numerics.backends import cpu
from dist_sr.numerics.rounding import stochastic_round


def _kernel_or_skip():
    try:
        cpu.load_delta()
    except cpu.KernelUnavailable as exc:
        pytest.skip(f"C++ delta kernel unavailable: {exc}")


# The Triton passes run on CPU tensors in Triton's interpreter (tests/conftest.py sets it); on a
# CUDA device (bench/gpu_check.sh) the same cases run there.
TRITON = importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
PATHS = [{}, {"reference": True}] + ([{"triton": True}] if TRITON else [])


def test_the_triton_passes_are_checked_here():
    assert TRITON, "tests/conftest.py runs Triton's interpreter when triton is installed ([dev] extra)"


def _codes(values) -> torch.Tensor:
    v = torch.as_tensor(values, dtype=torch.int32) & 0xFFFF
    return (v - ((v >> 15) << 16)).to(torch.int16)


def _roundtrip(old: torch.Tensor, new: torch.Tensor) -> list[delta.Delta]:
    """Every path (kernel and reference, each layout, through the wire form) turns old into new."""
    out = []
    for layout in (None, "bitmap", "gaps", "dense"):
        ref = delta.encode(old, new, layout=layout, reference=True)
        for path in PATHS:
            assert delta.encode(old, new, layout=layout, **path).to_bytes() == ref.to_bytes(), (layout, path)
        wire = delta.Delta.from_bytes(ref.to_bytes())
        assert wire.nbytes == len(ref.to_bytes())
        for path in PATHS:
            held = old.clone()
            delta.apply_(held, wire, **path)
            assert torch.equal(held.view(torch.int16), new.view(torch.int16)), (layout, path)
        out.append(ref)
    return out


@pytest.mark.parametrize("n", [0, 1, 7, 8, 63, 64, 65, 127, 129, 4099])
@pytest.mark.parametrize("p", [0.0, 0.003, 0.26, 1.0])
def test_random_versions_roundtrip_bitwise_on_every_path(n, p):
    _kernel_or_skip()
    g = torch.Generator().manual_seed(n * 1000 + int(p * 1000))
    old = _codes(torch.randint(0, 1 << 16, (n,), generator=g))
    changed = torch.rand(n, generator=g) < p
    step = torch.where(torch.rand(n, generator=g) < 0.5, 1, -1)
    jump = torch.rand(n, generator=g) < 0.05
    new = old.to(torch.int32) + changed * step
    new = torch.where(changed & jump, torch.randint(0, 1 << 16, (n,), generator=g), new)
    _roundtrip(old.view(torch.bfloat16), _codes(new).view(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_cuda_passes_give_the_reference_bytes_and_versions():
    g = torch.Generator().manual_seed(11)
    for n, p in [(1 << 20, 0.26), (1 << 20, 0.008), (4099, 1.0), (5, 0.0), (0, 0.0)]:
        old = _codes(torch.randint(0, 1 << 16, (n,), generator=g))
        changed = torch.rand(n, generator=g) < p
        new = old.to(torch.int32) + changed * torch.where(torch.rand(n, generator=g) < 0.5, 1, -1)
        new = _codes(torch.where(changed & (torch.rand(n, generator=g) < 0.02), 7, new))
        for layout in (None, "bitmap", "gaps"):
            ref = delta.encode(old, new, layout=layout, reference=True)
            got = delta.encode(old.cuda(), new.cuda(), layout=layout)
            assert got.to_bytes() == ref.to_bytes(), (n, p, layout)
            held = old.cuda()
            delta.apply_(held, delta.Delta.from_bytes(ref.to_bytes()))
            assert torch.equal(held.cpu(), new), (n, p, layout)


def test_adversarial_codes_roundtrip_and_count_as_specified():
    """The wrap at 0xFFFF/0x0000, +-0, the subnormal/normal and finite/Inf boundaries, NaN payloads
    and sign changes: a +-1 code step costs a sign bit, everything else is an escape."""
    _kernel_or_skip()
    pairs = [
        (0x0000, 0x0001),
        (0x0001, 0x0000),
        (0x0000, 0x8000),
        (0x8000, 0x8001),
        (0x8001, 0x8000),
        (0x007F, 0x0080),
        (0x0080, 0x007F),
        (0x807F, 0x8080),
        (0x7F7F, 0x7F80),
        (0x7F80, 0x7F7F),
        (0x7F80, 0x7FC0),
        (0x7FC0, 0x7FC1),
        (0xFFC1, 0xFFC0),
        (0xFFFF, 0x0000),
        (0x0000, 0xFFFF),
        (0x3F80, 0xBF80),
        (0x3F80, 0x3F82),
        (0x7FFF, 0x8000),
        (0x1234, 0x1234),
    ]
    old = _codes([a for a, _ in pairs] * 9)
    new = _codes([b for _, b in pairs] * 9)
    d = _roundtrip(old.view(torch.bfloat16), new.view(torch.bfloat16))[0]
    unit = sum(1 for a, b in pairs if (b - a) % 65536 in (1, 65535))
    other = sum(1 for a, b in pairs if (b - a) % 65536 not in (0, 1, 65535))
    assert d.changed == 9 * (unit + other) and d.escapes == 9 * other
    # the same codes read as FP16 code identically
    _roundtrip(old.view(torch.float16), new.view(torch.float16))


def test_stochastic_rounding_steps_cost_a_bitmap_and_a_sign_bit_each():
    """Two keyed SR roundings of a shadow moved by Adam-sized steps: the delta is the bitmap plus
    one bit per change plus the escapes (sign changes at zero only), and the smaller layout wins."""
    _kernel_or_skip()
    g = torch.Generator().manual_seed(0)
    n = 1 << 16
    shadow = torch.randn(n, generator=g) * 0.02
    w0 = stochastic_round(shadow, seed=7, step=1, param="w")
    shadow1 = shadow + 1e-6 * torch.randn(n, generator=g)  # an Adam step at lr 1e-6
    w1 = stochastic_round(shadow1, seed=7, step=2, param="w")
    d = _roundtrip(w0, w1)[0]
    frac = d.changed / n
    assert 0.1 < frac < 0.6
    step = (w1.view(torch.int16).int() - w0.view(torch.int16).int()) & 0xFFFF
    assert d.layout == "bitmap" and d.escapes == int(((step != 0) & (step != 1) & (step != 0xFFFF)).sum())
    # small weights move several grid steps: each such jump costs a few bytes, not an index and a value
    assert 2 * d.escapes <= d.escape_bytes.numel() <= 4 * d.escapes
    assert d.nbytes == delta.HEADER_BYTES + n // 8 + (d.changed + 7) // 8 + d.escape_bytes.numel()
    assert 6 * d.nbytes < 2 * n
    # round-to-nearest of the same shadows changes far fewer and codes them as gaps
    r0, r1 = shadow.to(torch.bfloat16), shadow1.to(torch.bfloat16)
    rd = _roundtrip(r0, r1)[0]
    assert rd.changed < d.changed / 4 and rd.layout == "gaps" and rd.nbytes < n // 8


def test_damaged_deltas_are_refused_or_change_the_result():
    _kernel_or_skip()
    g = torch.Generator().manual_seed(3)
    n = 5000
    old = _codes(torch.randint(0, 1 << 16, (n,), generator=g))
    new = old.clone()
    sel = torch.rand(n, generator=g) < 0.3
    new[sel] = _codes(new[sel].to(torch.int32) + 1)
    for layout in ("bitmap", "gaps"):
        wire = bytearray(delta.encode(old, new, layout=layout).to_bytes())
        with pytest.raises(delta.DeltaError, match="bytes where its header implies"):
            delta.Delta.from_bytes(wire[:-1])
        with pytest.raises(delta.DeltaError, match="not a dist-sr delta"):
            delta.Delta.from_bytes(b"XXXX" + wire[4:])
        with pytest.raises(delta.DeltaError, match="does not apply"):
            delta.apply_(old[:-1].clone(), delta.Delta.from_bytes(wire))
        # a flipped bit anywhere in the fields: kernel and reference agree (both refuse, or both give
        # the same weights), never crash, and almost never give back new (the bit meant nothing)
        harmless = tried = 0
        for offset in range(delta.HEADER_BYTES, len(wire), max(1, len(wire) // 97)):
            for bit in (0, 4, 7):
                bad = bytearray(wire)
                bad[offset] ^= 1 << bit
                outcome = []
                for path in PATHS:
                    held = old.clone()
                    try:
                        delta.apply_(held, delta.Delta.from_bytes(bad), **path)
                        outcome.append(held)
                    except delta.DeltaError:
                        outcome.append(None)
                assert len({o is None for o in outcome}) == 1, (layout, offset, bit)
                if outcome[0] is not None:
                    assert all(torch.equal(outcome[0], o) for o in outcome[1:]), (layout, offset, bit)
                    harmless += torch.equal(outcome[0], new)
                tried += 1
        assert harmless == 0, (layout, harmless, tried)


def test_bad_input_names_the_problem():
    with pytest.raises(delta.DeltaError, match="16-bit weights"):
        delta.encode(torch.zeros(4), torch.zeros(4))
    with pytest.raises(delta.DeltaError, match="differ in size"):
        delta.encode(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(delta.DeltaError, match="unknown delta layout"):
        delta.encode(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16), layout="rle")


def test_versions_of_two_16_bit_dtypes_are_refused_naming_both():
    """A BF16 version and an FP16 one share a size but not a grid: their codes' difference steps
    nothing, so a delta between them is refused on every path, naming both dtypes and the fix."""
    old = torch.ones(8, dtype=torch.bfloat16)
    for reference in (False, True):
        for a, b in ((old, old.to(torch.float16)), (old.to(torch.float16), old)):
            with pytest.raises(delta.DeltaError, match=rf"differ in dtype: old {a.dtype}, new {b.dtype}.*dense"):
                delta.encode(a, b, reference=reference)
    assert issubclass(delta.DeltaError, Refusal)  # the command line prints it as one line


def test_a_delta_never_costs_more_than_the_dense_tensor():
    """Every weight moving many grid steps (a huge learning rate): the dense layout is chosen."""
    g = torch.Generator().manual_seed(9)
    old = torch.randn(10000, generator=g).to(torch.bfloat16)
    new = (old.float() * 1.5 + 0.1).to(torch.bfloat16)
    d = _roundtrip(old, new)[0]
    assert d.layout == "dense" and d.nbytes == delta.HEADER_BYTES + 2 * old.numel()
    damaged = bytearray(d.to_bytes())
    damaged[16] = 1  # the header's change count (bytes 16-23) no longer matches its fields
    with pytest.raises(delta.DeltaError, match="damaged delta"):
        delta.Delta.from_bytes(damaged)
    short = delta.Delta(d.numel - 1, "dense", 0, 0, d.positions[:-2], d.signs, d.escape_bytes)
    with pytest.raises(delta.DeltaError, match="does not apply"):
        delta.apply_(old.clone(), short)
