"""Hermes/Qwen tool-call markup read as SGLang's hermes/qwen25 parsers read it, and chat messages
rendered by the model's own template with tools (issue 29)."""

from __future__ import annotations

import json

import pytest

from rlhpc.engine_server.cpu.openai_routes import render_chat
from rlhpc.model import build_bpe_tokenizer
from rlhpc.wire.protocol import EngineError
from rlhpc.wire.tool_calls import ParsedCall, parse_hermes

TOOLS = {"get_weather", "add"}


def test_a_qwen_tool_call_after_some_text() -> None:
    # as Qwen2.5 writes one (its chat template asks for this exact layout)
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
    out = parse_hermes(text, TOOLS)
    assert out.content == "Let me check."
    assert out.calls == [ParsedCall("get_weather", '{"city": "Paris", "unit": "°C"}')]


def test_parallel_calls_a_list_and_parameters() -> None:
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>\n[{"name": "add", "parameters": {"a": 3}}, {"name": "get_weather", "arguments": {}}]\n</tool_call>'
    )
    out = parse_hermes(text, TOOLS)
    assert out.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("add", {"a": 1, "b": 2}),
        ("add", {"a": 3}),
        ("get_weather", {}),
    ]


def test_an_unclosed_call_is_read_and_an_unknown_function_dropped() -> None:
    out = parse_hermes('<tool_call>\n{"name": "add", "arguments": {"a": 1}}', TOOLS)  # cut by a stop or the length
    assert out.calls == [ParsedCall("add", '{"a": 1}')]
    assert parse_hermes('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', TOOLS).calls == []


@pytest.mark.parametrize("text", ["  plain answer, no markup ", '<tool_call>{"name": "add", "argu</tool_call>'])
def test_text_without_valid_markup_stays_content_unchanged(text: str) -> None:
    out = parse_hermes(text, TOOLS)
    assert out.calls == [] and out.content == text


# ------------------------------------------------------------------ rendering


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}'
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_chat_is_rendered_by_the_template_with_tools_and_object_arguments() -> None:
    tok = build_bpe_tokenizer(0)
    tok.chat_template = TOOL_TEMPLATE
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "plus"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]
    ids = render_chat(tok, messages, tools, None)
    as_template_reads_them = [
        {"role": "user", "content": "one plus"},
        {**messages[1], "tool_calls": [{**call, "function": {"name": "add", "arguments": {"a": 1}}}]},
        messages[2],
    ]
    expect = tok.apply_chat_template(
        as_template_reads_them, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expect)
    text = tok.decode(ids)
    assert '"name": "add"' in text and '{"name": "add", "arguments": {"a": 1}}' in text  # tools, and an object
    with pytest.raises(EngineError, match="image_url"):
        render_chat(tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None, None)
