"""Black-box agents (``rollout.agent``): code written against the official ``openai`` client,
pointed at rlhpc's per-episode endpoint (real HTTP on loopback) in front of an in-process CPU
engine. What is trained is what the engine returned, token for token; calls that continue the
conversation merge into one sample, a call that does not starts another; the example agent
(examples/calculator_agent.py) runs rollouts."""

from pathlib import Path

import openai
import pytest
from support.engines import in_process_send
from transformers import AutoTokenizer

from rlhpc.config import TinyModelConfig
from rlhpc.model import build_tiny_model
from rlhpc.preflight import load_config
from rlhpc.rollout.custom import make_custom
from rlhpc.rollout.generation import Generation
from rlhpc.wire.tool_calls import ParsedCall

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}


def always_calls(text):
    """A tool parser that reads every reply as a call (the tiny random model writes no markup)."""
    return [ParsedCall("calculator", '{"expression": "1+2"}')]


async def tool_loop(row, base_url, api_key):
    """Three calls, each reply sent back with a tool's answer: one conversation, one sample."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(model="m", messages=messages, tools=[CALC])
        message = reply.choices[0].message
        assert message.tool_calls and reply.choices[0].finish_reason in ("tool_calls", "length")
        messages.append(message.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "3"} for c in message.tool_calls]
    await client.close()
    return 1.0


async def two_conversations(row, base_url, api_key):
    """A call, then a call with a fresh conversation (a summarizer's, say): two samples."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    first = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": row["prompt"]}], logprobs=True
    )
    text = first.choices[0].message.content
    assert len(first.choices[0].logprobs.content) == first.usage.completion_tokens > 0
    # streamed: the same answer, as chunks
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"sum up: {text}"}], stream=True
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):  # refused, not silently dropped
        await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], extra_body={"chat_template_kwargs": {"a": 1}}
        )
    with pytest.raises(openai.AuthenticationError):  # another episode's key, or none, is refused
        await openai.AsyncOpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in (await client.models.list()).data] == ["rlhpc-policy"]
    await client.close()
    return float(sum(map(ord, text)) % 7)  # differs between episodes


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    from rlhpc.engine_server.cpu.runner import Engine

    model = build_tiny_model(
        tmp_path_factory.mktemp("agent") / "tiny", TinyModelConfig(tokenizer="bpe", max_position_embeddings=512)
    )
    return model, Engine(str(model), "default")


def run(engine_model, agent, *sets, reward=None, rollouts=(0,)):
    """Rollouts ``rollouts`` of ``agent`` on two prompts, two episodes each: (batches, (input_ids, output_ids) per call)."""
    model, engine = engine_model
    cfg = load_config(
        None,
        [f"model.path={model}", f"rollout.agent={agent}", "rollout.max_new_tokens=6", "rollout.n_samples_per_prompt=2",
         *sets],
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model)
    calls = []

    def answered(request, outputs):
        calls.extend(zip(request.input_ids, (list(o["output_ids"]) for o in outputs)))

    send = in_process_send(engine, answered)
    gen = Generation(tok, reward or (lambda p, r, a: 0.5), cfg.rollout, cfg.eval, cfg.algo, cfg.seed, send,
                     num_engines=2, custom=make_custom(cfg, tok))  # fmt: skip
    rows = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "5+1=", "answer": "6"}]
    return [gen.rollout(r, rows)[:2] for r in rollouts], calls


def engine_tokens(batch, k, calls):
    """Sample k's calls (each prompt a prefix of the sample), checked: the tokens masked 1 are their outputs in order."""
    seq = batch.prompt_ids[k] + batch.response_ids[k]
    mine = [
        (ids, out)
        for ids, out in calls
        if seq[: len(ids) + len(out)] == ids + out and len(ids) >= len(batch.prompt_ids[k])
    ]
    generated = [t for t, m in zip(batch.response_ids[k], batch.loss_masks[k]) if m]
    assert generated == [t for _, out in mine for t in out]
    return mine


def test_the_example_agent_trains_what_the_engine_returned(engine_model, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))  # examples/, as PYTHONPATH=$PWD does
    scored = []

    def reward(sample):
        scored.append(sample)
        return 1.0 if sample.label in sample.response else 0.0

    batches, calls = run(engine_model, "examples.calculator_agent:solve", reward=reward, rollouts=(0, 1))
    for batch, metrics in batches:
        assert metrics["episode/samples"] == 1.0
        assert len(batch) == 4  # the model calls no tool: one call per episode, one sample each
        for k in range(len(batch)):
            (call,) = engine_tokens(batch, k, calls)
            assert batch.loss_masks[k] == [1] * len(call[1])
    # data.reward scored the final transcript: the tools were offered, the last message is the reply
    assert len(scored) == 8
    assert all(s.messages[-1]["role"] == "assistant" and s.response == s.messages[-1]["content"] for s in scored)
    assert all("calculator" in s.prompt for s in scored)  # the template listed the tool in the prompt


def test_tool_calls_sent_back_merge_into_one_sample(engine_model):
    batches, calls = run(engine_model, f"{__name__}:tool_loop", f"rollout.tool_parser={__name__}:always_calls")
    batch, metrics = batches[0]
    assert len(batch) == 4 and batch.rewards.tolist() == [1.0] * 4 and metrics["episode/samples"] == 1.0
    for k in range(len(batch)):
        mine = engine_tokens(batch, k, calls)
        assert len(mine) == 3 and sorted(set(batch.turns[k])) == [0, 1, 2]
        # between the calls: the template's tokens for the tool's answer, never the reply re-tokenized
        seq = batch.prompt_ids[k] + batch.response_ids[k]
        for (ids, out), (nxt, _) in zip(mine, mine[1:]):
            assert nxt[: len(ids) + len(out)] == ids + out
        assert seq == mine[-1][0] + mine[-1][1]


def test_a_call_that_does_not_continue_starts_a_new_sample(engine_model):
    ((batch, metrics),), calls = run(engine_model, f"{__name__}:two_conversations")
    assert len(batch) == 8 and metrics["episode/samples"] == 2.0  # two samples per episode, each the engine's tokens
    for k in range(len(batch)):
        assert len(engine_tokens(batch, k, calls)) == 1
    # an episode's two samples share its reward and advantage
    for k in range(0, 8, 2):
        assert batch.rewards[k] == batch.rewards[k + 1] and batch.advantages[k] == batch.advantages[k + 1]
    assert len(set(batch.advantages.tolist())) > 1  # the episodes' rewards differ: the check above can fail
