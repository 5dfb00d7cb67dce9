"""The CPU engine's OpenAI-compatible routes, driven by the official ``openai`` client over loopback,
and stop strings on the native /generate (issue 29). A tiny BPE model with a ChatML template (as
Qwen ships) serves; field names are pinned against SGLang's in tests/unit/test_sglang_protocol.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest
import urllib3
from support.engines import KEYS, engine_client, start_server, stop_server
from transformers import AutoTokenizer

from rlhpc.errors import RlhpcError
from rlhpc.model import TinyModelConfig, build_tiny_model
from rlhpc.wire import openai_protocol as OP
from rlhpc.wire.client import EngineClient


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(
        build_tiny_model(
            tmp_path_factory.mktemp("bpe") / "tiny", TinyModelConfig(tokenizer="bpe", max_position_embeddings=512)
        )
    )  # room for a tools system turn


@pytest.fixture(scope="module")
def server(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # deterministic, as in a `deterministic: true` run: the seeded tests need their seeds honoured
    proc, url, _ = start_server(
        model_path, tmp_path_factory.mktemp("srv"), "engine", ["--enable-deterministic-inference"]
    )
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def native(server: str) -> EngineClient:
    return engine_client(server, timeout_s=60)


@pytest.fixture(scope="module")
def oai(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEYS[server], max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(model_path: str):
    return AutoTokenizer.from_pretrained(model_path)


def _greedy(native: EngineClient, ids: list[int], n: int = 24, **params) -> dict:
    sp = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **params}
    return native.generate(input_ids=ids, sampling_params=sp)


def _stop_string(tok, ids: list[int]) -> tuple[str, int]:
    """A stop string the greedy output will hit: a word-like token's text from its middle, and
    where it first appears (the index of the token completing it)."""
    for k in range(3, len(ids)):
        piece = tok.decode([ids[k]]).strip()
        if len(piece) >= 2 and piece.isprintable():
            first = next(j for j in range(len(ids)) if piece in tok.decode(ids[: j + 1]))
            return piece, first
    pytest.fail(f"no printable token in {tok.decode(ids)!r}")


# ------------------------------------------------------------------ native /generate: stop strings


def test_a_stop_string_ends_generation_and_keeps_the_sampled_tokens(native: EngineClient, tok) -> None:
    prompt = tok.encode("3+4=")
    full = _greedy(native, prompt)["output_ids"]
    stop, first = _stop_string(tok, full)
    out = _greedy(native, prompt, stop=[stop])
    assert out["output_ids"] == full[: first + 1]  # exactly the tokens sampled, the last one completing the stop
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    decoded = tok.decode(out["output_ids"], skip_special_tokens=True)
    assert out["text"] == decoded[: decoded.find(stop)]  # trimmed before the stop string, as SGLang
    kept = _greedy(native, prompt, stop=stop, no_stop_trim=True)
    assert kept["output_ids"] == out["output_ids"]
    assert kept["text"] == decoded[: decoded.find(stop) + len(stop)]
    assert kept["text"].endswith(stop)


@pytest.mark.parametrize(
    ("stop", "message"),
    [("", "must not be empty"), ([1], "list of strings"), (["x"] * 33, "at most 32 stop strings are allowed")],
)
def test_bad_stop_strings_are_refused(native: EngineClient, stop, message: str) -> None:
    with pytest.raises(RlhpcError, match=message):
        _greedy(native, [1, 2], stop=stop)


def _post(server: str, route: str, body: dict) -> urllib3.BaseHTTPResponse:
    headers = {"Authorization": f"Bearer {KEYS[server]}", "Content-Type": "application/json"}
    return urllib3.PoolManager().request("POST", f"{server}{route}", body=json.dumps(body), headers=headers)


def test_top_logprobs_on_generate(server: str) -> None:
    sp = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    answer = _post(
        server,
        "/generate",
        {"input_ids": [5, 6, 7], "sampling_params": sp, "return_logprob": True, "top_logprobs_num": 3},
    )
    assert answer.status == 200, answer.data
    out = answer.json()
    tops, chosen = out["meta_info"]["output_top_logprobs"], out["meta_info"]["output_token_logprobs"]
    assert len(tops) == 4 and all(len(step) == 3 for step in tops)
    for step, (lp, token, _) in zip(tops, chosen):
        assert step[0][1] == token and step[0][0] == pytest.approx(lp)  # greedy: the top token was sampled
        assert step[0][0] >= step[1][0] >= step[2][0]


# ------------------------------------------------------------------ the openai client


def test_models_list(oai: openai.OpenAI, model_path: str) -> None:
    models = oai.models.list().data
    assert [m.id for m in models] == [model_path] and models[0].owned_by == "sglang"


def test_completion_from_text_and_token_ids(oai: openai.OpenAI, native: EngineClient, tok) -> None:
    c = oai.completions.create(model="m", prompt="3+4=", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    expect = _greedy(native, tok.encode("3+4="), 6)
    assert c.object == "text_completion" and len(c.choices) == 1
    assert c.choices[0].text == expect["text"] and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == len(tok.encode("3+4=")) and c.usage.completion_tokens == 6
    ids = oai.completions.create(
        model="m",
        prompt=tok.encode("3+4="),
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = ids.choices[0].model_dump()
    assert choice["token_ids"] == expect["output_ids"] and choice["prompt_token_ids"] == tok.encode("3+4=")
    assert ids.model_dump()["metadata"]["weight_version"] == "default"


def test_completion_n_seed_logprobs_and_stop(oai: openai.OpenAI, native: EngineClient, tok) -> None:
    c = oai.completions.create(
        model="m", prompt="ab", n=3, max_tokens=5, seed=11, logprobs=2, extra_body={"return_token_ids": True}
    )
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    again = oai.completions.create(
        model="m", prompt="ab", n=3, max_tokens=5, seed=11, logprobs=2, extra_body={"return_token_ids": True}
    )
    tokens = [ch.model_dump()["token_ids"] for ch in c.choices]
    assert tokens == [ch.model_dump()["token_ids"] for ch in again.choices]  # seeded: reproducible
    assert len({tuple(t) for t in tokens}) > 1  # choice k samples with seed + k, not n copies
    for ch, ids in zip(c.choices, tokens):
        assert len(ch.logprobs.token_logprobs) == len(ids) and all(lp <= 0 for lp in ch.logprobs.token_logprobs)
        assert all(len(top) <= 2 for top in ch.logprobs.top_logprobs) and len(ch.logprobs.top_logprobs) == len(ids)
    full = _greedy(native, tok.encode("3+4="))["output_ids"]
    stop, first = _stop_string(tok, full)
    s = oai.completions.create(
        model="m",
        prompt="3+4=",
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    choice = s.choices[0].model_dump()
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == stop
    assert choice["token_ids"] == full[: first + 1] and stop not in choice["text"]


def test_chat_prompt_is_the_templates_own_tokens(oai: openai.OpenAI, tok) -> None:
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "3+4="},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "text", "text": "5+5="}]},
    ]
    r = oai.chat.completions.create(
        model="m", messages=messages, max_completion_tokens=5, n=2, seed=3, extra_body={"return_token_ids": True}
    )
    rendered = [*messages[:3], {"role": "user", "content": "and 5+5="}]  # text parts joined as SGLang joins them
    expect = tok.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.object == "chat.completion" and len(r.choices) == 2
    for ch in r.choices:
        extra = ch.model_dump()
        assert extra["prompt_token_ids"] == list(expect)
        assert ch.message.role == "assistant" and ch.finish_reason in ("stop", "length")
        assert 1 <= len(extra["response_token_ids"]) <= 5
        if ch.finish_reason == "stop":  # the template's end of turn, a stop token: cut from the text only
            assert extra["matched_stop"] == extra["response_token_ids"][-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert r.usage.prompt_tokens == len(expect)


def test_chat_logprobs_stop_and_meta_info(oai: openai.OpenAI, native: EngineClient, tok) -> None:
    messages = [{"role": "user", "content": "3+4="}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    full = _greedy(native, list(prompt))["output_ids"]
    stop, first = _stop_string(tok, full)
    r = oai.chat.completions.create(
        model="m",
        messages=messages,
        temperature=0,
        max_tokens=24,
        stop=stop,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True, "return_meta_info": True},
    )
    ch = r.choices[0]
    extra = ch.model_dump()
    assert ch.finish_reason == "stop" and extra["matched_stop"] == stop
    assert extra["response_token_ids"] == full[: first + 1] and stop not in ch.message.content
    assert len(ch.logprobs.content) == first + 1
    for entry, token in zip(ch.logprobs.content, extra["response_token_ids"]):
        assert entry.token == tok.decode([token]) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy
    assert extra["meta_info"]["weight_versions"] == [{"version": "default", "start": 0, "end": first + 1}]


def test_chat_with_tools_passes_them_to_the_template_and_stays_plain_without_markup(oai: openai.OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    r = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], tools=tools, max_tokens=4, temperature=0
    )
    # the template lists the tools in a system turn of its own: the prompt grew by their schema
    plain = oai.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 10
    # the tiny random model writes no <tool_call> markup: the output is content (parsing: unit tests)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_with_tools_offered_the_output_keeps_special_tokens_as_sglangs_does(model_path: str) -> None:
    """Issue 42 item 4: where <tool_call> is a special token, an output decoded without special
    tokens holds no call; SGLang decodes with them whenever tools are offered (pinned against its
    serving_chat in tests/unit/test_sglang_protocol.py), and so does the CPU engine."""
    from rlhpc.engine_server.cpu.openai_routes import _chat
    from rlhpc.engine_server.cpu.runner import Engine

    engine = Engine(model_path, "default")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": "hi"}]
    offered, _ = _chat(engine, OP.ChatCompletionRequest(messages=chat, tools=tools, max_tokens=2))
    assert [it.skip_special_tokens for it in offered] == [False]
    for req in (
        OP.ChatCompletionRequest(messages=chat),
        OP.ChatCompletionRequest(messages=chat, tools=tools, tool_choice="none"),
    ):
        assert [it.skip_special_tokens for it in _chat(engine, req)[0]] == [True]


def test_streaming_chunks_end_with_done(oai: openai.OpenAI, server: str) -> None:
    whole = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, n=2
    )
    stream = oai.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [texts[i] for i in (0, 1)] == [c.message.content for c in whole.choices]
    assert finish == {i: c.finish_reason for i, c in enumerate(whole.choices)}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    raw = _post(server, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "stream": True})
    events = [e for e in raw.data.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


def test_refusals(oai: openai.OpenAI, server: str) -> None:
    nokey = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nokey.models.list()
    with pytest.raises(openai.AuthenticationError):
        nokey.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="frequency_penalty=0.5"):
        oai.completions.create(model="m", prompt="ab", frequency_penalty=0.5)
    with pytest.raises(openai.BadRequestError, match="exceeds the model's maximum context length"):
        oai.completions.create(model="m", prompt="ab", max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="must be valid JSON"):
        bad_call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
        oai.chat.completions.create(
            model="m", messages=[{"role": "assistant", "content": "", "tool_calls": [bad_call]}], max_tokens=1
        )
    assert oai.completions.create(model="m", prompt="ab", max_tokens=1, frequency_penalty=0).choices


def test_responses_write_only_the_pinned_sglang_fields(server: str) -> None:
    """The keys on the wire are the sets tests/unit/test_sglang_protocol.py checks against SGLang."""
    c = _post(server, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "logprobs": 1, "return_token_ids": True})
    body = c.json()
    assert set(body) == OP.COMPLETION_RESPONSE_FIELDS and set(body["usage"]) == OP.USAGE_FIELDS
    assert set(body["choices"][0]) == OP.COMPLETION_CHOICE_FIELDS
    assert set(body["choices"][0]["logprobs"]) == OP.COMPLETION_LOGPROBS_FIELDS
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 1}
    body = _post(server, "/v1/chat/completions", {**chat, "return_token_ids": True, "return_meta_info": True}).json()
    assert set(body) == OP.CHAT_RESPONSE_FIELDS and set(body["choices"][0]) == OP.CHAT_CHOICE_FIELDS
    assert set(body["choices"][0]["message"]) <= OP.CHAT_MESSAGE_FIELDS
    assert set(body["choices"][0]["logprobs"]["content"][0]) == OP.CHAT_TOKEN_LOGPROB_FIELDS
    models = urllib3.PoolManager().request(
        "GET", f"{server}/v1/models", headers={"Authorization": f"Bearer {KEYS[server]}"}
    )
    assert set(models.json()["data"][0]) == OP.MODEL_CARD_FIELDS


def peak_rss_mb(server: str) -> float:
    """The engine server's peak resident memory so far (VmHWM), in MB."""
    port = int(server.rsplit(":", 1)[1])
    pid = next(c.pid for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port)
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def test_a_key_holders_request_is_bounded_before_any_work(
    oai: openai.OpenAI, server: str, native: EngineClient
) -> None:
    # Issue 43, item 8: a template in chat_template_kwargs ({{ 'x' * 300000000 }}) drove an engine
    # to 22.8 GB; n = 2,000,000 built its rows before the cap was checked.
    before = peak_rss_mb(server)
    bomb = {"chat_template": "{{ 'x' * 20000000 }}"}
    with pytest.raises(openai.BadRequestError, match="Request-supplied chat_template is not allowed"):
        oai.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=1,
            extra_body={"chat_template_kwargs": bomb},
        )
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs may not set tokenize"):
        oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
            extra_body={"chat_template_kwargs": {"tokenize": False}},
        )  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="a batch of 400000 rows"):
        oai.completions.create(model="m", prompt="ab", max_tokens=1, n=400_000)
    assert peak_rss_mb(server) - before < 64, (before, peak_rss_mb(server))  # nothing was built
    assert native.get_weight_version() == "default"
