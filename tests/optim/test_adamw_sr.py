"""Pure-BF16 AdamW-SR: tiny updates survive, matches AdamW's arithmetic, replicas agree."""

import io
import math

import pytest
import torch
from torch import nn

from dist_sr import AdamWSR, stochastic_round
from tests.conftest import bits16

N = 4096


def test_repeated_tiny_updates_stick_with_nearest_and_accumulate_with_sr():
    # 1.0 + 0.001, a thousand times, into BF16 weights with no FP32 master
    results = {}
    for mode in ("nearest", "stochastic"):
        w = torch.ones(N, dtype=torch.bfloat16)
        for k in range(1, 1001):
            w = stochastic_round(w.float() + 0.001, seed=3, step=k, param="w", mode=mode)
        results[mode] = w.float()
    assert torch.all(results["nearest"] == 1.0)
    # the SR walk is a martingale around 1 + k*0.001; each step adds variance <= (u/2)^2 with
    # u <= 2^-6 in [1, 4): the per-element std is <= sqrt(1000)*2^-7, its mean over N elements
    # <= that / sqrt(N); 6 sigma
    tol = 6 * math.sqrt(1000) * 2**-7 / math.sqrt(N)
    assert abs(results["stochastic"].mean().item() - 2.0) <= tol


@pytest.mark.parametrize("mode,expected", [("nearest", 1.0), ("stochastic", 2.0)])
def test_adamw_sr_accumulates_updates_far_below_bf16_spacing(mode, expected):
    w = nn.Parameter(torch.ones(N, dtype=torch.bfloat16))
    opt = AdamWSR([("w", w)], lr=1e-3, weight_decay=0.0, mode=mode, eps=1e-30)
    for _ in range(1000):
        w.grad = torch.full_like(w, -1.0)  # constant gradient: each Adam step is +lr exactly
        opt.step()
    tol = 6 * math.sqrt(1000) * 2**-7 / math.sqrt(N)
    assert abs(w.float().mean().item() - expected) <= tol + 1e-3


def test_one_step_is_adamw_arithmetic_then_rounded():
    # AdamWSR computes torch.optim.AdamW's update in FP32 (as one fixed sequence of IEEE
    # operations, without FMA, shared by every backend), then rounds; with RTN the weights equal
    # torch's FP32 result rounded, except where the two FP32 results straddle a rounding tie
    torch.manual_seed(0)
    p_bf16 = torch.randn(257, 33).to(torch.bfloat16)
    grads = [torch.randn(257, 33) for _ in range(3)]
    ref = nn.Parameter(p_bf16.float())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    ours = nn.Parameter(p_bf16.clone())
    opt = AdamWSR([("w", ours)], lr=1e-2, weight_decay=0.1, mode="nearest")
    for k, g in enumerate(grads, start=1):
        ref.data = ours.data.float()  # same BF16 starting point each step
        ours.grad = g.to(torch.bfloat16)
        ref.grad = ours.grad.float()
        prev = {key: opt.state[ours][key].clone() for key in ("exp_avg", "exp_avg_sq")} if k > 1 else None
        ref_opt.step()
        opt.step()
        same = bits16(ours.data) == bits16(ref.data.to(torch.bfloat16))
        assert same.float().mean() > 0.999, k
        assert (ours.data.float() - ref.data).abs().le(ref.data.abs() * 2**-8 + 1e-30).all()
        g32 = ours.grad.float()
        scales = {"exp_avg": g32.abs(), "exp_avg_sq": g32 * g32}
        for key in ("exp_avg", "exp_avg_sq"):  # a few FP32 ulps of the operands apart at most
            a, b = opt.state[ours][key], ref_opt.state[ref][key]
            scale = scales[key] + (prev[key].abs() if prev else 0)
            assert (a - b).abs().le(scale * 2**-21).all(), (k, key)


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_a_step_equals_the_fused_reference_and_moments_use_their_own_keys(moment_dtype):
    from dist_sr.numerics.adamw import AdamWHyper
    from dist_sr.numerics.key import stream_key
    from dist_sr.numerics.reference import adamw_step as adamw_reference_

    g = torch.Generator().manual_seed(4)
    w = nn.Parameter(torch.randn(3000, generator=g).to(torch.bfloat16))
    opt = AdamWSR([("model.w", w)], lr=1e-2, weight_decay=0.1, seed=11, moment_dtype=moment_dtype)
    w.grad = torch.randn(3000, generator=g).to(torch.bfloat16)
    opt.step()  # creates the moments
    # the second step from a known state, checked against the plain-torch reference
    w.grad = torch.randn(3000, generator=g).to(torch.bfloat16)
    p, m, v = w.data.clone(), opt.state[w]["exp_avg"].clone(), opt.state[w]["exp_avg_sq"].clone()
    opt.step()
    keys = [stream_key(seed=11, step=2, param=n) for n in ("model.w", "model.w#exp_avg", "model.w#exp_avg_sq")]
    adamw_reference_(p, m, v, w.grad, None, keys[0], 0, AdamWHyper(1e-2, 0.9, 0.999, 1e-8, 0.1, 2), (keys[1], keys[2]))
    assert torch.equal(bits16(w.data), bits16(p))
    for key, want in (("exp_avg", m), ("exp_avg_sq", v)):
        got = opt.state[w][key]
        assert got.dtype == want.dtype
        assert torch.equal(
            got.view(torch.int16) if got.dtype == torch.bfloat16 else got,
            want.view(torch.int16) if want.dtype == torch.bfloat16 else want,
        ), key


