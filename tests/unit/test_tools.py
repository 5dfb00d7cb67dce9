"""Tools in episodes (rollout.tools, issue 29): schemas from signatures, a reply's calls run at
once off the caller's thread, errors and timeouts answered as observations and counted, the
schemas in the rendered prompt, how tools and an environment share the replies, and the
config's refusals."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Literal, Optional

import pytest
from support.engines import in_process_send

from rlhpc.config import TinyModelConfig
from rlhpc.data.rows import as_row
from rlhpc.errors import ConfigError
from rlhpc.model import IM_END, build_bpe_tokenizer, build_tiny_model, load_tokenizer
from rlhpc.preflight import load_config
from rlhpc.rollout.episodes import CHAT_ENV, ChatEnv, Conversation, EpisodeConfig
from rlhpc.rollout.tools import Tools, tool_schema
from rlhpc.wire.tool_calls import ParsedCall, markup_text, parse_hermes

USER = [{"role": "user", "content": "what is 6*7?"}]
TINY = ["model.tiny.tokenizer=bpe", "rollout.max_episode_tokens=64"]


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression."""
    return str(eval(expression, {"__builtins__": {}}))  # test input only


def search(
    query: str,
    limit: int = 5,
    scale: float = 1.0,
    exact: bool = False,
    tags: list[str] | None = None,
    where: Optional[dict[str, int]] = None,  # noqa: UP045 (the Optional spelling is the one checked)
    mode: Literal["web", "news"] = "web",
) -> list:
    """Search the web.

    Returns titles."""
    return [query] * limit


def divide(a: int, b: int) -> float:
    return a / b


def untyped(x) -> str:
    return str(x)


def many(*args: str) -> str:
    return ""


def a_set(items: set[str]) -> str:
    return ""


class NotAFunction:
    pass


def test_the_schema_is_the_signature():
    assert tool_schema(calculator) == {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
    assert tool_schema(search) == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web.\n\nReturns titles.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "scale": {"type": "number"},
                    "exact": {"type": "boolean"},
                    "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
                    "where": {"anyOf": [{"type": "object", "additionalProperties": {"type": "integer"}}, {"type": "null"}]},
                    "mode": {"type": "string", "enum": ["web", "news"]},
                },
                "required": ["query"],
            },
        },
    }  # fmt: skip
    assert tool_schema(divide)["function"]["description"] == ""


@pytest.mark.parametrize(
    ("fn", "error"),
    [
        (untyped, "the tool untyped's parameter x has no type annotation"),
        (many, "the tool many's parameter args is not a named parameter"),
        (a_set, r"the tool a_set's parameter items is annotated set\[str\], which JSON cannot carry"),
    ],
)
def test_a_signature_json_cannot_carry_is_refused(fn, error):
    with pytest.raises(ConfigError, match=error):
        tool_schema(fn)


def test_two_calls_of_one_reply_run_at_once():
    barrier = threading.Barrier(2, timeout=5)
    callers = []

    def left(x: int) -> str:
        callers.append(threading.current_thread())
        barrier.wait()  # returns only once right waits too: run one after the other, this breaks
        return f"left {x}"

    def right(x: int) -> str:
        callers.append(threading.current_thread())
        barrier.wait()
        return f"right {x}"

    tools = Tools([left, right], parse_hermes, timeout_s=10)
    reply = (
        '<tool_call>{"name": "left", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "right", "arguments": {"x": 2}}</tool_call>'
    )
    calls = tools.calls(reply)
    assert calls == [ParsedCall("left", '{"x": 1}'), ParsedCall("right", '{"x": 2}')]
    messages, counts = tools.run([calls])
    assert messages == [
        [{"role": "tool", "name": "left", "content": "left 1"}, {"role": "tool", "name": "right", "content": "right 2"}]
    ]
    assert (counts[0].calls, counts[0].errors, counts[0].timeouts) == (2, 0, 0)
    assert threading.current_thread() not in callers  # off the caller's thread


def test_a_raising_a_hanging_and_an_unknown_tool_answer_errors_and_the_rest_answer():
    release = threading.Event()

    def hang(seconds: float) -> str:
        release.wait(seconds)
        return "too late"

    async def later(x: int) -> dict:
        await asyncio.sleep(0)
        return {"x": x}

    tools = Tools([divide, hang, later, calculator], parse_hermes, timeout_s=0.3)
    calls = [
        ParsedCall("divide", '{"a": 1, "b": 0}'),
        ParsedCall("hang", '{"seconds": 30}'),
        ParsedCall("rm", "{}"),
        ParsedCall("divide", '{"a": 1}'),  # the model's arguments wrong: the tool's TypeError
        ParsedCall("later", '{"x": 3}'),
    ]
    start = time.monotonic()
    try:
        messages, counts = tools.run([calls, [ParsedCall("calculator", '{"expression": "6*7"}')]])
    finally:
        release.set()
    assert time.monotonic() - start < 5  # cut at the timeout, not waited for
    assert [m["content"] for m in messages[0]] == [
        "error: ZeroDivisionError: division by zero",
        "error: timed out after 0.3 s",
        "error: no tool named 'rm'; the tools are divide, hang, later, calculator",
        "error: TypeError: divide() missing 1 required positional argument: 'b'",
        '{"x": 3}',
    ]
    assert [m["name"] for m in messages[0]] == ["divide", "hang", "rm", "divide", "later"]
    assert messages[1] == [{"role": "tool", "name": "calculator", "content": "42"}]
    assert [(n.calls, n.errors, n.timeouts) for n in counts] == [(5, 3, 1), (1, 0, 0)]


