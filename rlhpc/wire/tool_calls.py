"""Tool calls in a model's output text, in the Hermes/Qwen format the common chat templates teach:

    Let me look that up.
    <tool_call>
    {"name": "search", "arguments": {"query": "rlhpc"}}
    </tool_call>

What SGLang's ``--tool-call-parser hermes`` / ``qwen25`` return, the same way: the text before
the first ``<tool_call>`` (stripped) is the message's content; each block holds one JSON object
(or a list of them) with ``name`` and ``arguments`` (or ``parameters``); an unclosed last block
is still read (the output hit its length or a stop string); a call to a function the request did
not offer is dropped (with ``tool_names`` None every call is kept: an episode's tools answer an
unknown name with an error observation instead). If any block is not valid JSON nothing is parsed, and the whole text stays
content, so a caller never acts on half a call.

The text a parser reads must keep special tokens (``markup_text``): ``<tool_call>`` is a special
token of some tokenizers, and a text decoded without them (the engine's ``text``, what an
environment's ``step`` and a reward read) holds no call. SGLang decodes with special tokens
whenever a request offers tools for the same reason.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("rlhpc.tool_calls")

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as the OpenAI API carries it


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    calls: list[ParsedCall]


def parse_hermes(text: str, tool_names: set[str] | None = None) -> ParsedOutput:
    """Split ``text`` into content and the calls to functions in ``tool_names`` (None: every call)."""
    start = text.find(OPEN)
    if start == -1:
        return ParsedOutput(text, [])
    calls: list[ParsedCall] = []
    try:
        for block in _BLOCK.findall(text):
            if not block.strip():
                continue
            parsed = json.loads(block.strip())
            for call in parsed if isinstance(parsed, list) else [parsed]:
                calls.extend(_call(call, tool_names))
    except (json.JSONDecodeError, AttributeError, TypeError) as e:
        log.warning("tool call markup that is not a JSON call (%s); kept as content", e)
        return ParsedOutput(text, [])
    return ParsedOutput(text[:start].strip(), calls)


def _call(call: dict, tool_names: set[str] | None) -> list[ParsedCall]:
    name = call.get("name")
    if not (isinstance(name, str) and (tool_names is None or name in tool_names)):
        log.warning("the model called %r, which the request's tools do not offer; dropped", name)
        return []
    arguments = call.get("parameters") or call.get("arguments", {})
    return [ParsedCall(name, json.dumps(arguments, ensure_ascii=False))]


def markup_text(tokenizer: Any, output_ids: Sequence[int], matched: int | None = None) -> str:
    """The text of an engine's ``output_ids`` as a tool-call parser must read it: special tokens
    kept, the stop token that ended the output dropped, as SGLang's detokenizer drops it
    (``matched``: that token's id; None: the last token, where it is a special one)."""
    ids = list(output_ids)
    if ids and (ids[-1] == matched if matched is not None else is_special(tokenizer, ids[-1])):
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=False)


def is_special(tokenizer: Any, token: int) -> bool:
    added = tokenizer.added_tokens_decoder.get(int(token))
    return bool(added is not None and added.special)


def special_tags(added_tokens: dict[str, bool]) -> list[str]:
    """The Hermes tags among a tokenizer's added tokens (content -> special) that are special tokens:
    what a text decoded without special tokens loses."""
    return [tag for tag in (OPEN, CLOSE) if added_tokens.get(tag)]
