"""stochastic_round: bits, neighbours, unbiasedness, split invariance, special values, errors."""

import math
import os
import subprocess
import sys

import pytest
import torch

from dist_sr import stochastic_round
from dist_sr.numerics import RoundingJob, round_jobs
from tests.conftest import bits16, f32_from_bits

LOW_PATTERNS = [0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234, 0xC0DE]


def sr(x, backend, **kw):
    kw = dict(seed=11, step=3, param="layer.weight") | kw
    return stochastic_round(x, backend=backend, **kw)


def all_upper_halves_with(lows):
    """FP32 bit patterns: every one of the 2^16 upper halves combined with each low half."""
    upper = torch.arange(1 << 16, dtype=torch.int64) << 16
    return torch.cat([upper + low for low in lows])


def test_backends_match_the_test_vectors(vectors, backend):
    for case in vectors["cases"]:
        x = f32_from_bits([int(b, 16) for b in case["x_bits"]])
        got = sr(
            x,
            backend,
            seed=case["seed"],
            step=case["step"],
            param=case["param"],
            mode=case["mode"],
            offset=case["offset"],
        )
        assert [f"{b:04x}" for b in bits16(got).tolist()] == case["expected_bf16_bits"], case["param"]


def test_results_are_one_of_the_two_bf16_neighbours(backend):
    bits = all_upper_halves_with([0x0001, 0x4000, 0x8000, 0xBFFF, 0xFFFF])
    x = f32_from_bits(bits)
    finite = (bits & 0x7F800000) != 0x7F800000  # every finite FP32, subnormals and near-max included
    y = bits16(sr(x, backend)).to(torch.int64)
    down = bits >> 16
    assert torch.all((y[finite] == down[finite]) | (y[finite] == down[finite] + 1))
    assert torch.any(y[finite] == down[finite]) and torch.any(y[finite] == down[finite] + 1)


def test_values_on_the_bf16_grid_never_move(backend):
    x = f32_from_bits(all_upper_halves_with([0]))
    x = x[~torch.isnan(x)]
    for step in range(3):
        assert torch.equal(bits16(sr(x, backend, step=step)), bits16(x.to(torch.bfloat16)))


@pytest.mark.parametrize("low", [1, 655, 6554, 32768, 58982, 65535])
def test_fraction_rounded_up_matches_fractional_distance(low, backend):
    n = 1 << 20
    base = 0x3F810000  # 1.0078125, positive normal
    x = f32_from_bits([base + low]).expand(n).contiguous()
    up = (bits16(sr(x, backend)) == (base >> 16) + 1).double().mean().item()
    p = low / 65536
    # binomial standard error; 6 sigma keeps a false failure below 1e-8 per case
    assert abs(up - p) <= 6 * math.sqrt(p * (1 - p) / n) + 1 / n


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_unbiased_in_expectation_on_random_values(sign, backend):
    """Inputs of one sign over many binades, so a bias toward zero (or away) cannot cancel
    between positive and negative elements. Each error e_i is bounded by one BF16 spacing u_i
    and has mean zero, so e_i / u_i has mean 0 and variance <= 1/4: the mean over n elements has
    standard deviation <= 1 / (2 sqrt(n)); allowed: 6 of those (a false alarm below 1e-8). A
    rounding biased by 1/100 of a spacing is 20 standard deviations away at n = 2^20."""
    g = torch.Generator().manual_seed(0)
    x = sign * torch.exp(torch.randn(1 << 20, generator=g) * 3) * 1e-2
    y = sr(x, backend).double()
    err = y - x.double()
    u = torch.ldexp(torch.ones_like(err), torch.frexp(x.double()).exponent - 8)  # BF16 spacing at |x| (normal)
    assert torch.all(err.abs() <= u)
    z = err / u
    assert abs(z.mean().item()) <= 6 / (2 * math.sqrt(x.numel()))


def test_negative_values_round_like_positive_ones(backend):
    x = torch.randn(100_000)
    assert torch.equal(bits16(sr(-x, backend)) ^ 0x8000, bits16(sr(x, backend)))


