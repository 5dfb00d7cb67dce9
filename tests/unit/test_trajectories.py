"""Rollouts written as code (``rlhpc.rollout.trajectories``): the merge/split rule of an agent's
calls, the checks a generate function's trajectory must pass, and whole rollouts of generate
functions through an in-process CPU engine, whose trained tokens must be the engine's answers."""

import pytest
import torch
from support.engines import in_process_send

from rlhpc.config import TinyModelConfig
from rlhpc.errors import ConfigError
from rlhpc.model import build_tiny_model
from rlhpc.preflight import load_config
from rlhpc.rollout.custom import CustomRollout
from rlhpc.rollout.generation import Generation
from rlhpc.rollout.trajectories import (
    Call,
    Generated,
    Trajectory,
    TrajectoryRefused,
    assemble,
    check_trajectory,
)


def out(tokens, logprobs=None, version=0):
    return Generated(list(tokens), logprobs or [-0.5] * len(tokens), [version] * len(tokens), "", "stop")


def test_calls_merge_while_each_prompt_extends_the_sample_and_split_where_one_does_not():
    calls = [
        Call([1, 2, 3], out([10, 11], [-0.1, -0.2], version=4)),
        Call([1, 2, 3, 10, 11, 4, 5], out([12], [-0.3], version=5)),  # extends: merged, 4 5 masked 0
        Call([1, 2, 9], out([13], [-0.4], version=5)),  # a rewritten history: a new sample
        Call([1, 2, 9, 13], out([14], [-0.6], version=5)),  # extends that one, right after its output
        Call([1, 2, 3, 10, 11, 4, 5, 12, 6], out([15], [-0.7], version=6)),  # extends sample 1, not the last: new
    ]
    first, second, third = assemble(calls)
    assert first.prompt_ids == [1, 2, 3]
    assert first.response_ids == [10, 11, 4, 5, 12]
    assert first.loss_mask == [1, 1, 0, 0, 1]
    assert first.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert first.versions == [4, 4, 4, 4, 5]  # a gap carries the version of the token before it
    assert first.turns == [0, 0, 0, 0, 1]  # as in episodes: reply t and what answers it are turn t
    assert (second.prompt_ids, second.response_ids, second.loss_mask) == ([1, 2, 9], [13, 14], [1, 1])
    assert (third.prompt_ids, third.response_ids, third.loss_mask) == ([1, 2, 3, 10, 11, 4, 5, 12, 6], [15], [1])


CALLS = [Call([1, 2], out([5, 6], [-0.1, -0.2], version=3)), Call([1, 2, 5, 6, 7], out([8], [-0.3], version=4))]


def test_a_trajectory_of_the_engines_tokens_is_taken_with_their_versions():
    seg = check_trajectory("m:f", Trajectory([1, 2], [5, 6, 7, 8], [1, 1, 0, 1], [-0.1, -0.2, 0.0, -0.3]), CALLS)
    assert seg.versions == [3, 3, 3, 4] and seg.turns == [0, 0, 0, 1]
    # a piece of an output is fine, so long as the context before it is the call's
    seg = check_trajectory("m:f", Trajectory([1, 2, 5], [6], [1], [-0.2]), CALLS)
    assert seg.loss_mask == [1] and seg.versions == [3]
    # two calls' outputs back to back (the second continues the first, cut at its length): one run of 1s
    cont = [Call([1, 2], out([5, 6], [-0.1, -0.2])), Call([1, 2, 5, 6], out([7], [-0.3], version=1))]
    seg = check_trajectory("m:f", Trajectory([1, 2], [5, 6, 7], [1, 1, 1], [-0.1, -0.2, -0.3]), cont)
    assert seg.turns == [0, 0, 1] and seg.versions == [0, 0, 1]


@pytest.mark.parametrize(
    ("traj", "problem"),
    [
        (Trajectory([1, 2], [5, 6], [1, 1], [-0.1]), "lists differ in length: 2 response_ids, 2 loss_mask, 1 logprobs"),
        (Trajectory([1, 2], [5, 6], [1, 2], [-0.1, -0.2]), "loss_mask entry other than 0 or 1"),
        # a token the engine did not generate, marked 1
        (Trajectory([1, 2], [5, 9], [1, 1], [-0.1, -0.2]), "response tokens 1..1 .* not what an engine generated"),
        (Trajectory([1, 2], [5, 6], [1, 0.5], [-0.1, -0.2]), "loss_mask entry other than 0 or 1"),
        # the engine's tokens with made-up logprobs
        (Trajectory([1, 2], [5, 6], [1, 1], [-0.1, -0.9]), "not with the logprobs it reported"),
        # the engine's tokens after a context it did not see (the second call's output after a changed observation)
        (Trajectory([1, 2], [5, 6, 9, 8], [1, 1, 0, 1], [-0.1, -0.2, 0.0, -0.3]), "response tokens 3..3"),
        (Trajectory([], [5], [1], [-0.1]), "with no prompt_ids"),
        ([1, 2, 3], "that is a list, not a Trajectory"),
    ],
)
def test_a_wrong_trajectory_is_refused_naming_the_function(traj, problem):
    with pytest.raises(TrajectoryRefused, match=f"rollout.generate_fn my_mod:my_fn returned a trajectory.*{problem}"):
        check_trajectory("my_mod:my_fn", traj, CALLS)


