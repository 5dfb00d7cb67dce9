"""Black-box agents (``rollout.agent``): code written against the official ``openai`` and
``anthropic`` clients, pointed at rlhpc's per-episode endpoint (real HTTP on loopback) in front of
an in-process CPU engine, over each API harnesses speak: chat completions, the Responses API,
Anthropic's Messages API and plain completions. What is trained is what the engine returned, token
for token; calls that continue the conversation merge into one sample, a call that does not starts
another; a bad request is that request's 4xx and the run goes on; the example agent
(examples/calculator_agent.py) runs rollouts."""

import asyncio
import json
import os
import socket
import threading
from pathlib import Path

import anthropic
import openai
import pytest
from support.engines import in_process_send
from support.other_user import require_second_user, run_as_other_user
from transformers import AutoTokenizer

from rlhpc.config import TinyModelConfig
from rlhpc.model import build_tiny_model
from rlhpc.preflight import load_config
from rlhpc.rollout.agent_endpoint import AgentEndpoint
from rlhpc.rollout.custom import make_custom
from rlhpc.rollout.generation import Generation
from rlhpc.rollout.trajectories import EngineCalls, EngineHandle
from rlhpc.util.http_guard import GuardLimits
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


RESPONSES_CALC = {"type": "function", "name": "calculator", "parameters": CALC["function"]["parameters"]}
CLAUDE_CALC = {
    "name": "calculator",
    "description": "Evaluate arithmetic.",
    "input_schema": CALC["function"]["parameters"],
}


async def responses_loop(row, base_url, api_key):
    """The Responses API: a call, its output items replayed with the tool's output (continues), a
    call by previous_response_id (continues), then a streamed call of a fresh conversation."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    ask = {"model": "m", "tools": [RESPONSES_CALC], "instructions": "Use the calculator."}
    items = [{"role": "user", "content": row["prompt"]}]
    first = await client.responses.create(input=items, **ask)
    calls = [i for i in first.output if i.type == "function_call"]
    assert calls and first.status in ("completed", "incomplete") and first.usage.output_tokens > 0
    items += [i.model_dump(exclude_none=True) for i in first.output]
    items += [{"type": "function_call_output", "call_id": c.call_id, "output": "3"} for c in calls]
    second = await client.responses.create(input=items, **ask)
    answers = [{"type": "function_call_output", "call_id": i.call_id, "output": "4"} for i in second.output
               if i.type == "function_call"]  # fmt: skip
    third = await client.responses.create(previous_response_id=second.id, input=answers, **ask)
    assert third.output and third.model == "m"
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        await client.responses.create(previous_response_id="resp_none", input="x", **ask)
    stream = await client.responses.create(model="m", input="sum up", stream=True)
    events = [e async for e in stream]
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    await client.close()
    return 1.0


async def claude_loop(row, base_url, api_key):
    """Anthropic's Messages API with the official client: three calls, each reply's blocks sent back
    with tool results (one conversation), then a streamed call, accumulated by the client's helper."""
    client = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.messages.create(
            model="m", max_tokens=64, system="Use the calculator.", messages=messages, tools=[CLAUDE_CALC]
        )
        uses = [b for b in reply.content if b.type == "tool_use"]
        assert uses and reply.stop_reason in ("tool_use", "max_tokens") and uses[0].input == {"expression": "1+2"}
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id, "content": "3"}
                                                     for b in uses]})  # fmt: skip
    async with client.messages.stream(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]) as s:
        final = await s.get_final_message()
    assert (
        final.role == "assistant" and final.usage.output_tokens > 0 and final.stop_reason in ("end_turn", "max_tokens")
    )
    with pytest.raises(anthropic.AuthenticationError):
        await anthropic.AsyncAnthropic(
            base_url=base_url.removesuffix("/v1"), api_key="wrong", max_retries=0
        ).messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    await client.close()
    return 1.0