@pytest.mark.parametrize("pieces", [[10007], [1, 10006], [31, 32, 33, 9911], [4096, 4096, 1815], [5000, 0, 5007]])
def test_any_split_with_offsets_equals_the_whole(pieces, backend):
    torch.manual_seed(1)
    whole = torch.randn(10007)
    ref = sr(whole, "reference")
    parts, offset = [], 0
    for n in pieces:
        parts.append(sr(whole[offset : offset + n], backend, offset=offset))
        offset += n
    assert torch.equal(bits16(torch.cat(parts)), bits16(ref))


def test_split_of_a_2d_parameter_by_rows_equals_the_whole(backend):
    w = torch.randn(37, 129)
    whole = sr(w, backend)
    rows = [sr(w[a:b], backend, offset=a * 129) for a, b in [(0, 5), (5, 6), (6, 37)]]
    assert torch.equal(bits16(torch.cat(rows)), bits16(whole))


def test_backends_agree_at_large_offsets():
    x = torch.randn(70_001)
    for offset in [0, 2**31 - 17, 2**32 + 3, 2**40 + 1]:
        a = sr(x, "reference", offset=offset)
        b = sr(x, "cpu", offset=offset)
        assert torch.equal(bits16(a), bits16(b)), offset


def test_nearest_equals_torch_cast_for_every_non_nan_input(backend):
    x = f32_from_bits(all_upper_halves_with(LOW_PATTERNS))
    ours = bits16(sr(x, backend, mode="nearest"))
    nan = torch.isnan(x)
    assert torch.equal(ours[~nan], bits16(x[~nan].to(torch.bfloat16)))
    assert torch.all(ours[nan] == 0x7FC0)


@pytest.mark.parametrize("mode", ["stochastic", "dither", "nearest"])
def test_every_nan_payload_stays_nan(mode, backend):
    upper = torch.cat([torch.arange(0x7F80, 0x8000), torch.arange(0xFF80, 0x10000)]).to(torch.int64) << 16
    lows = torch.tensor(LOW_PATTERNS + [0x0002, 0x00FF, 0xFF00], dtype=torch.int64)
    bits = (upper[:, None] + lows[None, :]).flatten()
    bits = bits[(bits & 0x007FFFFF) != 0]  # NaN: exponent all ones, mantissa non-zero
    y = bits16(sr(f32_from_bits(bits), backend, mode=mode))
    assert torch.all(y == 0x7FC0)


@pytest.mark.parametrize("mode", ["stochastic", "dither", "nearest"])
def test_inf_and_signed_zero_are_exact(mode, backend):
    x = f32_from_bits([0x7F800000, 0xFF800000, 0x00000000, 0x80000000]).repeat(1000)
    assert bits16(sr(x, backend, mode=mode)).tolist() == [0x7F80, 0xFF80, 0x0000, 0x8000] * 1000


def test_subnormals_round_to_their_neighbours_without_bias(backend):
    n = 1 << 18
    for bits in [0x00000001, 0x00008000, 0x0001C000, 0x007FFFFF, 0x807F4000]:
        x = f32_from_bits([bits]).expand(n).contiguous()
        y = bits16(sr(x, backend))
        down, low = bits >> 16, bits & 0xFFFF
        assert set(y.unique().tolist()) <= {down, down + 1}
        p = low / 65536
        assert abs((y == down + 1).double().mean().item() - p) <= 6 * math.sqrt(p * (1 - p) / n) + 1 / n


def test_overflow_rule_near_bf16_max(backend):
    n = 1 << 18
    for bits, p_inf in [(0x7F7FFFFF, 0xFFFF / 65536), (0x7F7F8000, 0.5), (0xFF7F0001, 1 / 65536)]:
        x = f32_from_bits([bits]).expand(n).contiguous()
        y = bits16(sr(x, backend))
        inf = (bits >> 16) + 1  # 0x7F80 or 0xFF80
        assert set(y.unique().tolist()) <= {bits >> 16, inf}
        got = (y == inf).double().mean().item()
        assert abs(got - p_inf) <= 6 * math.sqrt(p_inf * (1 - p_inf) / n) + 1 / n
    # round to nearest: Inf from the halfway point on, as torch does
    near = f32_from_bits([0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF])
    assert bits16(sr(near, backend, mode="nearest")).tolist() == [0x7F7F, 0x7F80, 0x7F80]