# ------------------------------------------------------------------ whole rollouts, in-process engine

OBSERVATION = "<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"


async def two_calls(row, engine):
    """A generate function: a reply, an observation, a second reply; reward: the second's length."""
    tok = engine.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, return_dict=False
    )
    first = await engine.generate(prompt)
    seen = tok.encode(OBSERVATION, add_special_tokens=False)
    second = await engine.generate(prompt + first.tokens + seen, {"max_new_tokens": 2})
    return Trajectory(
        prompt, first.tokens + seen + second.tokens, [1] * len(first.tokens) + [0] * len(seen) + [1] * len(second.tokens),
        first.logprobs + [0.0] * len(seen) + second.logprobs, reward=float(len(second.tokens)),
    )  # fmt: skip


def one_call_blocking(row, engine):
    """A plain ``def``: engine.generate blocks; no reward, so data.reward (here: the test's) scores it."""
    prompt = engine.tokenizer.encode(row["prompt"])
    g = engine.generate(prompt)
    return Trajectory(prompt, g.tokens, [1] * len(g.tokens), g.logprobs)


async def cheats(row, engine):
    prompt = engine.tokenizer.encode(row["prompt"])
    g = await engine.generate(prompt)
    return Trajectory(prompt, g.tokens, [1] * len(g.tokens), [lp + 0.5 for lp in g.logprobs])


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    from rlhpc.engine_server.cpu.runner import Engine

    model = build_tiny_model(tmp_path_factory.mktemp("traj") / "tiny", TinyModelConfig(tokenizer="bpe"))
    return model, Engine(str(model), "default", deterministic=True)  # seeds honoured: reruns compared


def generation(model, engine, fn, answered, reward=lambda samples: [0.0] * len(samples)):
    from transformers import AutoTokenizer

    cfg = load_config(
        None, [f"model.path={model}", "rollout.max_new_tokens=5", "rollout.n_samples_per_prompt=2", "seed=3"]
    )
    tok = AutoTokenizer.from_pretrained(model)
    reward.rlhpc_batched = True  # scores the whole list (rlhpc.rollout.scoring.batched)
    custom = CustomRollout("generate_fn", f"{__name__}:{fn.__name__}", fn)
    send = in_process_send(engine, answered)
    return Generation(tok, reward, cfg.rollout, cfg.eval, cfg.algo, cfg.seed, send, num_engines=2, custom=custom)


def test_a_generate_function_trains_the_engines_tokens(engine_model):
    model, engine = engine_model
    sent, answers = [], []

    def answered(request, outputs):
        sent.extend(request.input_ids)
        answers.extend(list(o["output_ids"]) for o in outputs)

    gen = generation(model, engine, two_calls, answered)
    rows = [{"prompt": p, "answer": "0"} for p in ("ab", "cd")]
    batch, metrics, _ = gen.rollout(0, rows)
    assert len(batch) == 4 and len(sent) == 8
    assert metrics["episode/turns"] == 2.0 and metrics["episode/samples"] == 1.0
    # cut: exactly the episodes whose second (last) call stopped at its 2-token limit
    for k in range(len(batch)):
        j = next(j for j in range(len(sent)) if sent[j] + answers[j] == batch.prompt_ids[k] + batch.response_ids[k])
        assert batch.truncated[k] == (len(answers[j]) == 2 and answers[j][-1] != gen.tokenizer.eos_token_id)
    for k in range(len(batch)):
        prompt, response, mask = batch.prompt_ids[k], batch.response_ids[k], batch.loss_masks[k]
        # this episode's two calls: its prompt (answered with the response's first tokens), and the
        # call whose prompt and answer are the whole trajectory
        i = next(i for i in range(len(sent)) if sent[i] == prompt and response[: len(answers[i])] == answers[i])
        j = next(j for j in range(len(sent)) if sent[j] + answers[j] == prompt + response and j != i)
        assert [t for t, m in zip(response, mask) if m] == answers[i] + answers[j]  # the engine's, exactly
        assert batch.rewards[k] == len(answers[j])
        assert batch.turns[k] == [0] * (len(response) - len(answers[j])) + [1] * len(answers[j])
    # per-sample seeds: a second run of the same rollout gets the same tokens
    again, _, _ = generation(model, engine, two_calls, lambda *a: None).rollout(0, rows)
    assert again.response_ids == batch.response_ids
    assert torch.equal(batch.advantages, again.advantages)


