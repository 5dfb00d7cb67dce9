"""Rewards as users write them: the three forms (verl's among them), dict rewards with parts,
and graders that fail."""

import pytest

from rlhpc.data.rows import Row
from rlhpc.errors import ConfigError, RlhpcError, UserCodeError
from rlhpc.preflight import load_config
from rlhpc.rollout.scoring import Sample, Scorer, reward_form, takes_sample

SAMPLES = [
    Sample("1+2=", "3", "3", [5], row={"source": "a"}, finish_reason="stop"),
    Sample("1+2=", "4", "3", [6, 2], row={"source": "b"}, finish_reason="length"),
]


def test_both_forms_score_the_same():
    def old(prompt, response, answer):
        return float(response == answer)

    def new(sample):
        return float(sample.response == sample.label)

    assert Scorer(old, "old")(SAMPLES) == Scorer(new, "new")(SAMPLES) == ([1.0, 0.0], {})
    assert takes_sample(new, "new") and not takes_sample(old, "old")
    assert not takes_sample(lambda *args: 0.0, "varargs") and takes_sample(lambda s, scale=1: 0.0, "defaults")
    with pytest.raises(ConfigError, match=r"takes \(a, b\), which is none of the reward forms") as e:
        takes_sample(lambda a, b: 0.0, "two")
    # the fix names every documented form, verl's among them
    assert "reward(sample)" in e.value.fix and "reward(prompt, response, answer)" in e.value.fix
    assert "compute_score(data_source, solution_str, ground_truth, extra_info=None)" in e.value.fix


VERL_ROW = Row(
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Natalia sold 48 clips ... How many?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 3},
    },
    [{"role": "user", "content": "Natalia sold 48 clips ... How many?"}],
    "72",
)


def test_verls_compute_score_is_called_with_the_rows_fields():
    """verl's signature, told by its parameter names, gets the row's data_source and extra_info,
    the response and the label (before, it was called as (prompt, response, answer))."""
    seen = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 1.0 if data_source == "openai/gsm8k" and solution_str.endswith(ground_truth) else 0.0

    def per_dataset(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
        return score if solution_str.endswith(ground_truth) else format_score  # verl's gsm8k.compute_score

    def keywords(data_source, solution_str, ground_truth, **kwargs):  # verl's default_compute_score style
        seen.append(kwargs)
        return 0.5

    assert [reward_form(f, "f") for f in (compute_score, per_dataset, keywords)] == ["verl"] * 3
    rendered = "<|im_start|>user\nNatalia sold 48 clips ... How many?<|im_end|>\n<|im_start|>assistant\n"
    samples = [
        Sample(rendered, "so #### 72", "72", [1], VERL_ROW.messages, VERL_ROW),
        Sample(rendered, "71", "72", [1], None, VERL_ROW),
    ]
    assert Scorer(compute_score, "compute_score")(samples) == ([1.0, 0.0], {})
    assert seen[0] == ("openai/gsm8k", "so #### 72", "72", {"split": "train", "index": 3})
    assert Scorer(per_dataset, "per_dataset")(samples) == ([1.0, 0.0], {})
    seen.clear()
    assert Scorer(keywords, "keywords")(samples)[0] == [0.5, 0.5]
    assert seen[0] == {"extra_info": {"split": "train", "index": 3}}
    # a plain file has no data_source or extra_info column: None, as verl's default says
    plain = Sample("3+4=", "7", "7", [1], None, Row({"prompt": "3+4=", "answer": "7"}, "3+4=", "7"))
    seen.clear()
    Scorer(compute_score, "compute_score")([plain])
    assert seen == [(None, "7", "7", None)]


def test_verls_compute_score_is_accepted_at_submit(tmp_path, monkeypatch):
    (tmp_path / "verl_reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
        "def wrong(question, answer):\n    return 0.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_config(None, ["model.tiny={}", "data.reward=verl_reward:compute_score"]).data.reward
    with pytest.raises(ConfigError, match=r"verl_reward:wrong' takes \(question, answer\)") as e:
        load_config(None, ["model.tiny={}", "data.reward=verl_reward:wrong"])
    assert "compute_score(data_source, solution_str, ground_truth" in e.value.fix


def test_a_dict_reward_trains_on_score_and_logs_its_parts():
    def graded(s):
        out = {"score": float(s.response == s.label), "length": float(s.response_length)}
        return out | ({"format": 1.0} if s.row["source"] == "a" else {})

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

    with pytest.raises(
        UserCodeError, match=r"the reward flaky raised ValueError: cannot parse on .* response '4'"
    ) as e:
        Scorer(flaky, "flaky")(SAMPLES)
    assert "data.reward_errors: zero" in e.value.fix
    # the user's error, not a fault to retry: the job stops at once; it names where it raised
    assert not e.value.transient and "test_scoring.py:" in e.value.problem and "in flaky" in e.value.problem
    assert "raise ValueError" in e.value.problem and "\n" not in e.value.problem  # one line: status shows it
    with pytest.raises(UserCodeError, match="raised ValueError"):  # a value that is no number: the reward's bug
        Scorer(lambda s: "n/a", "words")(SAMPLES)
    assert Scorer(flaky, "flaky", errors="zero")(SAMPLES) == ([1.0, 0.0], {"errors": [0.0, 1.0]})


def test_a_reward_of_the_wrong_shape_is_refused_at_submit(tmp_path):
    (tmp_path / "bad_reward.py").write_text("def reward(a, b):\n    return 0.0\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ConfigError, match="takes \\(a, b\\)"):
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
