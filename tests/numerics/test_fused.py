"""Fused AdamW + SR: every backend gives the reference's bits; the optimizer built on it."""

import copy

import pytest
import torch
from torch import nn

from dist_sr import ShadowAdamW, ShadowOptimizer, stochastic_round
from dist_sr.numerics.fused import AdamWHyper, adamw_step_
from tests.conftest import bits16


def state(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(n, generator=g),
        torch.randn(n, generator=g) * 1e-3,
        torch.rand(n, generator=g) * 1e-6,
        torch.randn(n, generator=g),
    )


@pytest.mark.parametrize("n", [1, 31, 33, 1000, 100_003])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["stochastic", "dither", "nearest"])
@pytest.mark.parametrize("grad_scale", [1.0, 0.37])
def test_cpu_kernel_equals_reference_bitwise(n, grad_dtype, mode, grad_scale):
    s, m, v, g = state(n)
    g = g.to(grad_dtype)
    h = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3, grad_scale=grad_scale)
    results = []
    for backend in ("reference", "cpu"):
        S, M, V = s.clone(), m.clone(), v.clone()
        out = torch.empty(n, dtype=torch.bfloat16)
        adamw_step_(S, M, V, g, out, hyper=h, seed=5, step=3, param="layer.w", offset=13, mode=mode, backend=backend)
        results.append((S, M, V, bits16(out)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_output_is_the_keyed_rounding_of_the_updated_shadow():
    s, m, v, g = state(5000)
    out = torch.empty(5000, dtype=torch.bfloat16)
    adamw_step_(s, m, v, g, out, hyper=AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1), seed=2, step=9, param="p", offset=40)
    assert torch.equal(bits16(out), bits16(stochastic_round(s, seed=2, step=9, param="p", offset=40)))


def test_split_pieces_with_offsets_equal_the_whole():
    s, m, v, g = state(10_000)
    h = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.01, 2)
    whole = [t.clone() for t in (s, m, v)]
    out_whole = torch.empty(10_000, dtype=torch.bfloat16)
    adamw_step_(*whole, g, out_whole, hyper=h, seed=1, step=2, param="w")
    pieces = [t.clone() for t in (s, m, v)]
    out = torch.empty(10_000, dtype=torch.bfloat16)
    for a, b in [(0, 37), (37, 4096), (4096, 10_000)]:
        adamw_step_(*(t[a:b] for t in pieces), g[a:b], out[a:b], hyper=h, seed=1, step=2, param="w", offset=a)
    assert torch.equal(bits16(out), bits16(out_whole))
    for x, y in zip(whole, pieces):
        assert torch.equal(x, y)


def test_bad_tensors_are_refused():
    s, m, v, g = state(10)
    h = AdamWHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    with pytest.raises(TypeError, match="shadow"):
        adamw_step_(s.bfloat16(), m, v, g, torch.empty(10, dtype=torch.bfloat16), hyper=h, seed=0, step=1, param="w")
    with pytest.raises(TypeError, match="out"):
        adamw_step_(s, m, v, g, torch.empty(10), hyper=h, seed=0, step=1, param="w")


def twin_models():
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8)).to(torch.bfloat16)
    return copy.deepcopy(base), copy.deepcopy(base)


