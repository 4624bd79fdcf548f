"""GRPO arithmetic on hand-computed examples."""

import math

import pytest
import torch

from dist_sr.rl.grpo import exact_kl, group_advantages, grpo_loss, k3_kl, masked_mean_per_sequence


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # two groups of four
    adv = group_advantages(rewards, 4)
    # group 1: mean 0.5, population std 0.5 -> +-1 ; group 2: all equal -> 0
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0, 0]), atol=1e-5)
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_loss_on_policy_is_minus_mean_advantage_weighted_by_valid_tokens():
    logp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([2.0, -1.0])
    loss, stats = grpo_loss(logp, logp.detach(), adv, mask, clip_eps=0.2)
    # ratio = 1: per-token loss -A, per-sequence mean -> [-2, 1], mean over sequences -> -0.5
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    # d loss / d logp = -A / (n_valid * n_seq) on valid tokens
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5, 0.0], [0.5, 0.0, 0.0]]))
    assert stats["clip_frac"] == 0.0


def test_ratio_is_clipped_for_positive_and_negative_advantages():
    old = torch.zeros(2, 1)
    new = torch.log(torch.tensor([[1.5], [0.5]]))
    mask = torch.ones(2, 1)
    loss_pos, _ = grpo_loss(new, old, torch.tensor([1.0, 1.0]), mask, clip_eps=0.2)
    # A > 0: min(1.5, 1.2) = 1.2 and min(0.5, 0.8) = 0.5 -> loss = -(1.2 + 0.5) / 2
    assert loss_pos.item() == pytest.approx(-0.85)
    loss_neg, stats = grpo_loss(new, old, torch.tensor([-1.0, -1.0]), mask, clip_eps=0.2)
    # A < 0: min(-1.5, -1.2) = -1.5 and min(-0.5, -0.8) = -0.8 -> loss = (1.5 + 0.8) / 2
    assert loss_neg.item() == pytest.approx(1.15)
    assert stats["clip_frac"] == 1.0


def test_k3_kl_by_hand_and_penalty_enters_the_loss():
    logp = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    # d = log(0.25/0.5) = -log 2: exp(d) - d - 1 = 0.5 + log 2 - 1
    assert k3_kl(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1)
    mask = torch.ones(1, 1)
    base, stats = grpo_loss(logp, logp, torch.tensor([0.0]), mask, clip_eps=0.2, ref_logp=ref)
    pen, _ = grpo_loss(logp, logp, torch.tensor([0.0]), mask, clip_eps=0.2, ref_logp=ref, kl_coef=0.1)
    assert base.item() == 0.0 and pen.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1))
    assert stats["kl_k3"] == pytest.approx(0.5 + math.log(2) - 1)


def test_k3_is_unbiased_for_kl_on_sampled_tokens():
    torch.manual_seed(0)
    p = torch.tensor([0.6, 0.3, 0.1])
    q = torch.tensor([0.2, 0.5, 0.3])
    n = 400_000
    idx = torch.multinomial(p, n, replacement=True)
    est = k3_kl(p.log()[idx], q.log()[idx])
    exact = float((p * (p / q).log()).sum())
    assert abs(est.mean().item() - exact) <= 6 * est.std().item() / math.sqrt(n)


def test_exact_kl_by_hand():
    p = torch.log(torch.tensor([[[0.5, 0.5]], [[0.9, 0.1]]]))
    q = torch.log(torch.tensor([[[0.5, 0.5]], [[0.5, 0.5]]]))
    kl2 = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert exact_kl(p, q, torch.tensor([[1], [1]])) == pytest.approx(kl2 / 2)
    assert exact_kl(p, q, torch.tensor([[0], [1]])) == pytest.approx(kl2)


def test_masked_mean_per_sequence():
    x = torch.tensor([[1.0, 3.0], [5.0, 100.0]])
    assert masked_mean_per_sequence(x, torch.tensor([[1, 1], [1, 0]])).item() == pytest.approx(3.5)