async def text_loop(row, base_url, api_key):
    """Plain completions (no chat template): the prompt grows by the completion's text and an
    observation, so each call continues the last; then a prompt given as token ids."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    prompt = f"Q: {row['prompt']}\nA:"
    for _ in range(3):
        done = await client.completions.create(model="m", prompt=prompt, max_tokens=5, logprobs=0)
        choice = done.choices[0]
        assert len(choice.logprobs.token_logprobs) == done.usage.completion_tokens > 0
        prompt += choice.text + "\nObservation: ok\nA:"
    by_ids = await client.completions.create(
        model="m", prompt=[5, 6, 7], max_tokens=3, extra_body={"return_token_ids": True}
    )
    assert by_ids.choices[0].model_dump()["prompt_token_ids"] == [5, 6, 7]
    stream = await client.completions.create(model="m", prompt="x", max_tokens=3, stream=True)
    assert [c async for c in stream][-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="no chat template"):  # this run has none: chat is refused
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    await client.close()
    return 1.0


async def misbehaves(row, base_url, api_key):
    """Requests an engine would refuse, or the endpoint cannot honour: each is answered 400 (404)
    with the reason, and the episode goes on."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    claude = anthropic.AsyncAnthropic(base_url=base_url.removesuffix("/v1"), api_key=api_key, max_retries=0)
    chat = [{"role": "user", "content": row["prompt"]}]
    bad_chats = [
        ({"max_tokens": -1}, "token limit must be at least 1"),
        ({"max_completion_tokens": 0}, "token limit must be at least 1"),
        ({"messages": [{"role": "user", "content": "x " * 2000}]}, "no room for a reply"),
        ({"stop": [""]}, "stop strings must not be empty"),
        ({"stop": [str(i) for i in range(40)]}, "at most 32 stop strings"),
        ({"tools": [CALC], "tool_choice": "required"}, "tool_choice='required' is not supported"),
        ({"messages": []}, "cannot be rendered"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
        ({"extra_body": {"ignore_eos": True}}, "ignore_eos=True"),
    ]
    for kwargs, reason in bad_chats:
        with pytest.raises(openai.BadRequestError, match=reason):
            await client.chat.completions.create(**{"model": "m", "messages": chat, **kwargs})
    with pytest.raises(openai.BadRequestError, match="token limit must be at least 1"):
        await client.completions.create(model="m", prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="outside the tokenizer's range"):
        await client.completions.create(model="m", prompt=[10**6], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="token limit must be at least 1"):
        await client.responses.create(model="m", input="x", max_output_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        await client.responses.create(model="m", input="x", reasoning={"effort": "high"})
    with pytest.raises(anthropic.BadRequestError, match="max_tokens must be positive"):
        await claude.messages.create(model="m", max_tokens=-1, messages=chat)
    with pytest.raises(anthropic.BadRequestError, match="no room for a reply"):
        await claude.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "x " * 2000}])
    answered = await client.chat.completions.create(model="m", messages=chat)  # and the episode goes on
    await client.close()
    await claude.close()
    return float(answered.usage.completion_tokens > 0)


@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    from rlhpc.engine_server.cpu.runner import Engine

    model = build_tiny_model(
        tmp_path_factory.mktemp("agent") / "tiny", TinyModelConfig(tokenizer="bpe", max_position_embeddings=512)
    )
    return model, Engine(str(model), "default"), AutoTokenizer.from_pretrained(model)