def two_replicas(seed_a, seed_b, moment_dtype="fp32", steps=20):
    torch.manual_seed(0)
    base = nn.Linear(32, 32).to(torch.bfloat16)
    reps = []
    for seed in (seed_a, seed_b):
        m = nn.Linear(32, 32).to(torch.bfloat16)
        m.load_state_dict(base.state_dict())
        reps.append((m, AdamWSR(m.named_parameters(), lr=1e-3, seed=seed, moment_dtype=moment_dtype)))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 32, generator=g).bfloat16()
        for m, opt in reps:
            opt.zero_grad()
            m(x).float().pow(2).mean().backward()
            opt.step()
    return reps


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_replicas_with_the_same_seed_stay_identical(moment_dtype):
    (a, oa), (b, ob) = two_replicas(7, 7, moment_dtype)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(bits16(pa.data), bits16(pb.data))
        for key in ("exp_avg", "exp_avg_sq"):
            assert oa.state[pa][key].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16}[moment_dtype]
            assert torch.equal(oa.state[pa][key], ob.state[pb][key])


def test_replicas_with_different_seeds_drift_apart():
    (a, _), (b, _) = two_replicas(7, 8)
    assert not torch.equal(bits16(a.weight.data), bits16(b.weight.data))


@pytest.mark.parametrize("moment_dtype", ["fp32", "bf16"])
def test_state_dict_round_trips_bitwise(moment_dtype):
    ((m, opt),) = two_replicas(3, 3, moment_dtype)[:1]
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    m2 = nn.Linear(32, 32).to(torch.bfloat16)
    m2.load_state_dict(m.state_dict())
    opt2 = AdamWSR(m2.named_parameters(), lr=1e-3, seed=3, moment_dtype=moment_dtype)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    assert opt2.step_count == opt.step_count
    for p, p2 in zip(m.parameters(), m2.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], opt2.state[p2][key])
            assert opt2.state[p2][key].dtype == opt.state[p][key].dtype


def test_non_bf16_params_are_refused():
    with pytest.raises(TypeError, match="BF16 parameters"):
        AdamWSR(nn.Linear(2, 2).named_parameters())


def test_bad_moment_dtype_is_refused():
    with pytest.raises(ValueError, match="moment_dtype"):
        AdamWSR(nn.Linear(2, 2).to(torch.bfloat16).named_parameters(), moment_dtype="fp16")


@pytest.mark.parametrize(
    "names,match",
    [
        (["w", "w"], "normalise to the same key 'w'"),
        (["module.w", "w"], "normalise to the same key 'w'"),
        (["", "b"], "non-empty string"),
    ],
)
def test_names_that_would_share_random_bits_are_refused(names, match):
    params = [nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)) for _ in names]
    with pytest.raises(ValueError, match=match):
        AdamWSR(list(zip(names, params)))