def test_the_tools_reach_the_rendered_prompt_and_their_answers_append_token_for_token():
    tok = build_bpe_tokenizer()
    schemas = [tool_schema(calculator)]
    chat = Conversation(tok, tok.chat_template, "t", USER, schemas)
    assert chat.prompt_ids == tok.apply_chat_template(
        USER, tools=schemas, add_generation_prompt=True, return_dict=False
    )
    assert json.dumps(schemas[0]) in tok.decode(chat.prompt_ids)
    reply = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    generated = tok.encode(reply, add_special_tokens=False) + [tok.convert_tokens_to_ids(IM_END)]
    answer = [{"role": "tool", "name": "calculator", "content": "42"}]
    extra = chat.extend(generated, reply, answer)
    whole = [*USER, {"role": "assistant", "content": reply}, *answer]
    want = tok.apply_chat_template(whole, tools=schemas, add_generation_prompt=True, return_dict=False)
    assert chat.prompt_ids + generated + extra == want
    assert tok.decode(extra) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


class Recording:
    """An environment that records the replies it is stepped with."""

    def reset(self, row: dict) -> list[dict]:
        self.seen: list[str] = []
        return USER

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        self.seen.append(reply)
        return [{"role": "user", "content": "again"}], 1.0, False


def step_with_engine_replies(ep, tok, replies):
    """Two episodes stepped after replies the engine generated: their tokens recorded (as a rollout
    records them), the engine's text (special tokens skipped) handed to ``step``."""
    loop = asyncio.new_event_loop()
    try:
        episodes = [ep.start(tok, as_row({"prompt": "p", "answer": "42"}), k, loop) for k in range(len(replies))]
        texts = []
        for e, reply in zip(episodes, replies):
            ids = tok.encode(reply, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
            e.add(ids, [0.0] * len(ids), [0] * len(ids), generated=True)
            texts.append(tok.decode(ids[:-1], skip_special_tokens=True))  # the engine's text
        return episodes, texts, ep.step(episodes, texts, loop)
    finally:
        loop.close()


CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def test_a_reply_with_calls_goes_to_the_tools_and_one_without_to_the_environment():
    tok = build_bpe_tokenizer()
    tools = Tools([calculator], parse_hermes, timeout_s=5)
    ep = EpisodeConfig("m:Recording", Recording, tok.chat_template, "t", None, 4, 64, tools)
    episodes, _, steps = step_with_engine_replies(ep, tok, [CALL, "42"])
    assert steps[0] == ([{"role": "tool", "name": "calculator", "content": "42"}], 0.0, False)
    assert steps[1] == ([{"role": "user", "content": "again"}], 1.0, False)
    assert episodes[0].env.seen == [] and episodes[1].env.seen == ["42"]
    assert (episodes[0].tool_calls, episodes[1].tool_calls) == (1, 0)
    # tools without an environment: the row's prompt opens the episode, a reply without calls ends it
    assert ChatEnv().reset(as_row({"prompt": "6*7?", "answer": "42"})) == [{"role": "user", "content": "6*7?"}]
    assert ChatEnv().reset(as_row({"prompt": USER, "answer": "42"}).derive(prompt_text="rendered")) == USER
    assert ChatEnv().step("42") == ([], 0.0, True)


def test_calls_are_read_where_the_tool_call_tags_are_special_tokens():
    """Issue 42 item 4: a tokenizer whose <tool_call> is a special token (the engine's text, decoded
    without special tokens, holds no tag): the call is still read, from the reply's tokens."""
    tok = build_bpe_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    tools = Tools([calculator], parse_hermes, timeout_s=5)
    ep = EpisodeConfig("m:Recording", Recording, tok.chat_template, "t", None, 4, 64, tools)
    episodes, texts, steps = step_with_engine_replies(ep, tok, [CALL])
    assert "<tool_call>" not in texts[0] and parse_hermes(texts[0]).calls == []  # what the parser was given before
    assert steps[0] == ([{"role": "tool", "name": "calculator", "content": "42"}], 0.0, False)
    assert episodes[0].env.seen == [] and episodes[0].tool_calls == 1
    # the stop token the engine ended with is not read as part of an unclosed call
    assert markup_text(tok, tok.encode(CALL[:-12]) + [tok.eos_token_id]) == CALL[:-12]


def test_submit_warns_where_the_tool_call_tags_are_special_tokens(tmp_path, caplog):
    model = build_tiny_model(tmp_path / "tiny", TinyModelConfig(tokenizer="bpe", max_position_embeddings=512))
    sets = [f"model.path={model}", f"rollout.tools=[{__name__}:calculator]", "rollout.max_episode_tokens=64"]

    def warnings() -> list[str]:  # other loggers' INFO lines (the tiny model's build) may be captured too
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    with caplog.at_level("WARNING", logger="rlhpc.rollout.tools"):
        load_config(None, sets)
        assert not warnings()  # Hermes tags that are plain text: nothing is lost
        tok = load_tokenizer(model)
        tok.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
        tok.save_pretrained(model)
        load_config(None, sets)
        load_config(None, [f"model.path={model}", f"rollout.agent={__name__}:agent"])
    warned = warnings()
    assert len(warned) == 2 and "<tool_call> and </tool_call> are special tokens" in warned[0]
    assert warned[0].startswith("rollout.tools:") and warned[1].startswith(f"rollout.agent = {__name__}:agent:")


async def agent(row, base_url, api_key):
    return None


def test_the_tools_are_checked_at_submit():
    here = __name__

    def error(overrides: list[str]) -> str:
        with pytest.raises(ConfigError) as e:
            load_config(None, [*TINY, *overrides])
        return str(e.value)

    assert "rollout.tools[0] = 'nowhere:calc' cannot be imported" in error(["rollout.tools=[nowhere:calc]"])
    assert "is not 'module:function'" in error(["rollout.tools=[calculator]"])
    assert "rollout.tools[1] = " in error([f"rollout.tools=[{here}:calculator, {here}:NotAFunction]"])
    assert "is not a function" in error([f"rollout.tools=[{here}:NotAFunction]"])
    assert "rollout.tools[0]: the tool untyped's parameter x has no type annotation" in error(
        [f"rollout.tools=[{here}:untyped]"]
    )
    assert "two tools named calculator" in error([f"rollout.tools=[{here}:calculator, {here}:calculator]"])
    assert "rollout.tool_parser = 'nowhere:parse' cannot be imported" in error(
        [f"rollout.tools=[{here}:calculator]", "rollout.tool_parser=nowhere:parse"]
    )
    assert "rollout.tool_timeout_s = 0.0 must be > 0" in error(["rollout.tool_timeout_s=0.0"])
    assert "char tokenizer has none" in error(["model.tiny.tokenizer=char", f"rollout.tools=[{here}:calculator]"])
    # tools alone, and tools with the guess task's environment
    cfg = load_config(None, [*TINY, f"rollout.tools=[{here}:calculator, {here}:search]"])
    assert cfg.rollout.tools == [f"{here}:calculator", f"{here}:search"]
    load_config(None, [*TINY, "data.task=guess", f"rollout.tools=[{here}:calculator]"])
    assert CHAT_ENV == "rlhpc.rollout.episodes:ChatEnv"


def length(text: str) -> int:
    """The length of a text."""
    return len(text)


def every_reply_calls(text: str) -> list[ParsedCall]:
    """A parser for the random tiny model, which never writes <tool_call>: every reply calls ``length``."""
    return [ParsedCall("length", json.dumps({"text": text}))]


def test_tool_episodes_through_a_cpu_engine(tmp_path):
    """Tools without an environment on an in-process CPU engine: the tools' answers are appended
    masked 0 after the engine's tokens, counted per episode, and data.reward scores the last reply."""
    from transformers import AutoTokenizer

    from rlhpc.config import TinyModelConfig
    from rlhpc.engine_server.cpu.runner import Engine
    from rlhpc.model import build_tiny_model
    from rlhpc.rollout.episodes import make_episodes
    from rlhpc.rollout.generation import Generation

    # a context that holds the tools' schema (the byte-level BPE spends many tokens on JSON)
    model = build_tiny_model(tmp_path / "tiny", TinyModelConfig(tokenizer="bpe", max_position_embeddings=512))
    cfg = load_config(
        None,
        [f"model.path={model}", f"rollout.tools=[{__name__}:length]", f"rollout.tool_parser={__name__}:every_reply_calls",
         "rollout.max_episode_tokens=200", "rollout.max_turns=2", "rollout.max_new_tokens=4",
         "rollout.n_samples_per_prompt=2"],
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(model)
    engine = Engine(str(model), "default")
    replies: list[str] = []

    send = in_process_send(engine, lambda request, outputs: replies.extend(o["text"] for o in outputs))

    episodes = make_episodes(cfg, tok)
    assert episodes is not None and episodes.score_replies and CHAT_ENV == episodes.spec

    def reward(prompt: str, response: str, answer: str) -> float:
        return float(len(response))

    gen = Generation(tok, reward, cfg.rollout, cfg.eval, cfg.algo, cfg.seed, send, episodes=episodes)
    batch, metrics, texts = gen.rollout(0, [{"prompt": "2+3=", "answer": "5"}], None)
    assert len(batch) == 2 and len(replies) == 4  # 2 episodes x 2 turns, each reply a call
    assert metrics["episode/tool_calls"] == 2.0 and metrics["episode/tool_errors"] == 0.0
    assert metrics["episode/truncated"] == 1.0  # still calling after max_turns
    for k in range(2):
        first, last = replies[k], replies[2 + k]
        observed = tok.decode([t for t, m in zip(batch.response_ids[k], batch.loss_masks[k]) if not m])
        assert f"<|im_start|>tool\n{len(first)}<|im_end|>" in observed  # the tool's answer, masked 0
        assert batch.rewards[k].item() == float(len(last))  # data.reward on the last reply


# ---------------------------------------------------------------- the tool journal


def test_the_journal_answers_a_recorded_call_without_running_it(tmp_path):
    """A generation's answers are recorded as they are made; a later generation of the same scope
    (a resume) gets the recorded answer for the same call at the same place, and runs anything
    else. A line torn by a kill is dropped: that call runs again."""
    from rlhpc.rollout.journal import Recorded, ToolJournal
    from rlhpc.rollout.tools import CallSite, current_call

    reads: list[tuple] = []

    def clock(zone: str = "utc") -> str:
        """Read a clock."""
        site = current_call()
        reads.append((site.episode, site.turn, site.index, site.episode_seed))
        return f"{zone}:{len(reads)}"

    tools = Tools([clock], parse_hermes, 10)
    journal = ToolJournal(tmp_path / "journal")
    sites = [CallSite(0, 1, 111), CallSite(3, 1, 444)]
    first = journal.scope("rollout_000002")
    calls = [[ParsedCall("clock", {}), ParsedCall("clock", '{"zone": "cet"}')], [ParsedCall("nope", {})]]
    messages, counts = tools.run(calls, sites, first)
    first.close()
    assert sorted(reads) == [(0, 1, 0, 111), (0, 1, 1, 111)]  # the tool saw where each call was made
    assert sorted(m["content"].split(":")[1] for m in messages[0][:2]) == ["1", "2"]
    assert messages[0][0]["content"].startswith("utc:") and messages[0][1]["content"].startswith("cet:")

    again = journal.scope("rollout_000002")
    replayed, _ = tools.run(calls, sites, again)
    assert replayed == messages and len(reads) == 2 and again.replayed == 2  # answered as recorded, not run
    # other arguments at the same place, or the same call in another episode: run, and recorded
    other, _ = tools.run([[ParsedCall("clock", {"zone": "pst"})]], [CallSite(0, 1, 111)], again)
    assert other[0][0]["content"] == "pst:3"
    again.close()

    path = tmp_path / "journal" / "rollout_000002.jsonl"
    path.write_text(path.read_text() + '{"k": 5, "t": 0, "j": 0, "name": "clock", "argum')  # torn by a kill
    assert len(journal.scope("rollout_000002").recorded) == 2  # the pst call replaced the first at its place

    journal.scope("rollout_000005").record([(0, 0, 0, Recorded("clock", "{}", "utc:9"))])
    journal.prune(3)  # the oldest checkpoint kept is rollout 3: rollout 2 is never generated again
    assert sorted(p.name for p in (tmp_path / "journal").iterdir()) == ["rollout_000005.jsonl"]


def test_a_replayed_timeout_and_error_keep_their_counts(tmp_path):
    from rlhpc.rollout.journal import ToolJournal
    from rlhpc.rollout.tools import CallSite

    def slow(x: int) -> str:
        """Sleeps, then fails."""
        time.sleep(0.5 if x else 0)
        raise ValueError("bad")

    tools = Tools([slow], parse_hermes, 0.2)
    journal = ToolJournal(tmp_path)
    calls, sites = [[ParsedCall("slow", {"x": 1}), ParsedCall("slow", {"x": 0})]], [CallSite(0, 0)]
    scope = journal.scope("rollout_000000")
    first, counts = tools.run(calls, sites, scope)
    assert (counts[0].timeouts, counts[0].errors) == (1, 1)
    replay = journal.scope("rollout_000000")
    again, counts = tools.run(calls, sites, replay)
    assert again == first and (counts[0].timeouts, counts[0].errors) == (1, 1) and replay.replayed == 2