def run(engine_model, agent, *sets, reward=None, rollouts=(0,), params=None):
    """Rollouts ``rollouts`` of ``agent`` on two prompts, two episodes each: (batches, (input_ids, output_ids) per call)."""
    model, engine, _ = engine_model
    cfg = load_config(
        None,
        [f"model.path={model}", f"rollout.agent={agent}", "rollout.max_new_tokens=6", "rollout.n_samples_per_prompt=2",
         *sets],
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model)
    calls = []

    def answered(request, outputs):
        calls.extend(zip(request.input_ids, (list(o["output_ids"]) for o in outputs)))
        if params is not None:  # the sampling each call was sent with
            params.extend(request.sampling_params)

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
    params = []
    batches, calls = run(
        engine_model, f"{__name__}:tool_loop", f"rollout.tool_parser={__name__}:always_calls", params=params
    )
    # tools offered: the output is decoded with special tokens kept, for the parser (as SGLang does)
    assert [p.get("skip_special_tokens") for p in params] == [False] * len(calls)
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


def test_the_responses_api_continues_by_replayed_items_and_by_previous_response_id(engine_model):
    ((batch, metrics),), calls = run(
        engine_model, f"{__name__}:responses_loop", f"rollout.tool_parser={__name__}:always_calls"
    )
    assert len(batch) == 8 and metrics["episode/samples"] == 2.0 and batch.rewards.tolist() == [1.0] * 8
    for k in range(0, 8, 2):
        # the tool loop: three calls, each extending the last token for token; the streamed call: a sample of its own
        assert len(engine_tokens(batch, k, calls)) == 3 and len(engine_tokens(batch, k + 1, calls)) == 1


def test_anthropics_messages_api_trains_the_tool_loop_as_one_sample(engine_model):
    ((batch, metrics),), calls = run(
        engine_model, f"{__name__}:claude_loop", f"rollout.tool_parser={__name__}:always_calls"
    )
    assert len(batch) == 8 and metrics["episode/samples"] == 2.0
    for k in range(0, 8, 2):
        mine = engine_tokens(batch, k, calls)
        assert len(mine) == 3 and sorted(set(batch.turns[k])) == [0, 1, 2]
        assert batch.prompt_ids[k] + batch.response_ids[k] == mine[-1][0] + mine[-1][1]
        # the system text and the tool, rendered by the run's template into the first prompt
        assert "Use the calculator." in engine_model[2].decode(batch.prompt_ids[k])


def test_completions_need_no_chat_template_and_continue_token_for_token(engine_model):
    ((batch, metrics),), calls = run(engine_model, f"{__name__}:text_loop", "data.chat_template=none")
    tok = engine_model[2]
    for k in range(len(batch)):
        engine_tokens(batch, k, calls)  # every trained token is the engine's, in order
    first = [c for c in calls if tok.decode(c[0]).startswith("Q: ")]
    assert len(first) == 12  # three text calls per episode, four episodes
    # a call whose prompt text continues the last: its ids are the last call's, the engine's tokens, then the new text's
    continued = [b for b in first if any(b[0][: len(a[0]) + len(a[1])] == a[0] + a[1] for a in first if a is not b)]
    assert len(continued) == 8 and metrics["episode/samples"] == 3.0  # the text loop one sample, two more calls


def test_a_bad_request_is_that_requests_400_and_the_run_goes_on(engine_model):
    ((batch, metrics),), calls = run(
        engine_model, f"{__name__}:misbehaves", "rollout.tool_parser=" + f"{__name__}:always_calls"
    )
    assert len(batch) == 4 and batch.rewards.tolist() == [1.0] * 4  # every episode ended as its agent meant
    assert all(len(ids) < 512 for ids, _ in calls)  # nothing over the context reached the engine


# ------------------------------------------------------------------ the endpoint's guard (issue 43 item 2)

