"""rlhpc's two ways of rendering chat messages, against ``transformers``' ``apply_chat_template``,
with templates of the shapes the major families ship (tests/support/chat_templates.py: Qwen2.5
with tools, Qwen3 with reasoning, Llama 3 and Gemma, which write their own BOS): the prompts of
a data file (rlhpc.data.prompts, once at load) and the turns of a multi-turn episode
(rlhpc.rollout.episodes, the observation's tokens appended after the engine's own). Where a
template rewrites an earlier turn, an episode is refused naming it, never trained re-tokenized."""

import functools

import pytest
from support.chat_templates import FAMILIES, tokenizer

from rlhpc.data.prompts import encode_rows, prepare_prompts, with_system
from rlhpc.preflight import load_config
from rlhpc.rollout.episodes import Conversation, TemplateBreaksPrefix, extend_all

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
FIRST = [{"role": "user", "content": "guess a number from 1 to 8"}]


@functools.cache
def family_and_tokenizer(name: str):
    return FAMILIES[name], tokenizer(FAMILIES[name])


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return family_and_tokenizer(request.param)


def template_ids(tok, messages, generation_prompt=True, tools=None) -> list[int]:
    out = tok.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tools=tools, tokenize=True, return_dict=False
    )
    return list(out)


def test_data_prompts_are_sent_as_the_template_renders_them(family):
    """A chat row's ids are apply_chat_template's (one BOS where the template writes it, though
    the tokenizer adds one to what it encodes), data.system_prompt first where the chat has none,
    an earlier reasoning turn as the template renders it; a text row is the tokenizer's encoding."""
    f, tok = family
    history = [*FIRST, {"role": "assistant", "content": "<think>\nsmall steps\n</think>\n\n3 then"},
               {"role": "user", "content": "higher"}]  # fmt: skip
    rows = [{"prompt": FIRST, "answer": "4"}, {"prompt": history, "answer": "4"}, {"prompt": "3 then", "answer": "4"}]
    data = load_config(None, ["model.tiny={}", "data.system_prompt=You are brief."]).data
    ready = prepare_prompts(tok, data, None)("train", [dict(r) for r in rows])
    sys = "You are brief."
    want = [template_ids(tok, with_system(r["prompt"], sys)) for r in rows[:2]] + [tok("3 then").input_ids]
    assert encode_rows(tok, ready) == want
    for row, chat in zip(ready, rows[:2]):
        text = tok.apply_chat_template(with_system(chat["prompt"], sys), add_generation_prompt=True, tokenize=False)
        assert row.prompt_text == text
    if f.bos is not None:
        assert [ids.count(tok.bos_token_id) for ids in want] == [1, 1, 1]
    if f.name == "qwen3":  # the earlier turn's reasoning is not in what the model is sent
        assert "small steps" not in ready[1].prompt_text and "3 then" in ready[1].prompt_text


# Per family, turns of (reply, the engine stopped at its stop token, observation) that the
# template renders back unchanged; with tools for the Qwen shapes (their tool answers are no
# user turn, so Qwen3 keeps the reasoning of the turns after the last user message).
TURNS = {
    "qwen2.5": [
        ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', True,
         [{"role": "tool", "content": "3"}]),
        ("two calls", True, [{"role": "tool", "content": "3"}, {"role": "tool", "content": " 4"}]),
        ("3 then", False, [{"role": "user", "content": "higher"}]),
    ],
    "qwen3": [
        ('<think>\nadd first\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', True,
         [{"role": "tool", "content": "3"}]),
        ("<think>\nsmall steps\n</think>\n\n4é", True, [{"role": "tool", "content": " 4"}]),
    ],
    "llama3": [
        ("3 then", True, [{"role": "user", "content": "higher"}]),
        ("5", False, [{"role": "user", "content": "lower"}]),
        ("4é", True, [{"role": "user", "content": "yes, that is it"}]),
    ],
    "gemma": [
        ("3 then", True, [{"role": "user", "content": "higher"}]),
        ("5", False, [{"role": "user", "content": "lower"}]),
        ("4é", True, [{"role": "user", "content": "yes"}]),
    ],
}  # fmt: skip


def test_episode_turns_append_the_tokens_the_whole_chat_renders_to(family):
    """Two episodes of one rollout (one with a system message), turn by turn: the engine's tokens
    plus what rlhpc appends are, at every turn, the whole chat's ids as apply_chat_template gives
    them, and each episode's ids are those it gets alone."""
    f, tok = family
    tools = TOOLS if f.name.startswith("qwen") else None
    firsts = [FIRST, [{"role": "system", "content": "be brief"}, *FIRST]]
    chats = Conversation.start_all(tok, tok.chat_template, f.name, firsts, tools)
    alone = [Conversation(tok, tok.chat_template, f.name, first, tools) for first in firsts]
    streams = [list(c.prompt_ids) for c in chats]
    messages = [list(first) for first in firsts]
    assert streams == [template_ids(tok, m, tools=tools) for m in messages]
    eos = tok.convert_tokens_to_ids(f.eos)
    for reply, stopped, observation in TURNS[f.name]:
        generated = tok.encode(reply, add_special_tokens=False) + ([eos] if stopped else [])
        n = len(chats)
        extras = extend_all(chats, [generated] * n, [reply] * n, [observation] * n)
        assert extras == [c.extend(generated, reply, observation) for c in alone]
        for k in range(n):
            streams[k] += generated + extras[k]
            messages[k] += [{"role": "assistant", "content": reply}, *observation]
            assert streams[k] == template_ids(tok, messages[k], tools=tools), (f.name, reply)


# Per family, a turn the template renders differently once the chat goes on: refused, naming it.
BREAKS = {
    # Qwen3 strips the reasoning of turns before the last user message
    "qwen3": ("<think>\nsmall steps\n</think>\n\n3 then", [{"role": "user", "content": "higher"}]),
    # Llama 3 trims each message: a reply ending in a space is not rendered as generated
    "llama3": ("3 then ", [{"role": "user", "content": "higher"}]),
}


@pytest.mark.parametrize("name", list(BREAKS))
def test_a_template_that_rewrites_a_turn_is_refused_naming_it(name):
    f, tok = family_and_tokenizer(name)
    reply, observation = BREAKS[f.name]
    chat = Conversation(tok, tok.chat_template, f"{f.name}.jinja", FIRST)
    generated = tok.encode(reply, add_special_tokens=False) + [tok.convert_tokens_to_ids(f.eos)]
    closed = tok.apply_chat_template([*FIRST, {"role": "assistant", "content": reply}], tokenize=False)
    after = tok.apply_chat_template([*FIRST, {"role": "assistant", "content": reply}, *observation], tokenize=False)
    assert not after.startswith(closed) or reply not in closed  # the template does rewrite it
    with pytest.raises(TemplateBreaksPrefix, match=f"the chat template {f.name}.jinja "):
        chat.extend(generated, reply, observation)
