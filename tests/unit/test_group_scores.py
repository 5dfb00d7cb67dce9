"""Scoring that overlaps generation (issue 30): ``GroupScores`` scores each request's samples in a
thread as soon as they are added, or all at once when asked; either way the same scores."""

from __future__ import annotations

import threading

import pytest

from rlhpc.rollout.scoring import GroupScores, MixedScorer, Sample, Scorer


def group(k: int, size: int = 3) -> list[Sample]:
    return [Sample(prompt=f"{k}", response="x" * (k + j), label="") for j in range(size)]


class Recorder:
    """A group scorer (a sample's score: its response length) that records each call's groups."""

    def __init__(self):
        self.calls: list[list[int]] = []
        self.called = threading.Event()

    def __call__(self, groups):
        self.calls.append([int(g[0].prompt) for g in groups])
        self.called.set()
        return [[float(len(s.response)) for s in g] for g in groups]


def test_overlapped_groups_are_scored_before_the_rest_arrive_and_equal_scoring_after():
    rec = Recorder()
    ahead = GroupScores(rec, overlap=True)
    ahead.add(0, group(0))
    assert rec.called.wait(30), "group 0 was not scored until asked"  # while the others are still generating
    ahead.add(2, group(2))
    ahead.add(1, group(1))
    overlapped = ahead.scores(range(3))
    assert rec.calls[0] == [0] and sorted(k for call in rec.calls for k in call) == [0, 1, 2]  # each once

    after = Recorder()
    later = GroupScores(after, overlap=False)
    for k in (0, 2, 1):
        later.add(k, group(k))
    assert after.calls == []  # nothing scored while generating
    assert later.scores(range(3)) == overlapped == [0, 1, 2, 1, 2, 3, 2, 3, 4]
    assert after.calls == [[0, 1, 2]]  # one call, a batch per group


def test_a_failed_group_scoring_is_raised_by_scores():
    def boom(groups):
        raise RuntimeError("reward engines gone")

    ahead = GroupScores(boom, overlap=True)
    ahead.add(0, group(0))
    with pytest.raises(RuntimeError, match="reward engines gone"):
        ahead.scores([0])


def test_a_closed_scorer_ends_its_thread():
    ahead = GroupScores(Recorder(), overlap=True)
    thread = ahead.thread
    ahead.add(0, group(0))
    ahead.close()  # generation was cut short: returns once the group it has is scored
    assert not thread.is_alive() and ahead.scored == {0: [0.0, 1.0, 2.0]}


def test_ready_scores_are_used_in_place_of_the_components_own_call():
    rule = Scorer(lambda p, r, a: 1.0, "rule")

    def never(samples):
        raise AssertionError("scored twice")

    mixed = MixedScorer(rule, 1.0, {"rm": (2.0, never)}, groups={"rm": Recorder()})
    samples = group(0, 2)
    scores, parts = mixed(samples, {"rm": [0.5, 1.5]})
    assert scores == [2.0, 4.0] and parts["rm"] == [0.5, 1.5]
    assert set(mixed.start()) == {"rm"}
