"""Loss aggregations, policy losses, advantage estimators and KL estimators against numbers
worked out by hand (in the comments) or with plain Python floats, never with the code under test."""

import math

import pytest
import torch

from rlhpc.algo.grpo import (
    ADVANTAGE_ESTIMATORS,
    LOSS_AGG_MODES,
    AggNorm,
    agg_counts,
    agg_loss,
    kl_estimate,
    kl_in_reward,
    policy_loss,
    policy_loss_per_token,
    sequence_kl,
)


# Three samples: 3 response tokens, 2 response tokens, none (an empty response). Masked entries
# hold 9s, so a mode that forgot the mask would be off by a lot.
def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5) / 5),  # 3.0
        ("seq-mean-token-mean", (6 / 3 + 9 / 2) / 2),  # 3.25: the empty sample is not a sample
        ("seq-mean-token-sum", (6 + 9) / 2),  # 7.5
        ("seq-mean-token-sum-norm", (6 / 4 + 9 / 4) / 2),  # 1.875 with max_len 4
    ],
)
def test_each_aggregation_by_hand(mode, expected):
    assert agg_loss(PER_TOKEN, MASK, mode, max_len=4).item() == pytest.approx(expected, rel=1e-6)


def test_counts_skip_samples_without_response_tokens():
    assert agg_counts(MASK) == (5.0, 2.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_shares_add_up_to_the_whole(mode):
    """What each rank does: a micro-batch's loss over the minibatch's counts. The shares of any
    split sum to the loss of the whole batch, so the gradient does not depend on the split."""
    whole = agg_loss(PER_TOKEN, MASK, mode, max_len=4).item()
    tokens, seqs = agg_counts(MASK)
    norm = AggNorm(tokens, seqs, 4.0)
    for split in ([1, 2], [2, 1], [1, 1, 1]):
        parts = torch.split(PER_TOKEN, split), torch.split(MASK, split)
        total = sum(agg_loss(p, m, mode, norm).item() for p, m in zip(*parts))
        assert total == pytest.approx(whole, rel=1e-6), split


def test_token_and_sequence_means_weigh_long_answers_differently():
    # token-mean: the 3-token sample weighs 3/5; seq-mean: 1/2. A gradient check of that weight.
    lp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    agg_loss(lp, mask, "token-mean").backward()
    assert lp.grad.flatten().tolist() == pytest.approx(flat([[0.25, 0.25, 0.25], [0.25, 0.0, 0.0]]))
    lp.grad = None
    agg_loss(lp, mask, "seq-mean-token-mean").backward()
    assert lp.grad.flatten().tolist() == pytest.approx(flat([[1 / 6, 1 / 6, 1 / 6], [0.5, 0.0, 0.0]]))


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        agg_loss(PER_TOKEN, MASK, "sum")


# ---------------------------------------------------------------- policy losses


def test_gspo_one_clipped_ratio_per_sample_by_hand():
    old = torch.zeros(2, 3)
    # sample 0: mean log ratio over its 2 tokens (0.3 - 0.1) / 2 = 0.1 -> s = e^0.1 = 1.105,
    #   clipped to 1 + 4e-4 (A = 1 > 0): every token -1.0004
    # sample 1: mean 1e-4 -> s = e^1e-4 = 1.0001, inside [1 - 3e-4, 1 + 4e-4]; A = -2: every token 2 * 1.0001
    new = torch.tensor([[0.3, -0.1, 5.0], [1e-4, 1e-4, 1e-4]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -2.0])
    loss, clipfrac = policy_loss(new, old, adv, mask, 3e-4, 4e-4, kind="gspo")
    s1 = math.exp(1e-4)
    assert loss.item() == pytest.approx((2 * -1.0004 + 3 * 2 * s1) / 5, rel=1e-6)
    assert clipfrac.item() == pytest.approx(2 / 5)
    loss, _ = policy_loss(new, old, adv, mask, 3e-4, 4e-4, kind="gspo", agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx((-1.0004 + 2 * s1) / 2, rel=1e-6)


def test_gspo_gradient_is_the_sequence_ratios():
    # unclipped, on policy (s = 1), A = 1, token-mean over 2 tokens: loss = -s, ds/dlp_t = s / 2
    lp = torch.zeros(1, 3, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(lp, lp.detach(), torch.tensor([1.0]), mask, 3e-4, 4e-4, kind="gspo")
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx(flat([[-0.5, -0.5, 0.0]]))


def test_cispo_by_hand():
    old = torch.zeros(1, 2)
    lp = torch.tensor([[0.5, -0.5]], requires_grad=True)
    adv = torch.tensor([2.0])
    # weights: min(e^0.5, 1.28) = 1.28 (truncated), e^-0.5 = 0.6065; per token -w * A * lp
    loss, clipfrac = policy_loss(lp, old, adv, torch.ones(1, 2), 0.2, 0.28, kind="cispo")
    w1 = math.exp(-0.5)
    assert loss.item() == pytest.approx((-1.28 * 2 * 0.5 + w1 * 2 * 0.5) / 2, rel=1e-6)
    assert clipfrac.item() == pytest.approx(0.5)
    loss.backward()
    # the weight has no gradient: d/dlp_t = -w_t * A / 2, and the truncated token keeps its gradient
    assert lp.grad.flatten().tolist() == pytest.approx(flat([[-1.28, -w1]]), rel=1e-6)


def test_ppo_clip_drops_the_gradient_of_a_clipped_token_where_cispo_keeps_it():
    lp = torch.tensor([[0.5]], requires_grad=True)  # ratio e^0.5 > 1.28 with A > 0
    policy_loss(lp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.28)[0].backward()
    assert lp.grad.item() == 0.0


@pytest.mark.parametrize("kind", ["ppo_clip", "gspo", "cispo"])
def test_tis_weights_scale_every_policy_loss(kind):
    new = torch.tensor([[0.1, -0.1, 0.0]])
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    adv = torch.tensor([1.0])
    plain, _ = policy_loss_per_token(kind, new, old, adv, mask, 0.2, 0.28)
    weights = torch.tensor([[0.5, 2.0, 0.0]])
    weighted, _ = policy_loss_per_token(kind, new, old, adv, mask, 0.2, 0.28, weights)
    assert weighted.flatten().tolist() == pytest.approx(
        flat([[0.5 * plain[0, 0].item(), 2.0 * plain[0, 1].item(), 0.0]])
    )


def test_unknown_policy_loss_is_refused():
    with pytest.raises(ValueError, match="unknown policy loss"):
        policy_loss_per_token("dapo", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), 0.2, 0.2)


# ---------------------------------------------------------------- advantage estimators

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # two prompts, 3 samples each


def test_reinforce_plus_plus_normalises_over_the_batch():
    # batch mean 4/6 = 2/3, population std sqrt(2/9): (1 - 2/3) / sqrt(2/9) = 1/sqrt(2), (0 - 2/3) / sqrt(2/9) = -sqrt(2)
    adv = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](REWARDS, 3, True, 1e-12)
    hi, lo = 1 / math.sqrt(2), -math.sqrt(2)
    assert adv.tolist() == pytest.approx([hi, lo, lo, hi, hi, hi], rel=1e-5)
    adv = ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](REWARDS, 3, False)
    assert adv.tolist() == pytest.approx([1 / 3, -2 / 3, -2 / 3, 1 / 3, 1 / 3, 1 / 3], rel=1e-5)


