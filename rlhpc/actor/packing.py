"""Micro-batches by token count, and sequence packing (``actor.max_tokens_per_micro_batch``).

A minibatch's samples are put in micro-batches by a first-fit over their lengths, longest
first: each sample goes to the first micro-batch it fits in. Packed (the PyTorch actor), a
micro-batch is one row of its samples back to back, each with position ids from 0, so the
model's attention is block-diagonal (transformers builds that mask from the position ids'
restarts) and no token is padding; its budget counts the tokens. Padded (the megatron actor,
or ``actor.sequence_packing: false``), a micro-batch is rows padded to its longest sample, and
the budget counts rows x that width, the size of the tensor the forward pays for.

Everything here is a function of the lengths alone, in a fixed order: every rank (and a rerun)
forms the same micro-batches from the same data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import torch

from rlhpc.batch import RolloutBatch


def first_fit_decreasing(lengths: Sequence[int], budget: int, padded: bool = False) -> list[list[int]]:
    """Indices into ``lengths`` grouped so each group costs at most ``budget`` tokens: the sum of
    its lengths, or (``padded``) its size times its longest length. Samples are placed longest
    first (ties by index) in the first group with room; a sample over the budget alone gets a
    group of its own. Groups come in the order they were opened, each sorted by index."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    used: list[int] = []  # tokens per group
    for i in order:
        n = lengths[i]
        for g, members in enumerate(groups):
            # longest first: a group's width is its first member's length
            cost = (len(members) + 1) * lengths[members[0]] if padded else used[g] + n
            if cost <= budget:
                members.append(i)
                used[g] += n
                break
        else:
            groups.append([i])
            used.append(n)
    return [sorted(members) for members in groups]


def select(batch: RolloutBatch, indices: Sequence[int]) -> RolloutBatch:
    """The samples ``indices`` of ``batch``, in that order: every per-sample field (a list or a
    tensor with a row per sample; an empty list means unknown and stays empty)."""
    index = torch.tensor(list(indices), dtype=torch.long)
    values = {}
    for f in fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            v = v[index]
        elif isinstance(v, list) and v:
            v = [v[i] for i in indices]
        values[f.name] = v
    return RolloutBatch(**values)


def sample_lengths(batch: RolloutBatch) -> list[int]:
    """Tokens per sample: prompt and response."""
    return [len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]


def micro_batch_groups(batch: RolloutBatch, budget: int, padded: bool) -> list[RolloutBatch]:
    """``batch`` (one rank's share of a minibatch) in micro-batches of at most ``budget`` tokens."""
    return [select(batch, g) for g in first_fit_decreasing(sample_lengths(batch), budget, padded)]


def pack_rows(ids: torch.Tensor, attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``ids`` and ``attention`` [N, L] as one packed row: ids [1, T] and position
    ids [1, T] (from 0 in each sample), T the real tokens; and ``index`` [N, L-1], where
    ``packed_per_position.reshape(-1)[index]`` lays a per-position tensor of the packed row's
    first T-1 positions out as the padded one's (padding positions read position 0: they are
    masked out by the loss mask, as padding is)."""
    keep = attention.bool()
    lengths = attention.sum(-1)
    packed = ids[keep][None]
    positions = (attention.cumsum(-1) - 1)[keep][None]
    starts = lengths.cumsum(0) - lengths
    t = torch.arange(ids.shape[1] - 1, device=ids.device)[None]
    index = torch.where(t < (lengths - 1)[:, None], starts[:, None] + t, torch.zeros_like(t))
    return packed, positions, index
