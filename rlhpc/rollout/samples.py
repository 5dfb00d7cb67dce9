"""``Samples``: what a sampler gives back, ``n`` samples per row, scored; the record a rollout's
batch (``rlhpc.batch.RolloutBatch``) and an evaluation's metrics are made from."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import Field, dataclass, field, fields
from typing import Any

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
    # a dict reward's other parts, per sample (NaN where a sample has no such part)
    parts: dict[str, list[float]] = field(default_factory=dict, metadata={"missing": math.nan})
    # Multi-turn episodes only (empty for single-turn samples, whose response is all generated):
    loss_masks: list[list[int]] = field(default_factory=list)  # per response token: 1 generated, 0 observation
    turns: list[list[int]] = field(default_factory=list)  # per response token: its turn
    episode: dict[str, list[float]] = field(default_factory=dict)  # per sample: turns, truncated, ...
    finish_reasons: list[str | None] = field(default_factory=list)  # single-turn: the engine's, per sample
    # An agent's episode may give several samples (``trajectories.assemble``): per sample, its
    # episode's index (row-major, a row's n episodes adjacent). Empty: sample k is episode k.
    episode_of: list[int] = field(default_factory=list)
    # A vision-language model's: per sample, its prompt's images (``ImageRef``); empty: none has any.
    images: list[list] = field(default_factory=list, metadata={"pad": True})
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
        """Samples ``idx`` of every per-sample field (an empty optional one stays empty)."""

        def pick(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return value[idx] if idx else value[:0]
            if isinstance(value, dict):
                return {key: [v[k] for k in idx] for key, v in value.items()}
            return [value[k] for k in idx] if value else []

        picked = {f.name: pick(getattr(self, f.name)) for f in fields(self) if f.name != "episode_of"}
        return Samples(**picked, episode_of=episode_of)

    @staticmethod
    def concat(parts: Sequence[Samples]) -> Samples:
        """``parts`` one after the other, field by field (``missing``: a dict field's filler for a
        part without one of its keys; ``pad``: an optional field kept aligned where some parts
        have it and others not)."""

        def join(f: Field) -> Any:
            values = [getattr(p, f.name) for p in parts]
            if isinstance(values[0], torch.Tensor):
                return torch.cat(values)
            if isinstance(values[0], dict):
                if "missing" in f.metadata:  # every part's keys; a part without one: the filler per sample
                    fill = f.metadata["missing"]
                    keys = dict.fromkeys(key for v in values for key in v)
                    return {
                        key: [x for p, v in zip(parts, values) for x in v.get(key, [fill] * len(p.rewards))]
                        for key in keys
                    }
                return {key: [x for v in values for x in v.get(key, [])] for key in values[0]}
            if f.metadata.get("pad"):
                return (
                    [x for p, v in zip(parts, values) for x in (v or [[]] * len(p.response_ids))] if any(values) else []
                )
            return [x for v in values for x in v]

        joined = {f.name: join(f) for f in fields(Samples) if f.name != "episode_of"}
        return Samples(**joined, episode_of=Samples._concat_episodes(parts))

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
