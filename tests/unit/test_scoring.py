"""Rewards as users write them: either form, dict rewards with parts, and graders that fail."""

import pytest

from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.preflight import load_config
from rlhpc.rollout.scoring import Sample, Scorer, takes_sample

SAMPLES = [
    Sample("1+2=", "3", "3", [5], metadata={"source": "a"}, finish_reason="stop"),
    Sample("1+2=", "4", "3", [6, 2], metadata={"source": "b"}, finish_reason="length"),
]


def test_both_forms_score_the_same():
    def old(prompt, response, answer):
        return float(response == answer)

    def new(sample):
        return float(sample.response == sample.label)

    assert Scorer(old, "old")(SAMPLES) == Scorer(new, "new")(SAMPLES) == ([1.0, 0.0], {})
    assert takes_sample(new, "new") and not takes_sample(old, "old")
    assert not takes_sample(lambda *args: 0.0, "varargs") and takes_sample(lambda s, scale=1: 0.0, "defaults")
    with pytest.raises(ConfigError, match="takes 2 arguments"):
        takes_sample(lambda a, b: 0.0, "two")


def test_a_dict_reward_trains_on_score_and_logs_its_parts():
    def graded(s):
        out = {"score": float(s.response == s.label), "length": float(s.response_length)}
        return out | ({"format": 1.0} if s.metadata["source"] == "a" else {})

    scores, parts = Scorer(graded, "graded")(SAMPLES)
    assert scores == [1.0, 0.0] and parts["length"] == [1.0, 2.0]
    assert parts["format"][0] == 1.0 and parts["format"][1] != parts["format"][1]  # NaN: not given
    with pytest.raises(RlhpcError, match="returned a dict without 'score'"):
        Scorer(lambda s: {"format": 1.0}, "no_score", errors="zero")(SAMPLES)  # a bug, not a failed grade


def test_a_grader_that_raises_stops_the_run_or_scores_zero():
    def flaky(s):
        if s.finish_reason == "length":
            raise ValueError("cannot parse")
        return 1.0

    with pytest.raises(RlhpcError, match=r"the reward flaky raised ValueError: cannot parse .* response '4'") as e:
        Scorer(flaky, "flaky")(SAMPLES)
    assert "data.reward_errors: zero" in e.value.fix
    assert Scorer(flaky, "flaky", errors="zero")(SAMPLES) == ([1.0, 0.0], {"errors": [0.0, 1.0]})


def test_a_reward_of_the_wrong_shape_is_refused_at_submit(tmp_path):
    (tmp_path / "bad_reward.py").write_text("def reward(a, b):\n    return 0.0\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="takes 2 arguments"):
            load_config(None, ["model.tiny={}", "data.reward=bad_reward:reward"])
    finally:
        sys.path.remove(str(tmp_path))
    assert load_config(None, ["model.tiny={}", "data.reward_errors=zero"]).data.reward_errors == "zero"


def test_batched_and_async_rewards_score_the_whole_list():
    import asyncio

    from rlhpc.rewards import batched

    calls = []

    @batched
    def whole(samples):
        calls.append(len(samples))
        return [float(s.response == s.label) for s in samples]

    async def remote_ish(samples):  # e.g. a judge served elsewhere, asked for all at once
        async def one(s):
            await asyncio.sleep(0.01)
            return {"score": float(s.response == s.label), "len": float(s.response_length)}

        return await asyncio.gather(*(one(s) for s in samples))

    assert Scorer(whole, "whole")(SAMPLES) == ([1.0, 0.0], {}) and calls == [2]
    assert Scorer(remote_ish, "remote_ish")(SAMPLES) == ([1.0, 0.0], {"len": [1.0, 2.0]})

    def boom(samples):
        raise RuntimeError("judge down")

    assert Scorer(batched(boom), "boom", errors="zero")(SAMPLES) == ([0.0, 0.0], {"errors": [1.0, 1.0]})
    with pytest.raises(RlhpcError, match="returned 1 values for 2 samples"):
        Scorer(batched(lambda samples: [1.0]), "short")(SAMPLES)
