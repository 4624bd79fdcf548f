"""The precision switch: parsing, validation errors, and training under every precision."""

import pytest
import torch
from torch import nn

from dist_sr import PRECISIONS, AdamWSR, PrecisionConfig, PrecisionConfigError, ShadowOptimizer, apply_precision


def regression_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


EXPECTED = {
    "fp32": (torch.float32, torch.optim.AdamW),
    "fp16": (torch.float16, ShadowOptimizer),
    "bf16": (torch.bfloat16, ShadowOptimizer),
    "bf16-sr": (torch.bfloat16, ShadowOptimizer),
    "bf16-dither": (torch.bfloat16, ShadowOptimizer),
    "bf16-pure-sr": (torch.bfloat16, AdamWSR),
}


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_trains(precision):
    model = regression_model()
    tp = apply_precision(model, {"precision": precision, "seed": 1}, torch.optim.AdamW, lr=3e-3)
    dtype, opt_type = EXPECTED[precision]
    assert all(p.dtype == dtype for p in model.parameters()) and isinstance(tp.optimizer, opt_type)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x[:, :1] * 0.5 + x[:, 1:2].sin()
    losses = []
    for _ in range(150):
        loss = (model(x.to(dtype)).float() - y).pow(2).mean()
        tp.zero_grad()
        tp.backward(loss)
        tp.clip_grad_norm_(1.0)
        tp.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10


def test_rounding_modes_follow_the_precision():
    assert PrecisionConfig("bf16").rounding == "nearest"
    assert PrecisionConfig("bf16-sr").rounding == "stochastic"
    assert PrecisionConfig("bf16-dither").rounding == "dither"
    assert PrecisionConfig("fp32").rounding is None


def test_config_from_string_mapping_and_yaml(tmp_path):
    assert PrecisionConfig.from_dict("bf16-dither").precision == "bf16-dither"
    assert PrecisionConfig.from_dict({"mode": "fp16", "loss_scale": 128.0}).loss_scale == 128.0
    path = tmp_path / "exp.yaml"
    path.write_text("precision:\n  precision: bf16-pure-sr\n  seed: 77\n  moment_dtype: bf16\n")
    cfg = PrecisionConfig.from_yaml(path)
    assert (cfg.precision, cfg.seed, cfg.moment_dtype) == ("bf16-pure-sr", 77, "bf16")
    assert PrecisionConfig.from_yaml("precision: bf16-sr\n").precision == "bf16-sr"


@pytest.mark.parametrize(
    "data,match",
    [
        ("bf16-stochastic", "unknown precision 'bf16-stochastic'; choose one of fp32, fp16, bf16, bf16-sr"),
        ({"precision": "bf16-sr", "sead": 1}, r"unknown precision field\(s\) \['sead'\]; valid fields"),
        ({"precision": "bf16-sr", "loss_scale": "dynamic"}, "loss_scale applies only to precision fp16"),
        ({"precision": "bf16", "moment_dtype": "bf16"}, "moment_dtype applies only to precision bf16-pure-sr"),
        ({"precision": "fp16", "mode": "fp16"}, "either"),
        ({"precision": "fp16", "loss_scale": -1}, "loss_scale must be"),
        ({"precision": "bf16-sr", "seed": -1}, "seed must be"),
        ({"precision": "bf16-pure-sr", "moment_dtype": "fp8"}, "moment_dtype must be"),
        (3, "string or a mapping"),
    ],
)
def test_bad_configs_fail_at_load_time_with_the_fix(data, match):
    with pytest.raises(PrecisionConfigError, match=match):
        PrecisionConfig.from_dict(data)


def test_yaml_without_precision_entry_is_refused():
    with pytest.raises(PrecisionConfigError, match="top-level 'precision:'"):
        PrecisionConfig.from_yaml("model: tiny\n")


def test_pure_sr_with_another_optimizer_is_refused():
    with pytest.raises(PrecisionConfigError, match="bf16-pure-sr implements AdamW"):
        apply_precision(regression_model(), "bf16-pure-sr", torch.optim.SGD, lr=0.1)


def test_fp16_model_under_bf16_precision_is_refused():
    model = regression_model().half()
    with pytest.raises(PrecisionConfigError, match="needs FP32 or torch.bfloat16"):
        apply_precision(model, "bf16-sr", lr=1e-3)


def test_precision_state_round_trips():
    model = regression_model()
    tp = apply_precision(model, "bf16-sr", lr=1e-3)
    tp.backward(model(torch.randn(4, 8).bfloat16()).float().sum())
    tp.step()
    state = tp.state_dict()
    model2 = regression_model()
    tp2 = apply_precision(model2, "bf16-sr", lr=1e-3)
    tp2.load_state_dict(state)
    assert tp2.digest() == tp.digest()
    with pytest.raises(ValueError, match="checkpoint precision"):
        apply_precision(regression_model(), "bf16", lr=1e-3).load_state_dict(state)


@pytest.mark.parametrize("precision,mode", [("bf16", "nearest"), ("bf16-sr", "stochastic"), ("bf16-dither", "dither")])
def test_the_switch_builds_the_named_rounding_and_keeps_working_equal_to_the_keyed_shadow(precision, mode):
    """The working weights after each step are the rounding the precision names, keyed by the
    configured seed, the step and the parameter name, computed here from the plain definition."""
    from dist_sr import stochastic_round
    from tests.conftest import bits16

    model = regression_model()
    tp = apply_precision(model, {"precision": precision, "seed": 1234}, torch.optim.AdamW, lr=3e-3)
    assert (tp.optimizer.mode, tp.optimizer.seed) == (mode, 1234)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    for step in (1, 2, 3):
        tp.zero_grad()
        tp.backward(model(x.bfloat16()).float().pow(2).mean())
        tp.step()
        for name, p, s in tp.optimizer.named_shadows():
            want = stochastic_round(s, seed=1234, step=step, param=name, backend="reference", mode=mode)
            assert torch.equal(bits16(p.data), bits16(want)), (precision, step, name)
    assert tp.digest() == tp.expected_digest()


def test_the_pure_switch_builds_adamw_sr_with_the_configured_seed_and_moments():
    tp = apply_precision(
        regression_model(),
        {"precision": "bf16-pure-sr", "seed": 99, "moment_dtype": "bf16"},
        torch.optim.AdamW,
        lr=1e-3,
    )
    assert isinstance(tp.optimizer, AdamWSR) and tp.optimizer.seed == 99
    assert tp.optimizer.moment_dtype == torch.bfloat16


def test_expected_digest_sees_a_working_weight_that_left_its_shadow():
    """digest() reads the working weights; expected_digest() re-derives them from the shadows: a
    flipped bit in a working weight (a lost write, a stray in-place op) makes them differ."""
    model = regression_model()
    tp = apply_precision(model, {"precision": "bf16-sr", "seed": 3}, torch.optim.AdamW, lr=3e-3)
    tp.backward(model(torch.randn(4, 8).bfloat16()).float().sum())
    tp.step()
    assert tp.digest() == tp.expected_digest()
    w = next(model.parameters())
    w.data.view(torch.int16)[0, 0] ^= 1
    assert tp.digest() != tp.expected_digest()