def test_shadow_adamw_tracks_shadow_optimizer_and_shares_its_checkpoints():
    a, b = twin_models()
    fused = ShadowAdamW(a.named_parameters(), lr=1e-3, weight_decay=0.01, seed=3)
    plain = ShadowOptimizer(b.named_parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.01, seed=3)
    x = torch.randn(16, 64).to(torch.bfloat16)
    for _ in range(5):
        for model, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
    for (_, pa, sa), (_, _pb, sb) in zip(fused.named_shadows(), plain.named_shadows()):
        # same algorithm, torch's AdamW may use fused-multiply-add: equal to float rounding
        assert torch.allclose(sa, sb, rtol=0, atol=1e-6)
        assert torch.equal(bits16(pa.data), bits16(stochastic_round(sa, seed=3, step=5, param=_name(fused, pa))))
    # a ShadowAdamW checkpoint loads into a ShadowOptimizer(AdamW) and re-derives the same weights
    c, _ = twin_models()
    restored = ShadowOptimizer(c.named_parameters(), torch.optim.AdamW, lr=1e-3, weight_decay=0.01, seed=3)
    state = fused.state_dict()
    restored.load_state_dict(state)
    for pa, pc in zip(a.parameters(), c.parameters()):
        assert torch.equal(bits16(pa.data), bits16(pc.data))
    # Adam's per-parameter steps: current, and each its own tensor as torch.optim.AdamW keeps them
    steps = [st["step"] for st in state["inner"]["state"].values()]
    assert [float(t) for t in steps] == [5.0] * len(steps)
    assert len({t.untyped_storage().data_ptr() for t in steps}) == len(steps)
    # a step where one parameter has no gradient advances the others' steps only
    fused.zero_grad()
    a(x).float().pow(2).mean().backward()
    first = next(a.parameters())
    first.grad = None
    fused.step()
    steps = [float(st["step"]) for st in fused.state_dict()["inner"]["state"].values()]
    assert steps == [5.0] + [6.0] * (len(steps) - 1)


def test_shadow_adamw_clipping_scales_the_update_like_clipping_the_shadow_gradients():
    """Clipping that binds (max_norm far below every step's norm) must scale the update as
    ShadowOptimizer(AdamW) does after clipping the FP32 gradients. With eps comparable to the
    gradients the update is not scale-free, so an unscaled update is far from the clipped one."""
    a, b = twin_models()
    c, _ = twin_models()
    kw = dict(lr=1e-2, eps=1e-3, weight_decay=0.0)
    fused = ShadowAdamW(a.named_parameters(), seed=3, **kw)
    plain = ShadowOptimizer(b.named_parameters(), torch.optim.AdamW, seed=3, **kw)
    unclipped = ShadowAdamW(c.named_parameters(), seed=3, **kw)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    max_norm = 1e-3
    for _ in range(3):
        norms = []
        for model, opt, clip in ((a, fused, max_norm), (b, plain, max_norm), (c, unclipped, None)):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            if clip is not None:
                norms.append(float(opt.clip_grad_norm_(clip)))
            opt.step()
        assert min(norms) > 10 * max_norm  # the clip binds on every step
        assert abs(norms[0] - norms[1]) <= 1e-5 * norms[1]
    for (_, pa, sa), (_, _, sb), (_, _, sc) in zip(
        fused.named_shadows(), plain.named_shadows(), unclipped.named_shadows()
    ):
        assert torch.allclose(sa, sb, rtol=0, atol=1e-6)
        assert (sa - sc).abs().max() > 1e-4  # the clipped and unclipped runs are told apart
        assert torch.equal(bits16(pa.data), bits16(stochastic_round(sa, seed=3, step=3, param=_name(fused, pa))))


def _name(opt, p):
    return next(n for n, q, _ in opt.named_shadows() if q is p)


def test_shadow_adamw_refuses_fp16_weights():
    with pytest.raises(TypeError, match="BF16 working weights"):
        ShadowAdamW(nn.Linear(2, 2).half().named_parameters(), mode="nearest")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shift", [0, 5])  # `out` 64-byte aligned, or not
def test_large_steps_written_by_streaming_stores_keep_the_bits(grad_dtype, shift):
    """>= 2^20 elements: the BF16 output takes non-temporal stores where lines are aligned."""
    n = (1 << 20) + 7
    s, m, v, g = state(n, seed=shift)
    g = g.to(grad_dtype)
    h = AdamWHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=2)
    results = []
    for backend in ("reference", "cpu"):
        S, M, V = s.clone(), m.clone(), v.clone()
        out = torch.empty(n + 32, dtype=torch.bfloat16)[shift : shift + n]
        adamw_step_(S, M, V, g, out, hyper=h, seed=5, step=2, param="big.w", offset=0, backend=backend)
        results.append((S, M, V, bits16(out)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
