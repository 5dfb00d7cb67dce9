"""Advantage estimators and the clipped policy-gradient loss (GRPO and friends).

Tensors are token-aligned: ``logprobs``, ``old_logprobs``, ``ref_logprobs`` and ``mask`` are
``[batch, response_len]``; ``mask`` is 1 on response tokens that count.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages: (r - mean(group)) / (std(group) + eps).

    ``rewards`` is flat ``[n_prompts * group_size]``, samples of a prompt adjacent. The std is
    the population std (unbiased=False); a group whose rewards are all equal gets 0.
    """
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centered.view(-1)


def rloo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Leave-one-out baseline: r_i - mean(r_j, j != i)."""
    groups = rewards.float().view(-1, group_size)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)
    return (groups - baseline).view(-1)


# Per-sample estimators, selected by ``algo.advantage_estimator``. A token-level estimator
# (PPO with a critic, GAE) plugs in here with the same signature plus values.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
}


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate, averaged over response tokens. Returns (loss, clip fraction).

    ``advantages`` is per sample ``[batch]`` (broadcast over tokens) or per token.
    ``tis_weights`` (per token, no grad; see ``truncated_is_weights``) reweight each token's
    surrogate for samples drawn from another policy than ``old_logprobs``'.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)
    per_token = torch.maximum(unclipped, clipped)
    if tis_weights is not None:
        per_token = per_token * tis_weights
    loss = masked_mean(per_token, mask)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return loss, clipfrac


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


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(policy || ref): exp(ref - lp) - (ref - lp) - 1 (>= 0)."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0
