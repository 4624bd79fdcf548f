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
    assert meter.update() == {"changed_frac": 1.0, "unfollowed_frac": None}
