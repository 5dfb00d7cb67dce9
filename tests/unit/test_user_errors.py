"""The user's own code raising is the user's error (issue 42, item 3): an environment, a tool
parser, a sampling filter, a generate function or a reward that raises is one ``UserCodeError``
naming the function, the sample and the line it raised at. It is not transient, so the job shell
stops the job at once instead of requeueing it (``rlhpc.launch.job``; the whole job:
tests/integration/test_preemption.py). A grader elsewhere that fails stays a transient fault."""

from __future__ import annotations

import asyncio

import pytest

from rlhpc.config import AlgoConfig, DynamicSamplingConfig, EvalConfig, RolloutConfig
from rlhpc.data.rows import Row, as_row
from rlhpc.errors import UserCodeError
from rlhpc.model import build_bpe_tokenizer
from rlhpc.rollout.custom import CustomRollout
from rlhpc.rollout.episodes import EpisodeConfig
from rlhpc.rollout.generation import Generation
from rlhpc.rollout.scoring import RemoteReward, RewardError, Sample, Scorer
from rlhpc.rollout.tools import Tools


def three_tokens(requests, done):
    """A ``send``: every sample answers three tokens, stopped."""
    meta = {"finish_reason": {"type": "stop", "matched": 2}, "output_token_logprobs": [[-0.5, 7, None]] * 3}
    answers = [[{"output_ids": [7] * 3, "text": "xxx", "meta_info": meta} for _ in r.sampling_params] for r in requests]
    for c, answer in enumerate(answers):
        done(c, answer)
    return answers


VERL_ROW = Row(
    {"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2+2?"}], "extra_info": {"index": 0}},
    [{"role": "user", "content": "2+2?"}],
    "4",
)


class ReadsAMissingColumn:
    def reset(self, row):
        return [{"role": "user", "content": row["question"]}]  # verl keeps it in extra_info

    def step(self, reply):
        return [], 0.0, True


class StepRaises:
    def reset(self, row):
        return list(row.messages)

    async def step(self, reply):
        raise ZeroDivisionError("the environment's bug")


def episodes(env_cls: type, tools: Tools | None = None) -> EpisodeConfig:
    return EpisodeConfig(
        "my_envs:" + env_cls.__name__, env_cls, build_bpe_tokenizer().chat_template, "t", None, 3, 64, tools
    )


def test_an_environment_that_raises_names_itself_the_row_and_the_line():
    tok, loop = build_bpe_tokenizer(), asyncio.new_event_loop()
    try:
        with pytest.raises(UserCodeError) as e:
            episodes(ReadsAMissingColumn).start_all(tok, [(VERL_ROW, 7)], loop)
        assert e.value.problem.startswith(
            "the environment my_envs:ReadsAMissingColumn's reset raised KeyError: 'question'"
        )
        assert "the episode of the row with label '4'" in e.value.problem
        assert "test_user_errors.py:" in e.value.problem and 'row["question"]' in e.value.problem
        assert not e.value.transient and isinstance(e.value.__cause__, KeyError)
        ep = episodes(StepRaises)
        started = ep.start_all(tok, [(VERL_ROW, 7)], loop)
        with pytest.raises(
            UserCodeError, match=r"StepRaises's step raised ZeroDivisionError: the environment's bug on"
        ):
            ep.step(started, ["4"], loop)  # an async step's error too
    finally:
        loop.close()


def test_a_tool_parser_that_raises_is_its_error_and_a_tool_that_raises_answers():
    def parser(text):
        raise ValueError("cannot read")

    tok, loop = build_bpe_tokenizer(), asyncio.new_event_loop()
    try:
        ep = episodes(StepRaises, Tools([], parser, timeout_s=1))
        started = ep.start_all(tok, [(VERL_ROW, 7)], loop)
        ids = tok.encode("4", add_special_tokens=False)  # the reply's tokens, as a rollout records them
        started[0].add(ids, [0.0] * len(ids), [0] * len(ids), generated=True)
        with pytest.raises(
            UserCodeError, match=r"the tool parser .*parser raised ValueError: cannot read on the reply '4'"
        ):
            ep.step(started, ["4"], loop)
    finally:
        loop.close()


def keep(group):
    return group.rewards[3] > 0  # a group has 2 samples here


def test_a_sampling_filter_and_a_generate_function_that_raise_name_themselves():
    rollout = RolloutConfig(
        n_samples_per_prompt=2, max_new_tokens=4, dynamic_sampling=DynamicSamplingConfig(filter=f"{__name__}:keep")
    )
    gen = Generation(None, lambda p, r, a: 1.0, rollout, EvalConfig(), AlgoConfig(), 0, three_tokens)
    rows = [as_row({"prompt": "p", "answer": "a"}).derive(prompt_ids=[1, 2])]
    with pytest.raises(
        UserCodeError,
        match=r"the sampling filter test_user_errors:keep raised IndexError: .* on the group of prompt 'p'",
    ):
        gen.rollout(0, rows, lambda round, count: rows * count)

    async def generate(row, engine):
        return row["missing"]

    custom = CustomRollout("generate_fn", "mine:generate", generate)
    gen = Generation(
        None, lambda p, r, a: 1.0, RolloutConfig(), EvalConfig(), AlgoConfig(), 0, three_tokens, custom=custom
    )
    with pytest.raises(
        UserCodeError, match=r"rollout.generate_fn mine:generate raised KeyError: 'missing' on the episode of"
    ):
        gen.rollout(0, rows)


def test_a_remote_grader_that_fails_stays_a_fault_to_retry():
    sample = Sample("p", "r", "a")
    remote = RemoteReward("http://127.0.0.1:9/score", timeout_s=1, concurrency=1, retries=0)  # nothing listens
    with pytest.raises(RewardError) as e:
        Scorer(remote, "http://127.0.0.1:9/score")([sample])
    assert e.value.transient and not isinstance(e.value, UserCodeError)

    def local(prompt, response, answer):
        raise RuntimeError("mine")

    with pytest.raises(UserCodeError) as e:
        Scorer(local, "my_rewards:local")([sample])
    assert not e.value.transient


def test_a_reward_raising_in_a_worker_process_names_the_line_there():
    """data.reward_workers: the error comes back from another process; its last frame is the
    worker's (the grader's line), not multiprocessing's."""
    from rlhpc.rollout.scoring import PooledReward

    pooled = PooledReward("support.graders:raises", 1, 60.0)
    try:
        with pytest.raises(UserCodeError) as e:
            Scorer(pooled, "support.graders:raises")([Sample("p", "r", "8")])
    finally:
        pooled.close()
    assert "raised KeyError: '8'" in e.value.problem and "graders.py:" in e.value.problem
    assert "in raises `return {" in e.value.problem
