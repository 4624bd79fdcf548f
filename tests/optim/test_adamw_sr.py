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


def test_one_step_equals_torch_adamw_in_fp32_then_rounded():
    torch.manual_seed(0)
    p_bf16 = torch.randn(257, 33).to(torch.bfloat16)
    grads = [torch.randn(257, 33) for _ in range(3)]
    ref = nn.Parameter(p_bf16.float())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    ours = nn.Parameter(p_bf16.clone())
    opt = AdamWSR([("w", ours)], lr=1e-2, weight_decay=0.1, mode="nearest")
    for k, g in enumerate(grads, start=1):
        ref.data = ours.data.float()  # same BF16 starting point each step
        ref.grad, ours.grad = g.clone(), g.to(torch.bfloat16)
        ref.grad = ours.grad.float()
        ref_opt.step()
        opt.step()
        assert torch.equal(bits16(ours.data), bits16(ref.data.to(torch.bfloat16))), k
        assert torch.equal(opt.state[ours]["exp_avg"], ref_opt.state[ref]["exp_avg"])
        assert torch.equal(opt.state[ours]["exp_avg_sq"], ref_opt.state[ref]["exp_avg_sq"])


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
