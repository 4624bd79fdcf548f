"""Training-inference mismatch metrics and the TIS/MIS corrections (dist_sr.rl.mismatch) on
constructed log-probabilities, and in a GRPO run whose engine's log-probabilities are off by a
known amount."""

import json
import math

import pytest
import torch

from dist_sr.config import ConfigError
from dist_sr.rl.grpo import grpo_loss
from dist_sr.rl.mismatch import importance_weights, mismatch_metrics

# r = trainer - engine per token; the last token of row 1 and the last two of row 2 are padding
R = torch.tensor([[0.0, 0.5, -0.2, 1.0], [-1.5, 0.05, 0.0, 9.0], [0.3, 0.3, 7.0, -7.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])


def _pair(r=R, seed=0):
    engine = -torch.rand(r.shape, generator=torch.Generator().manual_seed(seed)) * 3
    return engine + r, engine


def test_engines_that_agree_give_zero_mismatch_and_unit_weights():
    logp = -torch.rand(4, 5, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 5, dtype=torch.long)
    mask[2, 3:] = 0
    m = mismatch_metrics(logp, logp.clone(), mask)
    assert all(v == 0.0 for v in m.values()) and len(m) == 7
    for mode in ("tis", "mis"):
        w, stats = importance_weights(logp, logp.clone(), mask, mode=mode, cap=2.0)
        assert torch.equal(w, mask.float()) and all(v == 0.0 for v in stats.values())
        adv = torch.tensor([1.0, -0.5, 0.25, 2.0])
        plain, _ = grpo_loss(logp, logp.detach(), adv, mask, clip_eps=0.2)
        weighted, _ = grpo_loss(logp, logp.detach(), adv, mask, clip_eps=0.2, is_weights=w)
        assert torch.equal(plain, weighted)
    assert importance_weights(logp, logp, mask, mode="none", cap=2.0) == (None, {})


def test_metrics_on_constructed_log_ratios():
    trainer, engine = _pair()
    m = mismatch_metrics(trainer, engine, MASK, threshold=0.4)
    valid = [0.0, 0.5, -0.2, 1.0, -1.5, 0.05, 0.0, 0.3, 0.3]  # r on the 9 valid tokens
    assert m["mismatch_abs_mean"] == pytest.approx(sum(abs(v) for v in valid) / 9, rel=1e-6)
    assert m["mismatch_abs_max"] == pytest.approx(1.5, rel=1e-6)  # 9.0 and 7.0 are padding
    assert m["mismatch_frac_over"] == pytest.approx(3 / 9)  # 0.5, 1.0 and -1.5 exceed 0.4
    seqs = [1.3, -1.45, 0.6]
    assert m["mismatch_seq_logratio"] == pytest.approx(sum(seqs) / 3, rel=1e-5)
    assert m["mismatch_seq_logratio_absmax"] == pytest.approx(1.45, rel=1e-5)
    assert m["mismatch_kl_k1"] == pytest.approx(-sum(valid) / 9, rel=1e-5)
    assert m["mismatch_kl_k3"] == pytest.approx(sum(math.expm1(v) - v for v in valid) / 9, rel=1e-5)
    assert m["mismatch_kl_k3"] > 0


def test_tis_truncates_each_token_ratio_at_the_cap():
    trainer, engine = _pair()
    w, stats = importance_weights(trainer, engine, MASK, mode="tis", cap=2.0)
    expect = torch.exp(R).clamp(max=2.0) * MASK
    assert torch.allclose(w, expect, rtol=1e-6)
    assert w[0, 3] == 2.0 and w[2, 0] == pytest.approx(math.exp(0.3), rel=1e-6)  # e^1 clipped, e^0.3 kept
    assert w[1, 3] == 0 and w[2, 2] == 0  # padding, however large its ratio
    assert stats["is_clipped_frac"] == pytest.approx(1 / 9)  # only r = 1.0 exceeds log 2 among valid tokens


def test_mis_drops_whole_sequences_outside_the_cap():
    trainer, engine = _pair()
    # sequence log-ratios 1.3, -1.45, 0.6: with cap 3 (log 3 = 1.0986) rows 0 and 1 are dropped
    w, stats = importance_weights(trainer, engine, MASK, mode="mis", cap=3.0)
    assert torch.equal(w, torch.tensor([[0.0] * 4, [0.0] * 4, [1.0, 1.0, 0.0, 0.0]]))
    assert stats["is_masked_frac"] == pytest.approx(2 / 3)
    w, stats = importance_weights(trainer, engine, MASK, mode="mis", cap=5.0)  # log 5 = 1.609: all kept
    assert torch.equal(w, MASK.float()) and stats["is_masked_frac"] == 0.0


def test_weights_scale_each_tokens_gradient_and_carry_none_themselves():
    trainer, engine = _pair()
    logp = trainer.clone().requires_grad_(True)
    w, _ = importance_weights(logp, engine, MASK, mode="tis", cap=2.0)
    assert not w.requires_grad
    adv = torch.tensor([1.0, -1.0, 0.5])
    loss, _ = grpo_loss(logp, logp.detach(), adv, MASK, clip_eps=0.2, is_weights=w)
    loss.backward()
    plain = logp.detach().clone().requires_grad_(True)
    grpo_loss(plain, plain.detach(), adv, MASK, clip_eps=0.2)[0].backward()
    assert torch.allclose(logp.grad, plain.grad * w, rtol=1e-6, atol=0)


def test_bad_settings_are_refused(easy):
    with pytest.raises(ValueError, match="unknown importance-sampling correction"):
        importance_weights(R, R, MASK, mode="ppo", cap=2.0)
    with pytest.raises(ConfigError, match="grpo.is_correction"):
        easy(**{"grpo.is_correction": "token"})
    with pytest.raises(ConfigError, match="grpo.is_cap must be > 1"):
        easy(**{"grpo.is_cap": 1.0})


@pytest.mark.parametrize("correction", ["none", "tis"])
def test_a_run_with_an_engine_off_by_a_known_amount_logs_it(easy, correction):
    """An engine (the trainer's own module) that reports every log-probability 0.25 lower than it
    is: the trainer logs a mismatch of exactly that, and TIS weights of e^0.25."""
    from dist_sr.rl.grpo import sequence_logits, token_logprobs
    from dist_sr.rl.trainer import train
    from dist_sr.rollout.embedded import EmbeddedEngine

    class Shifted(EmbeddedEngine):
        def generate(self, prompts, **kw):
            ro = super().generate(prompts, **kw)
            with torch.no_grad():
                logits = sequence_logits(
                    self.model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask
                )
                ro.engine_logprobs = (token_logprobs(logits, ro.completion_ids) - 0.25) * ro.completion_mask
            return ro

    cfg = easy(**{"grpo.steps": 3, "grpo.is_correction": correction, "grpo.is_cap": 1.2, "eval.every": 100})
    metrics = train(cfg, progress=False, make_engine=lambda model, tok: Shifted(model, tok))
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if '"reward"' in line]
    assert len(rows) == 3
    for row in rows:
        assert row["mismatch_abs_mean"] == pytest.approx(0.25, abs=1e-5)
        assert row["mismatch_abs_max"] == pytest.approx(0.25, abs=1e-5)
        assert row["mismatch_frac_over"] == 1.0  # 0.25 > the default threshold 0.1
        assert row["mismatch_kl_k1"] == pytest.approx(-0.25, abs=1e-5)
        if correction == "tis":
            assert row["is_clipped_frac"] == 1.0  # e^0.25 = 1.28 > 1.2 on every token
        else:
            assert "is_clipped_frac" not in row