def test_reinforce_plus_plus_baseline_divides_by_the_batch_std():
    # group means 1/3 and 1: centered [2/3, -1/3, -1/3, 0, 0, 0], whose population std is
    # sqrt((4/9 + 1/9 + 1/9) / 6) = 1/3 -> [2, -1, -1, 0, 0, 0]. (GRPO's own-group std would give sqrt(2) * that.)
    adv = ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"](REWARDS, 3, True, 1e-12)
    assert adv.tolist() == pytest.approx([2.0, -1.0, -1.0, 0.0, 0.0, 0.0], rel=1e-5)
    grpo = ADVANTAGE_ESTIMATORS["grpo"](REWARDS, 3, True, 1e-12)
    assert grpo[0].item() == pytest.approx(math.sqrt(2), rel=1e-5)
    adv = ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"](REWARDS, 3, False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0], rel=1e-5)


def test_an_unscored_sample_is_out_of_every_baseline_and_gets_no_advantage():
    """NaN (a sample whose sandbox could not run) in a group of 4: group 0 is then [1, 0, 1]
    scored. By hand: GRPO's group mean 2/3, population std sqrt(2)/3 -> (1 - 2/3) / (sqrt(2)/3)
    = 1/sqrt(2), (0 - 2/3) / (sqrt(2)/3) = -sqrt(2); RLOO's leave-one-out over the other two
    scored: 1 - 1/2, 0 - 1, 1 - 1/2; group 1 [0, 0, 1, 1] as it is."""
    rewards = torch.tensor([1.0, math.nan, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    hi, lo = 1 / math.sqrt(2), -math.sqrt(2)
    assert ADVANTAGE_ESTIMATORS["grpo"](rewards, 4, True, 1e-12).tolist() == pytest.approx(
        [hi, 0.0, lo, hi, -1.0, -1.0, 1.0, 1.0], rel=1e-5
    )
    assert ADVANTAGE_ESTIMATORS["rloo"](rewards, 4).tolist() == pytest.approx(
        [0.5, 0.0, -1.0, 0.5, -2 / 3, -2 / 3, 2 / 3, 2 / 3], rel=1e-5
    )
    # the batch's scored samples: 4 of 7 are 1 -> mean 4/7 (REINFORCE++, not normalised)
    assert ADVANTAGE_ESTIMATORS["reinforce_plus_plus"](rewards, 4, False).tolist() == pytest.approx(
        [3 / 7, 0.0, -4 / 7, 3 / 7, -4 / 7, -4 / 7, 3 / 7, 3 / 7], rel=1e-5
    )
    # group means 2/3 and 1/2 over their scored samples (not normalised)
    assert ADVANTAGE_ESTIMATORS["reinforce_plus_plus_baseline"](rewards, 4, False).tolist() == pytest.approx(
        [1 / 3, 0.0, -2 / 3, 1 / 3, -0.5, -0.5, 0.5, 0.5], rel=1e-5
    )
    # a group with nothing scored, or one scored sample only: no advantage, no NaN
    alone = torch.tensor([math.nan, math.nan, 1.0, math.nan])
    for name, fn in ADVANTAGE_ESTIMATORS.items():
        assert fn(alone, 2, True).tolist() == [0.0, 0.0, 0.0, 0.0], name


# ---------------------------------------------------------------- KL estimators

LP = torch.tensor([0.0, -1.0, 1.0, -30.0])
REF = torch.zeros(4)  # d = lp - ref = [0, -1, 1, -30]


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("k1", [0.0, -1.0, 1.0, -30.0]),  # d
        ("k2", [0.0, 0.5, 0.5, 450.0]),  # d^2 / 2
        ("k3", [0.0, math.e - 2, math.exp(-1.0), math.exp(30.0) - 31]),  # e^-d + d - 1
        ("low_var_kl", [0.0, math.e - 2, math.exp(-1.0), 10.0]),  # d clamped to -20: e^20 - 21, clamped to 10
    ],
)
def test_kl_estimators_by_hand(kind, expected):
    assert kl_estimate(LP, REF, kind).tolist() == pytest.approx(expected, rel=1e-5)