# Another user's flood, stdlib only: connections opened again as the endpoint closes them, each one
# holding half a request's headers, a keyless request then half another, or a body that never
# comes. argv: host, port, connections, seconds. Prints what it saw.
FLOOD = r"""
import json, socket, sys, time
host, port, n, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
KINDS = [
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n",
    b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{",
]
record = {"opened": 0, "closed": 0, "statuses": {}, "connect_failed": 0}
socks, end, k = [], time.monotonic() + seconds, 0
while time.monotonic() < end:
    while len(socks) < n:
        try:
            s = socket.create_connection((host, port), timeout=5)
            s.sendall(KINDS[k % len(KINDS)])
        except OSError:
            record["connect_failed"] += 1
            break
        k += 1
        s.setblocking(False)
        socks.append(s)
        record["opened"] += 1
    alive = []
    for s in socks:
        try:
            data = s.recv(65536)
        except BlockingIOError:
            alive.append(s)
            continue
        except OSError:
            data = b""
        if data:
            status = data.split(b" ", 2)[1].decode(errors="replace")
            record["statuses"][status] = record["statuses"].get(status, 0) + 1
            alive.append(s)
        else:
            record["closed"] += 1
            s.close()
    socks = alive
    time.sleep(0.01)
print(json.dumps(record))
"""


def raw(host, port, data, wait):
    """Send ``data`` on a new connection; what comes back within ``wait`` s, and whether it was then closed."""
    with socket.create_connection((host, port), timeout=wait) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
            return got, True
        except (TimeoutError, ConnectionResetError):
            return got, False if not got else True


def test_the_endpoint_holds_few_connections_under_another_users_flood(engine_model):
    require_second_user()
    _, engine, tok = engine_model
    limits = GuardLimits(
        header_timeout_s=1.0, body_timeout_s=1.0, max_connections=32, max_header_bytes=8192, backlog=16
    )
    calls = EngineCalls(in_process_send(engine, lambda request, outputs: None), 1)
    handle = EngineHandle(calls, 0, {"max_new_tokens": 4, "temperature": 1.0}, lambda t: t, tok)
    seen: dict = {}

    async def main():
        with AgentEndpoint(tok, tok.chat_template, "t", None, 512, limits=limits) as endpoint:
            key = endpoint.open(handle)
            host, port = endpoint.base_url.removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
            client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=key, max_retries=0, timeout=30)
            await client.models.list()
            base = len(os.listdir("/proc/self/fd"))
            flood = []
            attacker = threading.Thread(
                target=lambda: flood.append(run_as_other_user(FLOOD, host, port, "400", "8", timeout=60))
            )
            attacker.start()
            peak, answered = 0, 0
            while attacker.is_alive():
                peak = max(peak, len(os.listdir("/proc/self/fd")) - base)
                reply = await client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                answered += reply.usage.completion_tokens > 0
                await asyncio.sleep(0.05)
            attacker.join()
            seen.update(peak=peak, answered=answered, flood=json.loads(flood[0].stdout))
            # each request's deadlines and sizes, without a flood: half headers, a trickled body, headers too big
            seen["half"] = await asyncio.to_thread(raw, host, int(port), b"GET /v1/models HTTP/1.1\r\nHost: x\r\n", 5)
            body = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{"
            seen["body"] = await asyncio.to_thread(raw, host, int(port), body, 5)
            big = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20000 + b"\r\n\r\n"
            seen["big"] = await asyncio.to_thread(raw, host, int(port), big, 5)
            keyless = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
            seen["keyless"] = await asyncio.to_thread(raw, host, int(port), keyless, 5)
            await client.close()

    calls.run(main)
    flood = seen["flood"]
    assert flood["opened"] >= 400 and flood["statuses"].get("401", 0) > 0  # keyless requests: 401, then closed
    assert flood["closed"] > 2 * limits.max_connections  # the endpoint closed them as they came (none were before)
    assert (
        seen["peak"] <= limits.max_connections + 8
    )  # and held at most its cap: the driver's descriptors stayed bounded
    assert seen["answered"] >= 3  # the agent was answered all along
    assert seen["half"] == (b"", True) and seen["body"][1] and not seen["body"][0].startswith(b"HTTP/1.1 200")
    assert seen["big"][0].startswith(b"HTTP/1.1 431") and seen["big"][1]
    assert seen["keyless"][0].startswith(b"HTTP/1.1 401") and seen["keyless"][1]
