"""GRPO math against values computed by hand."""

import math

import torch

from rlhpc.algo.grpo import grpo_advantages, kl_k3, policy_loss, rloo_advantages, truncated_is_weights


def test_group_normalised_advantages_by_hand():
    # group 1: [1, 0, 0, 1] mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    # group 2: all equal -> 0
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 1, 3, 3, 3, 3]), group_size=4, eps=0.0 + 1e-12)
    assert torch.allclose(adv, torch.tensor([1.0, -1, -1, 1, 0, 0, 0, 0]), atol=1e-6)


def test_unnormalised_advantages_are_centered_rewards():
    adv = grpo_advantages(torch.tensor([2.0, 0.0, 1.0]), group_size=3, normalize_std=False)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_rloo_by_hand():
    # r = [1, 2, 3]: baselines (2+3)/2, (1+3)/2, (1+2)/2 = 2.5, 2, 1.5
    adv = rloo_advantages(torch.tensor([1.0, 2.0, 3.0]), group_size=3)
    assert torch.allclose(adv, torch.tensor([-1.5, 0.0, 1.5]))


def test_policy_loss_clipping_by_hand():
    old = torch.zeros(1, 3)
    # ratios e^0.5 = 1.6487 (clipped to 1.28 for A>0), e^-0.5 = 0.6065 (A>0: unclipped counts), 1
    new = torch.tensor([[0.5, -0.5, 0.0]])
    mask = torch.ones(1, 3)
    loss, clipfrac = policy_loss(new, old, torch.tensor([2.0]), mask, eps_clip=0.2, eps_clip_high=0.28)
    # per token: max(-2r, -2 clip(r)) -> [-2*1.28, -2*0.6065, -2*1]
    expected = (-2 * 1.28 - 2 * math.exp(-0.5) - 2.0) / 3
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)
    assert math.isclose(clipfrac.item(), 1 / 3, rel_tol=1e-6)


def test_policy_loss_negative_advantage_and_mask():
    old = torch.zeros(1, 3)
    new = torch.tensor([[-0.5, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # third token is padding
    loss, _ = policy_loss(new, old, torch.tensor([-1.0]), mask, eps_clip=0.2, eps_clip_high=0.2)
    # A<0: max(r, clip(r)) -> token0: max(0.6065, 0.8) = 0.8; token1: max(1.6487, 1.2) = 1.6487
    expected = (0.8 + math.exp(0.5)) / 2
    assert math.isclose(loss.item(), expected, rel_tol=1e-5)


def test_policy_gradient_sign_on_policy():
    lp = torch.tensor([[-1.0]], requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.2)
    loss.backward()
    assert lp.grad.item() == -1.0  # raising a positive-advantage token's logprob lowers the loss


def test_k3_kl_by_hand():
    lp, ref = torch.tensor([0.0, -1.0]), torch.tensor([0.0, 0.0])
    # x = ref - lp = [0, 1]: e^x - x - 1 = [0, e - 2]
    assert torch.allclose(kl_k3(lp, ref), torch.tensor([0.0, math.e - 2]))


def test_truncated_importance_weights_by_hand():
    old = torch.tensor([[0.0, -1.0, -2.0, 0.0]])
    behaviour = torch.tensor([[0.0, -2.0, -1.0, -5.0]])  # ratios 1, e, 1/e, e^5 (last token masked)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w, clipped = truncated_is_weights(old, behaviour, mask, clip=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, math.exp(-1.0), 0.0]]))
    assert math.isclose(clipped.item(), 1 / 3, rel_tol=1e-6)  # e > 2 on one of three response tokens
    assert not w.requires_grad


def test_tis_weights_scale_each_tokens_surrogate():
    new = torch.tensor([[0.1, -0.1, 0.0]])
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0])
    plain, _ = policy_loss(new, old, adv, mask, 0.2, 0.28)
    ones, _ = policy_loss(new, old, adv, mask, 0.2, 0.28, tis_weights=torch.ones(1, 3))
    assert torch.equal(plain, ones)
    halved, _ = policy_loss(new, old, adv, mask, 0.2, 0.28, tis_weights=torch.tensor([[0.5, 1.0, 0.0]]))
    expected = (-0.5 * math.exp(0.1) - math.exp(-0.1) - 0.0) / 3
    assert math.isclose(halved.item(), expected, rel_tol=1e-6)