def test_unknown_kl_estimator_is_refused():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(LP, REF, "k4")


# ---------------------------------------------------------------- KL in the reward (algo.kl_in_reward)

# Two samples. The first has 2 response tokens (the third position is masked, and its 9s would
# show if the mask were forgotten): d = lp - ref = [0.5, 0]. The second has 3: d = [0.3, 0, -0.1].
SEQ_LP = torch.tensor([[-1.0, -2.0, 9.0], [-0.1, -0.3, -0.2]])
SEQ_REF = torch.tensor([[-1.5, -2.0, -9.0], [-0.4, -0.3, -0.1]])
SEQ_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("k1", [0.5, 0.3 - 0.1]),  # sum of d
        ("k2", [0.125, 0.045 + 0.005]),  # sum of d^2 / 2
        # sum of e^-d + d - 1: e^-0.5 - 0.5; (e^-0.3 - 0.7) + 0 + (e^0.1 - 1.1)
        ("k3", [0.1065306597, 0.0408182207 + 0.0051709181]),
    ],
)
def test_sequence_kl_sums_each_samples_response_tokens_by_hand(kind, expected):
    assert sequence_kl(SEQ_LP, SEQ_REF, SEQ_MASK, kind).tolist() == pytest.approx(expected, rel=1e-6)


def test_sequence_kl_keeps_a_tiny_k3():
    # d = 1e-4: k3 = e^-d + d - 1 = d^2/2 - d^3/6 + ... = 5e-9 (float32 would cancel it to 0)
    lp, ref = torch.tensor([[-1.0 + 1e-4]]), torch.tensor([[-1.0]])
    d = (lp - ref).item()  # 1e-4 as float32 holds it
    assert sequence_kl(lp, ref, torch.ones(1, 1), "k3").item() == pytest.approx(d * d / 2 - d**3 / 6, rel=1e-6)


def test_kl_in_reward_penalises_rewards_before_the_advantages_by_hand():
    # two prompts of two samples; coef 0.1 x sequence KL [0.5, 0.1, 0, 0.2] = [0.05, 0.01, 0, 0.02]
    rewards, seq_kl = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.5, 0.1, 0.0, 0.2])
    penalized, adv, penalty = kl_in_reward(rewards, seq_kl, 0.1, "grpo", 2, False)
    assert penalty.tolist() == pytest.approx([0.05, 0.01, 0.0, 0.02], rel=1e-6)
    assert penalized.tolist() == pytest.approx([0.95, -0.01, 1.0, 0.98], rel=1e-6)
    # group means 0.47 and 0.99; the second prompt's equal rewards now differ, by the KL alone
    assert adv.tolist() == pytest.approx([0.48, -0.48, 0.01, -0.01], rel=1e-5)
    # reinforce++ (no std): the batch mean (0.95 - 0.01 + 1.0 + 0.98) / 4 = 0.73 is the baseline
    _, adv, _ = kl_in_reward(rewards, seq_kl, 0.1, "reinforce_plus_plus", 2, False)
    assert adv.tolist() == pytest.approx([0.22, -0.74, 0.27, 0.25], rel=1e-5)
