"""Issue 31, items 5 and 6: DAPO's overlong filter and soft penalty, and the sampling knobs
(top_k, min_p, repetition_penalty, stop) reaching every /generate request, for training and eval.

The engine is a hand-written ``send`` answering each request with responses of chosen lengths
and finish reasons, so every number below is worked out by hand."""

from __future__ import annotations

import re

import pytest
import torch

from rlhpc.algo.grpo import overlong_penalty
from rlhpc.config import AlgoConfig, EvalConfig, EvalSetConfig, RolloutConfig
from rlhpc.data.rows import Row
from rlhpc.engine_server.cpu.requests import ModelLimits, normalize_generate
from rlhpc.errors import ConfigError
from rlhpc.preflight import load_config
from rlhpc.rollout.generation import Generation
from rlhpc.wire import protocol as P
from rlhpc.wire.protocol import EngineError
from rlhpc.wire.request import knob_params


def test_overlong_penalty_values() -> None:
    # max 8 tokens, buffer 4, at most 0.5: free up to 8 - 4 = 4 tokens, then -0.5 x (L - 4) / 4
    got = overlong_penalty(torch.tensor([0, 3, 4, 5, 6, 7, 8]), 8, 4, 0.5)
    assert got.tolist() == [0.0, 0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    # buffer 1 of 8, penalty 1: only a response of all 8 tokens pays, the whole penalty
    assert overlong_penalty(torch.tensor([6, 7, 8]), 8, 1, 1.0).tolist() == [0.0, 0.0, -1.0]
    assert overlong_penalty(torch.tensor([8]), 8, 0, 1.0).tolist() == [0.0]  # buffer 0: off


class Engine:
    """A ``send``: sample k of a request answers ``lengths[k]`` tokens; a response of
    ``max_new_tokens`` tokens finished for "length", a shorter one for "stop". Keeps every
    request's sampling params."""

    def __init__(self, lengths: list[int]):
        self.lengths, self.params = lengths, []

    def __call__(self, requests, done):
        answers, k = [], 0
        for c, r in enumerate(requests):
            out = []
            for p in r.sampling_params:
                self.params.append(p)
                n = self.lengths[k % len(self.lengths)]
                k += 1
                reason = {"type": "length", "length": n} if n == p["max_new_tokens"] else {"type": "stop", "matched": 2}
                meta = {"finish_reason": reason, "output_token_logprobs": [[-0.5, 7, None]] * n}
                out.append({"output_ids": [7] * n, "text": "x" * n, "meta_info": meta})
            answers.append(out)
            done(c, out)
        return answers


def generation(engine: Engine, rollout: RolloutConfig, algo: AlgoConfig, eval: EvalConfig | None = None):
    return Generation(None, lambda p, r, label: 1.0, rollout, eval or EvalConfig(), algo, 0, engine)


ROWS = [Row({"prompt": "p", "answer": "a"}, "p", "a").derive(prompt_ids=[1, 2])]  # no tokenizer needed


def test_overlong_filter_masks_cut_samples_and_counts_them() -> None:
    engine = Engine([8, 3, 8, 5])  # samples 0 and 2 hit max_new_tokens = 8
    rollout = RolloutConfig(n_samples_per_prompt=4, max_new_tokens=8, overlong_filter=True)
    batch, metrics, _ = generation(engine, rollout, AlgoConfig()).rollout(0, ROWS)
    assert batch.loss_masks == [[0] * 8, [1] * 3, [0] * 8, [1] * 5]
    assert batch.truncated == [True, False, True, False]
    assert metrics["overlong/filtered"] == 2.0
    # the masks reach the trainer's per-token loss mask (prompt of 2: position 1 predicts token 0)
    _, _, loss_mask = batch.to_padded(0)
    assert loss_mask.sum(-1).tolist() == [0.0, 3.0, 0.0, 5.0]
    # off (the default): no masks, every token trained on, nothing counted
    batch, metrics, _ = generation(Engine([8, 3, 8, 5]), RolloutConfig(n_samples_per_prompt=4, max_new_tokens=8),
                                   AlgoConfig()).rollout(0, ROWS)  # fmt: skip
    assert batch.loss_masks == [] and batch.truncated == [] and "overlong/filtered" not in metrics
    assert batch.to_padded(0)[2].sum(-1).tolist() == [8.0, 3.0, 8.0, 5.0]


def test_overlong_penalty_joins_the_reward_before_advantages() -> None:
    # lengths 8, 3, 7, 6 of max 8, buffer 4, penalty 1: rewards 1 - (8-4)/4, 1, 1 - 3/4, 1 - 2/4
    rollout = RolloutConfig(n_samples_per_prompt=4, max_new_tokens=8)
    algo = AlgoConfig(overlong_buffer=4, overlong_penalty=1.0, normalize_std=False)
    batch, metrics, _ = generation(Engine([8, 3, 7, 6]), rollout, algo).rollout(0, ROWS)
    assert batch.rewards.tolist() == [0.0, 1.0, 0.25, 0.5]
    # grpo without the std: reward - the group's mean, 1.75 / 4 = 0.4375
    assert batch.advantages.tolist() == [-0.4375, 0.5625, -0.1875, 0.0625]
    assert metrics["reward"] == 1.0  # the task's reward, as without the penalty
    assert metrics["overlong/penalty"] == pytest.approx(-2.25 / 4)


def test_sampling_knobs_reach_every_request_for_train_and_eval() -> None:
    rollout = RolloutConfig(n_samples_per_prompt=2, top_k=20, min_p=0.05, repetition_penalty=1.1, stop=["</a>"])
    eval = EvalConfig(top_k=5, sets={"strict": EvalSetConfig(min_p=0.3), "loose": EvalSetConfig(top_k=-1, stop=["#"])})
    engine = Engine([3])
    gen = generation(engine, rollout, AlgoConfig(), eval)
    gen.rollout(0, ROWS)
    knobs = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop": ["</a>"]}
    assert engine.params and all(p.items() >= knobs.items() for p in engine.params)
    sets = eval.resolved_sets(load_config(None, TINY).data, rollout)
    want = {"strict": {"top_k": 5, "min_p": 0.3}, "loose": {"stop": ["#"]}}
    for name, s in sets.items():
        engine.params.clear()
        gen.evaluate(0, ROWS, s, seed_tag=name)
        # eval's own knobs: the rollout's stay out, and a knob at its no-op value is not sent
        assert [{k: v for k, v in p.items() if k in P.NO_EFFECT_VALUES or k in ("top_k", "stop")}
                for p in engine.params] == [want[name]]  # fmt: skip


def test_default_requests_are_as_before_and_the_no_op_values_are_sglangs() -> None:
    engine = Engine([3])
    generation(engine, RolloutConfig(n_samples_per_prompt=1, max_new_tokens=4), AlgoConfig()).rollout(0, ROWS)
    assert set(engine.params[0]) == {"max_new_tokens", "temperature", "top_p", "sampling_seed"}
    assert knob_params(-1, 0.0, 1.0, []) == {}
    # the defaults are the values SGLang leaves the distribution alone at
    assert 0.0 in P.NO_EFFECT_VALUES["min_p"] and 1.0 in P.NO_EFFECT_VALUES["repetition_penalty"]


TINY = ["model.tiny={}"]
LIMITS = ModelLimits(vocab_size=50, context_len=64, eos_ids=frozenset({2}))


def test_the_cpu_engine_takes_the_knobs_and_refuses_what_sglang_refuses() -> None:
    sp = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "max_new_tokens": 4}
    (item,), _ = normalize_generate({"input_ids": [1, 3], "sampling_params": sp}, LIMITS, lambda t: [])
    assert (item.top_k, item.min_p, item.repetition_penalty) == (5, 0.1, 1.3)
    (item,), _ = normalize_generate(
        {"input_ids": [1, 3], "sampling_params": {"top_k": -1, "max_new_tokens": 4}}, LIMITS, lambda t: []
    )
    assert item.top_k == P.TOP_K_ALL and item.temperature == 1.0
    for bad, words in [
        ({"top_k": 0}, "top_k must be -1 (disable) or at least 1, got 0"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"repetition_penalty": 2.5}, "repetition_penalty must be in (0, 2]"),
        ({"frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported by the CPU engine"),
    ]:
        with pytest.raises(EngineError, match=re.escape(words)):
            normalize_generate(
                {"input_ids": [1, 3], "sampling_params": {**bad, "max_new_tokens": 4}}, LIMITS, lambda t: []
            )


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("rollout.top_k=0", "rollout.top_k = 0 must be -1 (off) or at least 1"),
        ("rollout.min_p=1.5", "rollout.min_p = 1.5 must be in [0, 1]"),
        ("rollout.repetition_penalty=0", "rollout.repetition_penalty = 0.0 must be in (0, 2]"),
        ("rollout.stop=['']", "rollout.stop = [''] must be a list of non-empty strings"),
        ("eval.top_k=-2", "eval.top_k = -2 must be -1 (off) or at least 1"),
        ("eval.sets={a: {min_p: 2}}", "eval.sets.a.min_p = 2.0 must be in [0, 1]"),
        ("algo.overlong_buffer=-1", "algo.overlong_buffer = -1 must be >= 0"),
        ("algo.overlong_penalty=-1", "algo.overlong_penalty = -1.0 must be >= 0"),
        ("algo.overlong_buffer=5", "algo.overlong_buffer = 5 > rollout.max_new_tokens = 4"),
    ],
)
def test_config_refusals_name_the_key(override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(match)):
        load_config(None, [*TINY, override])


def test_the_overlong_penalty_is_refused_with_episodes() -> None:
    with pytest.raises(ConfigError, match="algo.overlong_buffer with multi-turn episodes"):
        load_config(
            None,
            [
                *TINY,
                "model.tiny.tokenizer=bpe",
                "data.task=guess",
                "rollout.max_episode_tokens=64",
                "algo.overlong_buffer=2",
            ],
        )
    assert load_config(
        None,
        [
            *TINY,
            "model.tiny.tokenizer=bpe",
            "data.task=guess",
            "rollout.max_episode_tokens=64",
            "rollout.overlong_filter=true",
        ],
    ).rollout.overlong_filter
