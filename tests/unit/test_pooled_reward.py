"""A CPU-heavy local grader in processes of its own (data.reward_workers): the driver's process
scores nothing itself, and a call stuck past data.reward_timeout_s is cut, not waited for."""

import os

import pytest

from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.preflight import load_config
from rlhpc.rollout.generation import task_reward
from rlhpc.rollout.scoring import Sample

SAMPLES = [Sample(f"{i}+0=", str(i) if i % 2 else "x", str(i)) for i in range(10)]


def scorer(*sets):
    return task_reward(load_config(None, ["model.tiny={}", *sets]).data)


def test_rewards_are_scored_in_the_workers():
    s = scorer("data.reward=support.graders:pid", "data.reward_workers=2")
    try:
        scores, parts = s(SAMPLES)
    finally:
        s.fn.close()
    assert scores == [float(i % 2) for i in range(10)]
    assert os.getpid() not in parts["pid"] and 1 <= len(set(parts["pid"])) <= 2


def test_a_stuck_call_is_cut_at_its_limit_and_the_rest_still_scored():
    s = scorer("data.reward=support.graders:slow_on_seven", "data.reward_workers=2", "data.reward_timeout_s=2",
               "data.reward_errors=zero")  # fmt: skip
    try:
        scores, parts = s(SAMPLES)
        assert parts["errors"] == [float(i == 7) for i in range(10)]
        assert scores == [float(i % 2 and i != 7) for i in range(10)]
        assert s(SAMPLES[:2])[0] == [0.0, 1.0]  # the pool was started again
    finally:
        s.fn.close()
    strict = scorer("data.reward=support.graders:slow_on_seven", "data.reward_workers=1", "data.reward_timeout_s=1")
    try:
        with pytest.raises(
            RlhpcError, match=r"raised TimeoutError: no answer within data.reward_timeout_s = 1 s .* '7\+0='"
        ):
            strict(SAMPLES[7:8])
    finally:
        strict.fn.close()


def test_workers_need_a_reward_of_ones_own():
    with pytest.raises(ConfigError, match="data.reward_workers = 2 runs a data.reward of your own"):
        load_config(None, ["model.tiny={}", "data.reward_workers=2"])