def test_dither_is_frozen_across_steps_and_stochastic_is_fresh(backend):
    x = torch.randn(4096)
    d1, d2 = sr(x, backend, mode="dither", step=1), sr(x, backend, mode="dither", step=2)
    s1, s2 = sr(x, backend, step=1), sr(x, backend, step=2)
    assert torch.equal(bits16(d1), bits16(d2))
    assert not torch.equal(bits16(s1), bits16(s2))


def test_same_element_over_many_steps_rounds_up_at_its_fraction(backend):
    # one element, fresh bits each step: the time average is unbiased too
    steps, p = 20_000, 0x3000 / 65536
    x = f32_from_bits([0x3F813000])
    ups = sum(int(bits16(sr(x, backend, step=s)).item() == 0x3F82) for s in range(steps))
    assert abs(ups / steps - p) <= 6 * math.sqrt(p * (1 - p) / steps)


def test_wrapper_prefixes_do_not_change_the_bits(backend):
    x = torch.randn(1000)
    a = sr(x, backend, param="model.layers.0.mlp.weight")
    b = sr(x, backend, param="module._orig_mod.model.layers.0.mlp.weight")
    assert torch.equal(bits16(a), bits16(b))


def test_out_is_filled_and_returned_also_when_not_contiguous(backend):
    x = torch.randn(64, 48)
    expected = sr(x, backend)
    buf = torch.empty(48, 64, dtype=torch.bfloat16)
    out = buf.t()
    assert not out.is_contiguous()
    ret = sr(x, backend, out=out)
    assert ret is out and torch.equal(bits16(out.contiguous()), bits16(expected))


def test_non_contiguous_input_uses_logical_element_order(backend):
    x = torch.randn(48, 64).t()
    assert torch.equal(bits16(sr(x, backend)), bits16(sr(x.contiguous(), backend)))


def test_round_jobs_equals_one_call_per_piece(backend):
    xs = [torch.randn(n) for n in (1, 31, 1000, 7)]
    outs = [torch.empty(n, dtype=torch.bfloat16) for n in (1, 31, 1000, 7)]
    round_jobs(
        [RoundingJob(f"p{i}", x, o, offset=i * 5) for i, (x, o) in enumerate(zip(xs, outs))],
        seed=4,
        step=9,
        backend=backend,
    )
    for i, (x, o) in enumerate(zip(xs, outs)):
        assert torch.equal(bits16(o), bits16(stochastic_round(x, seed=4, step=9, param=f"p{i}", offset=i * 5)))


def test_empty_tensor_is_fine(backend):
    assert sr(torch.empty(0), backend).numel() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_non_fp32_input_is_rejected(dtype, backend):
    with pytest.raises(TypeError, match="float32 input"):
        sr(torch.zeros(4, dtype=dtype), backend)


@pytest.mark.parametrize(
    "kwargs,err,match",
    [
        (dict(offset=-1), ValueError, "non-negative"),
        (dict(mode="round-up"), ValueError, "nearest, stochastic, dither"),
        (dict(out=torch.empty(4, dtype=torch.float16)), TypeError, "must be bfloat16"),
        (dict(out=torch.empty(5, dtype=torch.bfloat16)), ValueError, "shape"),
        (dict(seed=-5), ValueError, "seed"),
    ],
)
def test_bad_inputs_raise_clear_errors(kwargs, err, match, backend):
    with pytest.raises(err, match=match):
        sr(torch.zeros(4), backend, **kwargs)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="auto, reference, cpu, triton"):
        sr(torch.zeros(4), "cuda-magic")