def test_a_blocking_generate_function_is_scored_by_data_reward(engine_model):
    model, engine = engine_model
    scored = []

    def reward(samples):
        scored.extend(samples)
        return [float(len(s.response_ids)) for s in samples]

    gen = generation(model, engine, one_call_blocking, lambda *a: None, reward)
    batch, _, _ = gen.rollout(0, [{"prompt": "ab", "answer": "7"}])
    assert len(scored) == 2 and all(s.label == "7" for s in scored)
    assert batch.rewards.tolist() == [float(len(r)) for r in batch.response_ids]


def test_a_generate_function_that_changes_logprobs_stops_the_rollout_naming_it(engine_model):
    model, engine = engine_model
    gen = generation(model, engine, cheats, lambda *a: None)
    with pytest.raises(TrajectoryRefused, match=f"rollout.generate_fn {__name__}:cheats returned a trajectory"):
        gen.rollout(0, [{"prompt": "ab", "answer": "0"}])


async def agent(row, base_url, api_key):
    return None


def test_the_ways_in_are_checked_at_submit():
    base = ["model.tiny.tokenizer=bpe"]
    load_config(None, [*base, f"rollout.generate_fn={__name__}:two_calls"])
    load_config(None, [*base, f"rollout.agent={__name__}:agent"])
    with pytest.raises(ConfigError, match="are both set: a run has one way in"):
        load_config(None, [*base, f"rollout.generate_fn={__name__}:two_calls", f"rollout.agent={__name__}:agent"])
    with pytest.raises(ConfigError, match="rollout.agent = .* with data.task = guess's environment"):
        load_config(None, [*base, "data.task=guess", f"rollout.agent={__name__}:agent"])
    with pytest.raises(ConfigError, match="does not take \\(row, base_url, api_key\\)"):
        load_config(None, [*base, f"rollout.agent={__name__}:two_calls"])
    # no chat template needed (issue 42 item 12): the char tokenizer has none, its agent uses /v1/completions
    load_config(None, ["model.tiny={}", f"rollout.agent={__name__}:agent"])
    with pytest.raises(ConfigError, match="rollout.generate_fn = 'nowhere:fn' cannot be imported"):
        load_config(None, [*base, "rollout.generate_fn=nowhere:fn"])


async def raises(row, base_url, api_key):
    raise KeyError("no such field")


async def makes_no_call(row, base_url, api_key):
    return 1.0


@pytest.mark.parametrize(
    ("fn", "problem"),
    [(raises, "raised KeyError: 'no such field'"), (makes_no_call, "made no call to the endpoint it was given")],
)
def test_an_agent_that_fails_stops_the_rollout_naming_it(engine_model, fn, problem):
    from rlhpc.errors import RlhpcError

    model, engine = engine_model
    gen = generation(model, engine, fn, lambda *a: None)
    gen.custom = CustomRollout("agent", f"{__name__}:{fn.__name__}", fn, gen.tokenizer.chat_template, "t")
    with pytest.raises(RlhpcError, match=f"rollout.agent {__name__}:{fn.__name__} {problem}"):
        gen.rollout(0, [{"prompt": "ab", "answer": "0"}])


def test_an_agents_several_samples_count_as_one_episode():
    """Samples.episode_of: groups, the last sample per episode, concatenation, episode rewards."""
    from rlhpc.rollout.generation import Samples

    def samples(episode_of, rewards):
        k = len(rewards)
        return Samples(
            [[1]] * k, [[10 + i] for i in range(k)], [[0.0]] * k, torch.tensor(rewards),
            {"prompt": ["p"] * k, "response": [f"r{i}" for i in range(k)], "answer": ["a"] * k},
            [0] * k, [[0]] * k, loss_masks=[[1]] * k, turns=[[0]] * k, episode={"turns": [1.0] * k},
            episode_of=episode_of,
        )  # fmt: skip

    # n = 2: group 0 is episodes 0 (two samples) and 1, group 1 episodes 2 and 3 (two samples)
    s = samples([0, 0, 1, 2, 3, 3], [1.0, 1.0, 0.0, 2.0, 4.0, 4.0])
    assert s.num_episodes() == 4
    assert s.episode_rewards(s.rewards).tolist() == [1.0, 0.0, 2.0, 4.0]
    last = s.last_per_episode()
    assert last.response_ids == [[11], [12], [13], [15]] and not last.episode_of
    assert s.group(1, 2).responses == ["r3", "r5"]
    kept = s.groups(2, [1])
    assert kept.response_ids == [[13], [14], [15]] and kept.episode_of == [0, 1, 1]
    both = Samples.concat([kept, samples([], [3.0])])
    assert both.episode_of == [0, 1, 1, 2] and both.num_episodes() == 3
