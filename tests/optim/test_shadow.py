"""ShadowOptimizer: working == round(shadow), unbiased tracking, checkpoints, FP16, errors."""

import io
import math

import pytest
import torch
from torch import nn

from dist_sr import DynamicLossScaler, ShadowOptimizer, stochastic_round
from tests.conftest import bits16


def tiny_model(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)


def train(model, opt, steps, seed=123):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g).to(next(model.parameters()).dtype)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("mode", ["stochastic", "dither", "nearest"])
def test_working_weights_are_the_keyed_rounding_of_the_shadows(mode):
    model = tiny_model()
    opt = ShadowOptimizer(model.named_parameters(), torch.optim.AdamW, lr=1e-3, seed=5, mode=mode)
    for _ in range(4):
        train(model, opt, 1)
        for name, p, s in opt.named_shadows():
            expected = stochastic_round(s, seed=5, step=opt.step_count, param=name, mode=mode)
            assert torch.equal(bits16(p.data), bits16(expected)), name
    assert opt.step_count == 4


def test_nearest_mode_is_the_plain_cast():
    model = tiny_model()
    opt = ShadowOptimizer(model.named_parameters(), torch.optim.SGD, lr=1e-2, mode="nearest")
    train(model, opt, 3)
    for _, p, s in opt.named_shadows():
        assert torch.equal(bits16(p.data), bits16(s.to(torch.bfloat16)))


def test_fp32_model_values_become_the_shadows():
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    fp32 = model.weight.detach().clone()
    opt = ShadowOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1, working_dtype=torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16
    shadow = dict((n, s) for n, _, s in opt.named_shadows())["weight"]
    assert torch.equal(shadow, fp32)
    assert torch.equal(bits16(model.weight.data), bits16(stochastic_round(fp32, seed=0, step=0, param="weight")))


def tracking_run(mode, steps=10, n=1 << 16, delta=1e-4):
    """Shadows start on the BF16 grid at 1.0 and move by ``delta`` per step (SGD, constant grad)."""
    w = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = ShadowOptimizer([("w", w)], torch.optim.SGD, lr=delta, seed=1, mode=mode)
    for _ in range(steps):
        w.grad = torch.full_like(w, -1.0)
        opt.step()
    return w, opt.named_shadows()[0][2]


def test_bf16_weights_follow_the_shadow_in_expectation_with_sr():
    w, s = tracking_run("stochastic")
    # |SR error| <= one spacing u = 2^-7 in [1, 2), mean zero: the mean over n elements has
    # standard deviation <= (u/2)/sqrt(n); 6 sigma
    tol = 6 * (2**-7 / 2) / math.sqrt(w.numel())
    assert abs((w.float() - s).mean().item()) <= tol
    assert abs(w.float().mean().item() - (1 + 10 * 1e-4)) <= tol + 1e-6


def test_bf16_weights_stick_with_round_to_nearest():
    w, s = tracking_run("nearest")
    assert torch.all(w == 1.0) and torch.allclose(s, torch.full_like(s, 1.001))


def test_state_dict_round_trips_and_training_continues_identically():
    model_a = tiny_model()
    opt_a = ShadowOptimizer(model_a.named_parameters(), torch.optim.AdamW, lr=1e-3, seed=9)
    train(model_a, opt_a, 5)
    buf = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    # a fresh process would build the model from scratch: different initial weights on purpose
    model_b = tiny_model(seed=1)
    opt_b = ShadowOptimizer(model_b.named_parameters(), torch.optim.AdamW, lr=1e-3, seed=9)
    opt_b.load_state_dict(saved["opt"])  # re-derives the working weights from the shadows
    for (_, pa, sa), (_, pb, sb) in zip(opt_a.named_shadows(), opt_b.named_shadows()):
        assert torch.equal(bits16(pa.data), bits16(pb.data)) and torch.equal(sa, sb)
    assert opt_b.step_count == 5
    train(model_a, opt_a, 5, seed=7)
    train(model_b, opt_b, 5, seed=7)
    for (_, pa, sa), (_, pb, sb) in zip(opt_a.named_shadows(), opt_b.named_shadows()):
        assert torch.equal(bits16(pa.data), bits16(pb.data)) and torch.equal(sa, sb)


