"""The data a rollout hands to training: token ids, rollout logprobs, rewards, advantages."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch


def _dumped(name: str, dtype: str | None = None, optional: bool = False) -> Any:
    """A field and its ``name`` and ``dtype`` in the rollout's HDF5 dump (``rlhpc.metrics``).
    ``optional``: empty when unknown (then left out of the dump)."""
    extra = {"default_factory": list} if optional else {}
    return field(metadata={"dump": name, "dtype": dtype}, **extra)


@dataclass
class RolloutBatch:
    """``n_prompts * group_size`` samples; the samples of one prompt are adjacent.

    Its fields are the one list of what a rollout holds: a checkpoint's pending rollouts
    (``state_dict``) and the HDF5 dump (each field's metadata) are derived from them."""

    prompt_ids: list[list[int]] = _dumped("prompt_ids", "int32")
    response_ids: list[list[int]] = _dumped("response_ids", "int32")
    rollout_logprobs: list[list[float]] = _dumped(
        "rollout_logprobs", "float32"
    )  # engine logprob of each response token
    rewards: torch.Tensor = _dumped("rewards")  # [N] float32
    advantages: torch.Tensor = _dumped("advantages")  # [N] float32, per sample (broadcast over its tokens)
    group_size: int = _dumped("group_size")  # an attribute of the dump
    # The weight version each sample was generated with (as the engine reported it; the oldest of
    # its tokens' when a partial rollout straddled a weight push); empty when unknown. Rollout r's
    # staleness is r - version: 0 in the synchronous loop.
    weight_versions: list[int] = _dumped("weight_versions", "int64", optional=True)
    # Per response token, the version it was sampled with (SGLang's meta_info "weight_versions"
    # spans); empty when unknown. Differs within a sample only with rollout.partial_rollout.
    token_versions: list[list[int]] = _dumped("token_versions", "int64", optional=True)
    # Multi-turn episodes (rollout.env): per response token, 1 where the engine generated it and 0
    # on observation tokens (the loss and TIS skip those), and the turn it belongs to; per
    # sample, whether the episode was cut (rollout.max_turns / max_episode_tokens). Empty for
    # single-turn samples (every response token is trained on), except with
    # rollout.overlong_filter: then a sample cut at max_new_tokens is truncated, its mask all 0.
    loss_masks: list[list[int]] = _dumped("loss_mask", "int8", optional=True)
    turns: list[list[int]] = _dumped("turn", "int32", optional=True)
    truncated: list[bool] = _dumped("truncated", "bool", optional=True)
    # A teacher (issue 30): each response token's logprob under it (empty without one).
    teacher_logprobs: list[list[float]] = _dumped("teacher_logprobs", "float32", optional=True)
    # A vision-language model's: per sample, its prompt's images (``rlhpc.wire.images.ImageRef``;
    # a prompt's samples share the objects); empty without images. The actor computes their
    # pixel values and grid sizes with the model's image processor per micro-batch: the encoded
    # image is 10-100x smaller than its pixels, and a group's n samples carry one. A dump keeps
    # each distinct image once (its source; its bytes only where no file has them) and each
    # sample's indices into that table (``rlhpc.metrics``), never a copy per sample.
    images: list[list[Any]] = _dumped("image_index", "int32", optional=True)
    # Rollout routing replay (algo.routing_replay): per sample, the experts the engine routed
    # each of its tokens to, [prompt + response tokens - 1, layers, top-k] (SGLang's
    # meta_info["routed_experts"]; the last token never went through the model), in the
    # smallest integer type that holds the expert ids. Empty without routing replay.
    routed_experts: list[torch.Tensor] = _dumped("routed_experts", "int32", optional=True)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def shard(self, rank: int, world_size: int) -> RolloutBatch:
        """Contiguous slice for data-parallel rank ``rank`` (sizes differ by at most one)."""
        n = len(self)
        return self.slice(rank * n // world_size, (rank + 1) * n // world_size)

    def slice(self, start: int, stop: int) -> RolloutBatch:
        return RolloutBatch(
            **{f.name: v if f.name == "group_size" else v[start:stop] for f, v in zip(fields(self), self.values())}
        )

    def values(self) -> list[Any]:
        """The fields' values, in ``dataclasses.fields`` order."""
        return [getattr(self, f.name) for f in fields(self)]

    def state_dict(self) -> dict[str, Any]:
        """Every field by its name (a checkpoint's pending rollouts, ``rlhpc.schedule``); images as
        plain values (it is loaded with ``weights_only``)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["images"] = [[ref.state() for ref in refs] for refs in self.images]
        return out

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> RolloutBatch:
        """The batch of a ``state_dict``; optional fields an older checkpoint lacks are empty."""
        from rlhpc.wire.images import ImageRef  # late: only a vision-language run's checkpoint has any

        out = cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})
        out.images = [[ImageRef.from_state(r) for r in refs] for refs in out.images]
        return out

    def to_padded(self, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids``, ``attention_mask`` [N, L] and ``loss_mask`` [N, L-1].

        ``loss_mask[i, t]`` is 1 where token t+1 of row i is a response token, i.e. where the
        logits at position t predict a response token.
        """
        seqs = [p + r for p, r in zip(self.prompt_ids, self.response_ids)]
        width = max(len(s) for s in seqs)
        # one tensor from lists, then masks by comparison: no per-row tensor ops (thousands of rows a rollout)
        input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs], dtype=torch.long)
        lengths = torch.tensor([len(s) for s in seqs])[:, None]
        starts = torch.tensor([len(p) - 1 for p in self.prompt_ids])[:, None]
        pos = torch.arange(width)[None, :]
        attention = (pos < lengths).long()
        loss_mask = ((pos[:, :-1] >= starts) & (pos[:, :-1] < lengths - 1)).float()
        if self.loss_masks:  # observation tokens of multi-turn samples are not trained on
            per_token = torch.tensor(
                [
                    [0] * (len(p) - 1) + m + [0] * (width - len(p) - len(m) + 1)
                    for p, m in zip(self.prompt_ids, self.loss_masks)
                ],
                dtype=torch.float32,
            )
            loss_mask = loss_mask * per_token[:, : width - 1]
        return input_ids, attention, loss_mask
