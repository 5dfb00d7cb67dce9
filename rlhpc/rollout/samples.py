"""``Samples``: what a sampler gives back, ``n`` samples per row, scored; the record a rollout's
batch (``rlhpc.batch.RolloutBatch``) and an evaluation's metrics are made from."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from rlhpc.data.dynamic_sampling import Group


@dataclass
class Samples:
    """``n`` samples per row, row-major (a row's samples adjacent), scored."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    rewards: torch.Tensor
    texts: dict[str, list[str]]  # "prompt", "response", "answer" per sample
    weight_versions: list[int]  # the weights each sample was generated with (its oldest token's)
    token_versions: list[list[int]]  # per response token
    parts: dict[str, list[float]] = field(default_factory=dict)  # a dict reward's other parts, per sample
    # Multi-turn episodes only (empty for single-turn samples, whose response is all generated):
    loss_masks: list[list[int]] = field(default_factory=list)  # per response token: 1 generated, 0 observation
    turns: list[list[int]] = field(default_factory=list)  # per response token: its turn
    episode: dict[str, list[float]] = field(default_factory=dict)  # per sample: turns, truncated, ...
    finish_reasons: list[str | None] = field(default_factory=list)  # single-turn: the engine's, per sample
    # An agent's episode may give several samples (``trajectories.assemble``): per sample, its
    # episode's index (row-major, a row's n episodes adjacent). Empty: sample k is episode k.
    episode_of: list[int] = field(default_factory=list)
    # A vision-language model's: per sample, its prompt's images (``ImageRef``); empty: none has any.
    images: list[list] = field(default_factory=list)
    # algo.routing_replay: per sample, the experts the engine routed its tokens to (RolloutBatch's)
    routed_experts: list[torch.Tensor] = field(default_factory=list)

    def num_episodes(self) -> int:
        return self.episode_of[-1] + 1 if self.episode_of else len(self.response_ids)

    def episode_rewards(self, rewards: torch.Tensor) -> torch.Tensor:
        """``rewards`` (per sample) per episode: the mean of its samples' (all the episode's reward)."""
        if not self.episode_of:
            return rewards
        index = torch.tensor(self.episode_of)
        sums = torch.zeros(self.num_episodes()).index_add_(0, index, rewards.float())
        return sums / torch.bincount(index, minlength=self.num_episodes()).float()

    def last_per_episode(self) -> Samples:
        """Each episode's last sample (its final reply): one per episode, as evaluation and
        sampling filters count them."""
        if not self.episode_of:
            return self
        last = {e: k for k, e in enumerate(self.episode_of)}
        return self._select([last[e] for e in range(self.num_episodes())], [])

    def episode_metrics(self) -> dict[str, float]:
        """``episode/<stat>``: each episode statistic's mean over the samples."""
        return {f"episode/{key}": sum(v) / max(len(v), 1) for key, v in self.episode.items()}

    def part_metrics(self) -> dict[str, float]:
        """``reward/<part>``: each part's mean over the samples that have it (``errors``: the count)."""
        out = {}
        for key, values in self.parts.items():
            have = [v for v in values if not math.isnan(v)]
            out[f"reward/{key}"] = sum(have) if key == "errors" else sum(have) / max(len(have), 1)
        return out

    def group(self, g: int, n: int) -> Group:
        """Group ``g`` (a prompt's n samples), as a dynamic-sampling filter sees it."""
        if self.episode_of:
            return self.last_per_episode().group(g, n)
        t, span = self.texts, slice(g * n, (g + 1) * n)
        return Group(t["prompt"][g * n], t["answer"][g * n], t["response"][span], self.rewards[span].tolist())

    def groups(self, n: int, keep: Sequence[int]) -> Samples:
        """Groups ``keep`` (a prompt's n samples each, in this order) as Samples of their own."""
        if self.episode_of:  # the samples of the groups' episodes, renumbered
            where = {g: i for i, g in enumerate(keep)}
            idx = [k for g in keep for k, e in enumerate(self.episode_of) if e // n == g]
            return self._select(idx, [where[self.episode_of[k] // n] * n + self.episode_of[k] % n for k in idx])
        return self._select([g * n + j for g in keep for j in range(n)], [])

    def _select(self, idx: list[int], episode_of: list[int]) -> Samples:
        return Samples(
            [self.prompt_ids[k] for k in idx],
            [self.response_ids[k] for k in idx],
            [self.logprobs[k] for k in idx],
            self.rewards[idx] if idx else self.rewards[:0],
            {key: [v[k] for k in idx] for key, v in self.texts.items()},
            [self.weight_versions[k] for k in idx],
            [self.token_versions[k] for k in idx],
            {key: [v[k] for k in idx] for key, v in self.parts.items()},
            [self.loss_masks[k] for k in idx] if self.loss_masks else [],
            [self.turns[k] for k in idx] if self.turns else [],
            {key: [v[k] for k in idx] for key, v in self.episode.items()},
            [self.finish_reasons[k] for k in idx] if self.finish_reasons else [],
            episode_of,
            [self.images[k] for k in idx] if self.images else [],
            [self.routed_experts[k] for k in idx] if self.routed_experts else [],
        )

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        return Samples(
            [x for p in parts for x in p.prompt_ids],
            [x for p in parts for x in p.response_ids],
            [x for p in parts for x in p.logprobs],
            torch.cat([p.rewards for p in parts]),
            {key: [x for p in parts for x in p.texts[key]] for key in parts[0].texts},
            [x for p in parts for x in p.weight_versions],
            [x for p in parts for x in p.token_versions],
            {
                key: [x for p in parts for x in p.parts.get(key, [math.nan] * len(p.rewards))]
                for key in dict.fromkeys(k for p in parts for k in p.parts)
            },
            [x for p in parts for x in p.loss_masks],
            [x for p in parts for x in p.turns],
            {key: [x for p in parts for x in p.episode.get(key, [])] for key in parts[0].episode},
            [x for p in parts for x in p.finish_reasons],
            Samples._concat_episodes(parts),
            [x for p in parts for x in (p.images or [[]] * len(p.response_ids))]
            if any(p.images for p in parts)
            else [],
            [x for p in parts for x in p.routed_experts],
        )

    @staticmethod
    def _concat_episodes(parts: Sequence[Samples]) -> list[int]:
        if not any(p.episode_of for p in parts):
            return []
        out, start = [], 0
        for p in parts:
            out += [start + e for e in (p.episode_of or range(len(p.response_ids)))]
            start += p.num_episodes()
        return out

    def cut(self) -> list[bool]:
        """Per sample, whether it was cut short: a single-turn sample at max_new_tokens (finish
        reason "length"), an episode by max_turns or max_episode_tokens."""
        if self.loss_masks:
            return [bool(t) for t in self.episode.get("truncated", [0.0] * len(self.response_ids))]
        return [r == "length" for r in self.finish_reasons]