def test_loading_with_another_seed_or_mode_is_refused():
    model = tiny_model()
    state = ShadowOptimizer(model.named_parameters(), seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        ShadowOptimizer(tiny_model().named_parameters(), seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="mode='stochastic'"):
        ShadowOptimizer(tiny_model().named_parameters(), seed=1, mode="dither").load_state_dict(state)


def test_loading_shadows_of_another_model_is_refused():
    state = ShadowOptimizer(tiny_model().named_parameters()).state_dict()
    other = nn.Linear(3, 3).to(torch.bfloat16)
    with pytest.raises(ValueError, match="missing"):
        ShadowOptimizer(other.named_parameters()).load_state_dict(state)


def test_lr_scheduler_drives_the_inner_optimizer():
    model = tiny_model()
    opt = ShadowOptimizer(model.named_parameters(), torch.optim.SGD, lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(model, opt, 1)
    sched.step()
    assert opt.inner.param_groups[0]["lr"] == 0.5


def test_clip_grad_norm_clips_fp32_grads():
    model = tiny_model()
    opt = ShadowOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.0)
    model(torch.randn(8, 16).bfloat16()).float().sum().mul(1e3).backward()
    norm = opt.clip_grad_norm_(1.0)
    clipped = torch.linalg.vector_norm(torch.cat([s.grad.view(-1) for _, _, s in opt.named_shadows()]))
    assert norm > 1.0 and abs(clipped.item() - 1.0) < 1e-4


def test_closure_is_evaluated():
    model = tiny_model()
    opt = ShadowOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1)
    x = torch.randn(4, 16).bfloat16()

    def closure():
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        return loss

    assert opt.step(closure) is not None and opt.step_count == 1


def test_fp16_overflow_skips_the_step_and_shrinks_the_scale():
    model = tiny_model(dtype=torch.float16)
    scaler = DynamicLossScaler(init_scale=2.0**30, growth_interval=2)
    opt = ShadowOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1, mode="nearest", loss_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    opt.scale_loss(model(torch.randn(8, 16).half()).float().pow(2).sum() * 1e4).backward()
    opt.step()
    assert opt.step_count == 0 and scaler.scale == 2.0**29 and scaler.skipped_steps == 1
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    scaler.scale = 1.0
    opt.zero_grad()
    opt.scale_loss(model(torch.randn(8, 16).half()).float().pow(2).mean()).backward()
    opt.step()
    assert opt.step_count == 1


@pytest.mark.parametrize("clip", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_gradient_without_a_loss_scaler_skips_the_step_and_training_goes_on_as_if_it_never_came(bad, clip):
    """One poisoned batch: no update, no new key step, no moment touched, counted; the run then
    continues bit for bit like one that never saw it."""
    model_a, model_b = tiny_model(), tiny_model()
    opt_a = ShadowOptimizer(model_a.named_parameters(), torch.optim.AdamW, lr=1e-2, seed=4)
    opt_b = ShadowOptimizer(model_b.named_parameters(), torch.optim.AdamW, lr=1e-2, seed=4)
    train(model_a, opt_a, 3)
    train(model_b, opt_b, 3)
    state = {k: v.clone() for k, v in opt_a.state[opt_a.named_shadows()[0][2]].items()}
    model_a(torch.randn(8, 16).bfloat16()).float().pow(2).mean().backward()
    next(model_a.parameters()).grad.view(-1)[5] = bad
    if clip:
        assert not math.isfinite(opt_a.clip_grad_norm_(1.0))  # the norm it reports is reused, not recomputed
    opt_a.step()
    assert opt_a.step_count == 3 and opt_a.skipped_steps == 1
    for k, v in opt_a.state[opt_a.named_shadows()[0][2]].items():
        assert torch.equal(v, state[k]), k
    opt_a.zero_grad()
    train(model_a, opt_a, 4, seed=9)
    train(model_b, opt_b, 4, seed=9)
    for (_, pa, sa), (_, pb, sb) in zip(opt_a.named_shadows(), opt_b.named_shadows()):
        assert torch.equal(bits16(pa.data), bits16(pb.data)) and torch.equal(sa, sb)
    assert all(torch.isfinite(p).all() for p in model_a.parameters())
    # opting out trains on it (and the shadows become NaN): the default is what keeps a run alive
    raw = ShadowOptimizer(model_b.named_parameters(), torch.optim.AdamW, lr=1e-2, skip_nonfinite=False)
    model_b(torch.randn(8, 16).bfloat16()).float().pow(2).mean().backward()
    next(model_b.parameters()).grad.view(-1)[5] = float("nan")
    raw.step()
    assert raw.skipped_steps == 0 and not torch.isfinite(raw.named_shadows()[0][2]).all()


def test_sr_into_fp16_weights_is_refused():
    with pytest.raises(ValueError, match="BF16 working weights only"):
        ShadowOptimizer(tiny_model(dtype=torch.float16).named_parameters(), mode="stochastic")


def test_fp32_weights_without_working_dtype_are_refused():
    with pytest.raises(TypeError, match="working_dtype"):
        ShadowOptimizer(nn.Linear(2, 2).named_parameters())


def test_unnamed_parameters_are_refused():
    with pytest.raises(TypeError, match="with their names"):
        ShadowOptimizer(tiny_model().parameters())


def test_names_that_collide_after_normalisation_are_refused():
    a, b = (nn.Parameter(torch.zeros(2, dtype=torch.bfloat16)) for _ in range(2))
    with pytest.raises(ValueError, match="same key"):
        ShadowOptimizer([("module.w", a), ("w", b)])
