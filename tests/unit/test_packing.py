"""Micro-batches by tokens: the first-fit groups, the packed row and its way back to padded rows."""

from __future__ import annotations

import torch

from rlhpc.actor.packing import first_fit_decreasing, pack_rows, select
from rlhpc.batch import RolloutBatch


def test_first_fit_decreasing_by_tokens() -> None:
    # longest first: 1 (9), 5 (9), 3 (7), 0 (5), 2 (3), 4 (2); each to the first group with room in 12
    assert first_fit_decreasing([5, 9, 3, 7, 2, 9], 12) == [[1, 2], [4, 5], [0, 3]]


def test_first_fit_decreasing_padded_counts_rows_times_longest() -> None:
    # 1, 5 share width 9 (18 <= 20); 3 (7) opens a group, 0 joins it (2 x 7); 2 would make it
    # 3 x 7 = 21, so opens another, and 4 joins that one (2 x 3)
    assert first_fit_decreasing([5, 9, 3, 7, 2, 9], 20, padded=True) == [[1, 5], [0, 3], [2, 4]]


def test_a_sample_over_the_budget_gets_a_micro_batch_of_its_own() -> None:
    assert first_fit_decreasing([30, 4, 6], 10) == [[0], [1, 2]]
    assert first_fit_decreasing([], 10) == []


def test_pack_rows() -> None:
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    attention = (ids > 0).long()
    packed, positions, index = pack_rows(ids, attention)
    assert packed.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # packed position p predicts packed token p + 1; padded row i position t predicts ids[i, t + 1]
    assert index.tolist() == [[0, 1, 0], [3, 0, 0], [5, 6, 7]]
    next_token = packed[0, 1:]
    assert next_token[index][0, :2].tolist() == [2, 3]
    assert next_token[index][1, :1].tolist() == [5]
    assert next_token[index][2].tolist() == [7, 8, 9]


def test_select_takes_every_per_sample_field() -> None:
    batch = RolloutBatch(
        prompt_ids=[[1], [2, 2], [3, 3, 3]],
        response_ids=[[4], [5], [6]],
        rollout_logprobs=[[-0.1], [-0.2], [-0.3]],
        rewards=torch.tensor([0.0, 1.0, 2.0]),
        advantages=torch.tensor([-1.0, 0.0, 1.0]),
        group_size=3,
        weight_versions=[7, 8, 9],
    )
    part = select(batch, [2, 0])
    assert part.prompt_ids == [[3, 3, 3], [1]]
    assert part.response_ids == [[6], [4]]
    assert part.rollout_logprobs == [[-0.3], [-0.1]]
    assert part.rewards.tolist() == [2.0, 0.0] and part.advantages.tolist() == [1.0, -1.0]
    assert part.weight_versions == [9, 7]
    assert part.token_versions == [] and part.group_size == 3  # unknown stays unknown
