"""StickingMeter shows weight sticking under round-to-nearest and its absence under SR."""

import math

import torch
from torch import nn

from dist_sr import AdamWSR, ShadowOptimizer, StickingMeter

N, STEPS, DELTA = 1 << 16, 10, 1e-4


def run(mode):
    w = nn.Parameter(torch.ones(N, dtype=torch.bfloat16))
    opt = ShadowOptimizer([("w", w)], torch.optim.SGD, lr=DELTA, seed=2, mode=mode)
    meter = StickingMeter.for_optimizer(opt)
    history = []
    for _ in range(STEPS):
        w.grad = torch.full_like(w, -1.0)
        opt.step()
        history.append(meter.update())
    return history


def test_round_to_nearest_sticks():
    history = run("nearest")
    assert all(h["changed_frac"] == 0.0 for h in history)
    assert all(h["unfollowed_frac"] == 1.0 for h in history)


def test_stochastic_rounding_follows_the_shadow():
    history = run("stochastic")
    # each element moves up with probability ~ k*DELTA/u per step: clearly non-zero
    assert all(h["changed_frac"] > 0.01 for h in history)
    # 1 - <dW,dS>/<dS,dS>: the SR noise e (|e| <= u = 2^-7, mean 0) enters as <e,dS>/|dS|^2, whose
    # standard deviation is <= (u/2)/|dS| with |dS| = STEPS*DELTA*sqrt(N); 6 sigma
    tol = 6 * (2**-7 / 2) / (STEPS * DELTA * math.sqrt(N))
    assert abs(history[-1]["unfollowed_frac"]) <= tol


def test_meter_without_shadows_reports_changes_only():
    w = nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    opt = AdamWSR([("w", w)], lr=0.5)
    meter = StickingMeter.for_optimizer(opt)
    w.grad = torch.ones_like(w)
    opt.step()
    assert meter.update() == {"changed_frac": 1.0, "unfollowed_frac": None, "dead_zone_frac": None}


def test_dead_zone_fraction_counts_updates_below_half_a_bf16_spacing():
    # weights at 1.0 (BF16 spacing 2^-7 above): SGD steps of 1e-3 (< 2^-8) and 6e-3 (between half and a
    # whole spacing), half each, plus elements whose gradient is zero (no update: not counted)
    n = 1000
    grad = torch.cat([torch.full((n,), -1e-3), torch.full((n,), -6e-3), torch.zeros(n)])
    for mode in ("nearest", "stochastic"):
        w = nn.Parameter(torch.ones(3 * n, dtype=torch.bfloat16))
        opt = ShadowOptimizer([("w", w)], torch.optim.SGD, lr=1.0, seed=0, mode=mode)
        meter = StickingMeter.for_optimizer(opt)
        w.grad = grad.to(torch.bfloat16).float().to(torch.bfloat16)
        opt.step()
        assert meter.update()["dead_zone_frac"] == 0.5
        # the next step measures from where the shadows are now, not from the start
        w.grad = torch.cat([torch.full((2 * n,), -1e-2), torch.zeros(n)]).to(torch.bfloat16)
        opt.step()
        assert meter.update()["dead_zone_frac"] == 0.0


def test_dead_zone_fraction_of_fp32_weights_is_measured_against_the_bf16_grid():
    w = nn.Parameter(torch.full((4,), 3.0))  # BF16 spacing at 3.0: 2^-6, half 2^-7 = 0.0078
    meter = StickingMeter([("w", w)])
    with torch.no_grad():
        w.add_(torch.tensor([0.001, 0.007, 0.008, 0.0]))
    assert meter.update()["dead_zone_frac"] == 2 / 3


def test_the_sampled_changed_share_is_layout_free_and_within_its_standard_error():
    from dist_sr.optim.metrics import ChangedShare
    from dist_sr.sources import LocalPiece

    g = torch.Generator().manual_seed(0)
    n, p_change = 200_003, 0.26
    before = torch.randn(n, generator=g).to(torch.bfloat16)
    flip = torch.rand(n, generator=g) < p_change
    after = torch.where(flip, (before.view(torch.int16) + 1).view(torch.bfloat16), before)

    def pieces(bits, world):  # the same tensor as `world` ranks hold it, uneven splits included
        edges = [round(i * n / world) + (i % 2) * 7 for i in range(world)] + [n]
        edges[0] = 0
        return [[LocalPiece("w", a, b, bits[a:b])] for a, b in zip(edges, edges[1:])]

    counts = {}
    for world in (1, 3, 4):
        meters = [ChangedShare() for _ in range(world)]
        for meter, part in zip(meters, pieces(before, world)):
            assert meter.observe(part)[0] == 0  # a first observation changes nothing
        counts[world] = [sum(x) for x in zip(*(m.observe(part) for m, part in zip(meters, pieces(after, world))))]
    assert counts[1] == counts[3] == counts[4]  # one sample, however the tensor is split
    changed, sampled = counts[1]
    assert sampled == len(range(0, n, 1009))
    share, exact = changed / sampled, float(flip.float().mean())
    assert abs(share - exact) < 4 * math.sqrt(exact * (1 - exact) / sampled)  # 4 standard errors
