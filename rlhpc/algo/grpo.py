"""Advantage estimators, policy losses, KL estimators and loss aggregation (GRPO and friends).

Tensors are token-aligned: ``logprobs``, ``old_logprobs``, ``ref_logprobs`` and ``mask`` are
``[batch, response_len]``; ``mask`` is 1 on response tokens that count. The definitions, and the
names other frameworks give them, are in docs/guides/losses.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _unscored(
    name: str, rewards: torch.Tensor, group_size: int, normalize_std: bool, eps: float
) -> torch.Tensor | None:
    """The advantages of ``name`` where some samples have no reward (NaN: their sandbox failed
    for infrastructure, ``rlhpc.errors.InfrastructureFailure``): each statistic taken over the
    scored samples only, so an unscored one is out of its group's baseline (and the batch's), and
    its own advantage is 0. None when every sample is scored: the estimator's own arithmetic."""
    nan = torch.isnan(rewards)
    if not nan.any():
        return None
    valid = (~nan).float().view(-1, group_size)
    x = torch.where(nan, torch.zeros_like(rewards), rewards).float().view(-1, group_size)
    count = valid.sum(1, keepdim=True)
    if name == "reinforce_plus_plus":
        total = valid.sum().clamp(min=1)
        centered = (x - (x * valid).sum() / total) * valid
        if normalize_std:
            centered = centered / (torch.sqrt((centered**2).sum() / total) + eps)
        return centered.view(-1)
    if name == "rloo":
        baseline = ((x * valid).sum(1, keepdim=True) - x) / (count - 1).clamp(min=1)
        return ((x - baseline) * valid * (count > 1)).view(-1)
    centered = (x - (x * valid).sum(1, keepdim=True) / count.clamp(min=1)) * valid
    if normalize_std:
        if name == "grpo":
            std = torch.sqrt((centered**2).sum(1, keepdim=True) / count.clamp(min=1))
        else:  # reinforce_plus_plus_baseline: one std over the batch's scored samples
            std = torch.sqrt((centered**2).sum() / valid.sum().clamp(min=1))
        centered = centered / (std + eps)
    return centered.view(-1)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages: (r - mean(group)) / (std(group) + eps).

    ``rewards`` is flat ``[n_prompts * group_size]``, samples of a prompt adjacent. The std is
    the population std (unbiased=False); a group whose rewards are all equal gets 0. A NaN
    reward (no score) is left out of every statistic and gets 0, in every estimator here.
    """
    if (masked := _unscored("grpo", rewards, group_size, normalize_std, eps)) is not None:
        return masked
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centered.view(-1)


def rloo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean(r_j, j != i)."""
    if (masked := _unscored("rloo", rewards, group_size, normalize_std, eps)) is not None:
        return masked
    groups = rewards.float().view(-1, group_size)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baseline).view(-1)


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++: (r - mean(batch)) / (std(batch) + eps), no per-prompt baseline.

    Each sample counts once (population std over the rollout's samples, not over its tokens).
    """
    if (masked := _unscored("reinforce_plus_plus", rewards, group_size, normalize_std, eps)) is not None:
        return masked
    r = rewards.float()
    centered = r - r.mean()
    if normalize_std:
        centered = centered / (r.std(unbiased=False) + eps)
    return centered


def reinforce_pp_baseline_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """REINFORCE++ with a baseline: (r - mean(group)) / (std(batch of those) + eps).

    The group mean removes the prompt's difficulty; the one batch-wide std keeps the scale of
    easy and hard prompts comparable (GRPO divides each group by its own std instead).
    """
    if (masked := _unscored("reinforce_plus_plus_baseline", rewards, group_size, normalize_std, eps)) is not None:
        return masked
    groups = rewards.float().view(-1, group_size)
    centered = (groups - groups.mean(dim=1, keepdim=True)).view(-1)
    if normalize_std:
        centered = centered / (centered.std(unbiased=False) + eps)
    return centered


# Per-sample estimators, selected by ``algo.advantage_estimator``. A token-level estimator
# (PPO with a critic, GAE) plugs in here with the same signature plus values.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_plus_plus": reinforce_pp_advantages,
    "reinforce_plus_plus_baseline": reinforce_pp_baseline_advantages,
}


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each sample's reward before advantages: 0 for a
    response of L <= max_len - buffer tokens, else -penalty * (L - (max_len - buffer)) / buffer
    (so -penalty at L = max_len). ``buffer`` 0: no penalty."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    over = (lengths.float() - (max_len - buffer)).clamp(min=0)
    return -penalty * over / buffer


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


# ---------------------------------------------------------------- loss aggregation

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class AggNorm:
    """The denominators of one minibatch's loss, counted over all its micro-batches on all
    data-parallel ranks: a micro-batch's ``agg_loss`` is then its exact share of the whole."""

    tokens: float  # response tokens
    seqs: float  # samples with at least one response token
    max_len: float = 1.0  # seq-mean-token-sum-norm's constant (rollout.max_new_tokens)


def agg_counts(mask: torch.Tensor) -> tuple[float, float]:
    """(response tokens, samples with a response token) of a ``mask``: ``AggNorm``'s counts."""
    return float(mask.sum()), float((mask.sum(-1) > 0).sum())


def agg_loss(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: AggNorm | None = None, max_len: float = 1.0
) -> torch.Tensor:
    """Reduce a per-token loss to a scalar (``algo.loss_agg_mode``), T_i the tokens of sample i,
    T their total and N the samples (with a response token):

    * ``token-mean``: sum_i sum_t l_it / T (every token weighs the same);
    * ``seq-mean-token-mean``: (1/N) sum_i (sum_t l_it / T_i) (every sample weighs the same);
    * ``seq-mean-token-sum``: (1/N) sum_i sum_t l_it;
    * ``seq-mean-token-sum-norm``: (1/N) sum_i sum_t l_it / max_len (Dr. GRPO: a constant
      instead of each sample's length).

    ``norm``: the whole minibatch's counts when ``per_token`` is one micro-batch of it (the
    result is then its share: the shares of all micro-batches and ranks sum to the loss of the
    whole); None: this batch is the whole.
    """
    if norm is None:
        tokens, seqs = agg_counts(mask)
        norm = AggNorm(tokens, seqs, max_len)
    masked = per_token * mask
    if mode == "token-mean":
        return masked.sum() / max(norm.tokens, 1.0)
    seq_sums = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        seq_sums = seq_sums / mask.sum(-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        seq_sums = seq_sums / norm.max_len
    elif mode != "seq-mean-token-sum":
        raise ValueError(f"unknown loss aggregation {mode!r}: one of {', '.join(LOSS_AGG_MODES)}")
    return seq_sums.sum() / max(norm.seqs, 1.0)


# ---------------------------------------------------------------- policy losses

POLICY_LOSSES = ("ppo_clip", "gspo", "cispo")


def policy_loss_per_token(
    kind: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token policy loss ``[batch, len]`` and where it was clipped (float 0/1), before
    aggregation (``agg_loss``). r is pi / pi_old, A the advantage:

    * ``ppo_clip``: max(-A r_t, -A clip(r_t, 1 - eps_clip, 1 + eps_clip_high)) per token;
    * ``gspo``: the same with the sample's sequence ratio s_i = exp(mean_t(log r_t)) in every
      token (its gradient is that of GSPO's token form sg(s_i) * r_t / sg(r_t));
    * ``cispo``: -sg(min(r_t, 1 + eps_clip_high)) * A * log pi_t: the truncated weight has no
      gradient, so no token's gradient is ever dropped by the clip (``eps_clip`` is unused).

    ``tis_weights`` (per token, no grad; see ``truncated_is_weights``) multiply each token's
    term in all three: they correct for the engine's sampling policy, the ratio for the
    trainer's own steps within a rollout, so the two compose.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    log_ratio = logprobs - old_logprobs
    if kind in ("ppo_clip", "gspo"):
        if kind == "gspo":
            seq_log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
            ratio = torch.exp(seq_log_ratio).expand_as(logprobs)
        else:
            ratio = torch.exp(log_ratio)
        unclipped = -advantages * ratio
        clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
        per_token = torch.maximum(unclipped, clipped)
        was_clipped = (clipped > unclipped).float()
    elif kind == "cispo":
        ratio = torch.exp(log_ratio.detach())
        per_token = -ratio.clamp(max=1.0 + eps_clip_high) * advantages * logprobs
        was_clipped = (ratio > 1.0 + eps_clip_high).float()
    else:
        raise ValueError(f"unknown policy loss {kind!r}: one of {', '.join(POLICY_LOSSES)}")
    if tis_weights is not None:
        per_token = per_token * tis_weights
    return per_token, was_clipped


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    tis_weights: torch.Tensor | None = None,
    kind: str = "ppo_clip",
    agg: str = "token-mean",
    max_len: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch's policy loss (``policy_loss_per_token`` reduced by ``agg_loss``) and its clip
    fraction (share of response tokens clipped). ``advantages`` is per sample ``[batch]``
    (broadcast over tokens) or per token."""
    per_token, was_clipped = policy_loss_per_token(
        kind, logprobs, old_logprobs, advantages, mask, eps_clip, eps_clip_high, tis_weights
    )
    return agg_loss(per_token, mask, agg, max_len=max_len), masked_mean(was_clipped, mask)


def truncated_is_weights(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance weights min(pi_old / pi_behaviour, clip) per token, and the share of
    response tokens whose weight was truncated.

    The behaviour policy is what generated the tokens (the engines' own logprobs: older weights
    in the asynchronous pipeline, and a different numerical implementation in any case);
    ``old_logprobs`` is the trainer's policy before this rollout's steps. Truncating at ``clip``
    bounds the variance a rare token could add, at the price of some bias.
    """
    raw = torch.exp(old_logprobs - behaviour_logprobs)
    weights = raw.clamp(max=clip) * mask
    clipped = masked_mean((raw > clip).float(), mask)
    return weights.detach(), clipped


# ---------------------------------------------------------------- KL to the reference

KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || ref) from the sampled tokens (``algo.kl_estimator``),
    with d = lp - ref:

    * ``k1``: d (unbiased, can be negative per token);
    * ``k2``: d^2 / 2 (biased, >= 0; its gradient is that of the reverse KL);
    * ``k3``: exp(-d) + d - 1 (unbiased, >= 0);
    * ``low_var_kl``: k3 with d clamped to [-20, 20] and the result to [-10, 10], so one token
      the reference finds very unlikely cannot dominate the penalty.
    """
    d = logprobs - ref_logprobs
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "k3":
        return kl_k3(logprobs, ref_logprobs)
    if kind == "low_var_kl":
        d = d.clamp(-20.0, 20.0)
        return (torch.exp(-d) + d - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL estimator {kind!r}: one of {', '.join(KL_ESTIMATORS)}")


def sequence_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kind: str) -> torch.Tensor:
    """Per sample ``[batch]``: sum_t KL_t over its response tokens (``kl_estimate``), what
    ``algo.kl_in_reward`` charges each sample's reward. In float64: k3's e^-d + d - 1 cancels to
    exactly 0 in float32 for |d| below ~3e-4, the size of a policy's first steps away from the
    reference."""
    return (kl_estimate(logprobs.double(), ref_logprobs.double(), kind) * mask.double()).sum(-1)


def kl_in_reward(
    rewards: torch.Tensor, seq_kl: torch.Tensor, coef: float, estimator: str, group_size: int, normalize_std: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``algo.kl_in_reward``: the rewards less ``coef * seq_kl`` (``sequence_kl``), the advantages
    of those (``ADVANTAGE_ESTIMATORS[estimator]``), and the penalty subtracted, per sample."""
    penalty = coef * seq_kl.float()
    penalized = rewards.float() - penalty
    return penalized, ADVANTAGE_ESTIMATORS[estimator](penalized, group_size, normalize_std), penalty


def distill_advantages(
    advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation (``algo.distill_coef``, as slime's ``--opd-kl-coef``): per token,
    the sample's advantage minus ``coef`` x the reverse-KL estimate log pi_old - log pi_teacher
    of the sampled token, so the policy gradient pushes each token toward the teacher's
    probability of it. No gradient flows through the term (both logprobs are fixed). Returns
    the per-token advantages [N, L] and the per-token reverse KL (0 off the mask)."""
    reverse_kl = ((old_logprobs - teacher_logprobs) * mask).detach()
    per_sample = advantages[:, None] if advantages.dim() == 1 else advantages
    return per_sample - coef * reverse_kl, reverse_kl