def test_missing_kernel_falls_back_to_reference_with_one_warning():
    code = """
import warnings, torch
from dist_sr import stochastic_round
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    x = torch.linspace(-3, 3, 1000)
    a = stochastic_round(x, seed=1, step=1, param="w")
    b = stochastic_round(x, seed=1, step=2, param="w")
print(sum("fast CPU rounding kernel unavailable" in str(m.message) for m in w))
print(a.view(torch.int16).tolist())
"""
    env = dict(os.environ, DIST_SR_DISABLE_CPU_KERNEL="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    n_warnings, bits = out.stdout.strip().splitlines()
    assert n_warnings == "1"
    fast = stochastic_round(torch.linspace(-3, 3, 1000), seed=1, step=1, param="w", backend="cpu")
    assert bits == str(fast.view(torch.int16).tolist())


@pytest.mark.parametrize("backend_name", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("cols", [(0, 48), (48, 96), (17, 18), (0, 129)])
def test_column_shard_with_row_stride_equals_the_whole(backend_name, cols):
    if backend_name == "triton":
        pytest.importorskip("triton")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("triton on CPU tensors needs TRITON_INTERPRET=1")
    torch.manual_seed(3)
    w = torch.randn(37, 129)
    whole = bits16(sr(w, "reference"))
    a, b = cols
    shard = w[:, a:b].contiguous()  # what a Shard(1) placement holds locally
    got = stochastic_round(shard, seed=11, step=3, param="layer.weight", offset=a, row_stride=129, backend=backend_name)
    assert torch.equal(bits16(got), whole[:, a:b])


def test_bad_row_stride_is_refused():
    with pytest.raises(ValueError, match="row_stride"):
        stochastic_round(torch.zeros(4, 8), seed=1, step=1, param="w", row_stride=4)


def test_a_build_killed_mid_way_never_blocks_the_next_one(tmp_path):
    """A builder SIGKILLed while it holds the build (cpp_extension's ``lock`` file left behind):
    the next builder waits while it lives, and goes ahead, removing the dead one's lock file, the
    moment it dies (before, every later process waited 15 minutes or forever)."""
    import threading

    from dist_sr.numerics.backends.cpu import _BuildLock

    build = tmp_path / "build"
    build.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import sys, time; from dist_sr.numerics.backends.cpu import _BuildLock; "
                f"l = _BuildLock({str(build)!r}).__enter__(); open({str(build / 'lock')!r}, 'w').close(); "
                "print('held', flush=True); time.sleep(120)"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def next_builder():
            with pytest.warns(RuntimeWarning, match="left by a build that was killed"):
                with _BuildLock(str(build)):
                    entered.set()

        t = threading.Thread(target=next_builder)
        t.start()
        assert not entered.wait(1.0)  # a live builder holds it
        assert (build / "lock").exists()
        holder.kill()
        holder.wait()
        assert entered.wait(10.0)
        t.join()
        assert not (build / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    "shift", [0, 1, 16, 32]
)  # element offset of `out` inside its buffer: 64-, 2-, 32-, 64-byte aligned
@pytest.mark.parametrize("offset", [0, 3])
def test_large_outputs_written_by_streaming_stores_keep_the_bits(shift, offset):
    """Outputs of >= 2^20 elements take the kernel's non-temporal store path (aligned lines) and
    plain stores elsewhere: the bits are the reference's either way."""
    n = (1 << 20) + 45
    x = torch.randn(n, generator=torch.Generator().manual_seed(shift + offset)) * 3
    buf = torch.empty(n + 64, dtype=torch.bfloat16)
    out = buf[shift : shift + n]
    stochastic_round(x, seed=2, step=5, param="big.w", offset=offset, out=out, backend="cpu")
    expected = stochastic_round(x, seed=2, step=5, param="big.w", offset=offset, backend="reference")
    assert torch.equal(bits16(out), bits16(expected))


def test_an_out_that_overlaps_its_input_gets_the_bits_of_a_separate_out(backend):
    """``out`` as a BF16 view over the input's own bytes (in-place reuse of the FP32 storage):
    rounded first, then written, so no element reads a half-overwritten input."""
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3))
    want = sr(x.clone(), backend)
    alias = x.view(torch.bfloat16)[: x.numel()]
    got = sr(x, backend, out=alias)
    assert got.data_ptr() == x.data_ptr() and torch.equal(bits16(got), bits16(want))
    y = torch.randn(64)
    with pytest.raises(ValueError, match="overlaps its input x in memory"):
        round_jobs([RoundingJob("w", y, y.view(torch.bfloat16)[:64])], seed=1, step=1, backend=backend)
