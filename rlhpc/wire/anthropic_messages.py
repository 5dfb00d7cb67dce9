"""Anthropic's Messages API (``/v1/messages``) as rlhpc's agent endpoint speaks it, in the shapes of
SGLang's ``entrypoints/anthropic`` (its request model's field names, checked against the wheel by
tests/unit/test_sglang_protocol.py): a request as chat messages, as SGLang's adapter converts it
(``system`` as the leading system message, ``tool_use`` blocks as the assistant's tool calls, each
``tool_result`` as a tool message, text blocks as text); an answer as a ``message`` with a text
block and a ``tool_use`` block per call; its stop reason (``end_turn``, ``max_tokens``,
``stop_sequence``, ``tool_use``); with ``stream``, the events the official client reads, all sent
once the answer is done; errors in Anthropic's envelope.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, field_validator

from rlhpc.wire.protocol import EngineError

# SGLang's map of an OpenAI finish reason to Anthropic's stop reason (anthropic/serving.py)
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}


class AnthropicMessagesRequest(BaseModel):
    """SGLang's ``AnthropicMessagesRequest``: the fields the agent endpoint reads. Sampling fields
    (``temperature``, ``top_p``, ``top_k``) are read and ignored: the run samples on-policy."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[dict[str, Any]]
    max_tokens: int
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = None
    tool_choice: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    top_k: int | None = None
    top_p: float | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:  # SGLang's words
            raise ValueError("max_tokens must be positive")
        return v


# Fields taken only at values that change nothing (anything else is refused by name).
NO_EFFECT: dict[str, tuple[Any, ...]] = {"thinking": (None, {"type": "disabled"}), "output_config": (None, {})}
ANY = frozenset({"betas"})  # SGLang accepts and ignores them


def unsupported_fields(req: AnthropicMessagesRequest) -> list[str]:
    extra = req.model_extra or {}
    return [f"{k}={v!r}" for k, v in extra.items() if k not in ANY and (k not in NO_EFFECT or v not in NO_EFFECT[k])]


def error(message: str, status: int = 400) -> JSONResponse:
    """Anthropic's error envelope (what the official client reads as the error)."""
    body = {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}
    return JSONResponse(body, status)


def chat_messages(req: AnthropicMessagesRequest) -> list[dict[str, Any]]:
    """The request as chat messages, in order: the system text, then each message's text, tool
    calls and tool results (a user turn's text before a tool result stays before it)."""
    out: list[dict[str, Any]] = []
    system = [req.system] if isinstance(req.system, str) else [_block_text(b) for b in req.system or []]
    if any(system):
        out.append({"role": "system", "content": "\n".join(s for s in system if s)})
    for message in req.messages:
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise EngineError(f"a message has role {role!r}; the Messages API takes user and assistant")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise EngineError(f"a message's content must be a string or a list of blocks, got {str(content)[:80]}")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(block.get("text") or "")
            elif kind == "tool_use" and role == "assistant":
                arguments = orjson.dumps(block.get("input") or {}).decode()
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": arguments}})  # fmt: skip
            elif kind == "tool_result" and role == "user":
                if texts:  # the user's text before the result stays before it
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or block.get("id"),
                            "content": _result_text(block.get("content"))})  # fmt: skip
            else:
                raise EngineError(
                    f"{role} content blocks of type {kind!r} are not supported by rlhpc's agent endpoint (text, "
                    "tool_use from the assistant and tool_result from the user are)"
                )
        if texts or calls:
            out.append({"role": role, "content": "\n".join(texts), **({"tool_calls": calls} if calls else {})})
        elif role == "assistant":  # an empty turn keeps its place, as SGLang's adapter keeps it
            out.append({"role": role, "content": ""})
    return out


def _block_text(block: Any) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        raise EngineError(f"system blocks must be text blocks, got {str(block)[:80]}")
    return block.get("text") or ""


def _result_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise EngineError(f"a tool_result's content must be a string or text blocks, got {str(content)[:80]}")
    return "\n".join(_block_text(b) for b in content)


def chat_tools(req: AnthropicMessagesRequest) -> list[dict[str, Any]] | None:
    """The request's custom tools as chat tool schemas; Anthropic's server tools (web search,
    computer, ...) have no schema and are refused."""
    tools = []
    for t in req.tools or []:
        if t.get("type") not in (None, "custom") or not isinstance(t.get("input_schema"), dict):
            raise EngineError(
                f"tool {t.get('name')!r} of type {t.get('type')!r} is not supported: give custom tools with an "
                "input_schema (the agent runs its tools itself)"
            )
        function = {"name": t.get("name"), "parameters": {"type": "object", **t["input_schema"]}}
        if t.get("description"):
            function["description"] = t["description"]
        tools.append({"type": "function", "function": function})
    return tools or None


def message_body(
    req: AnthropicMessagesRequest, message: dict[str, Any], finish: str | None, matched: Any, usage: tuple[int, int]
) -> dict[str, Any]:
    """The assistant message answered (chat form) as an Anthropic ``message``."""
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for c in message.get("tool_calls") or []:
        try:
            arguments = orjson.loads(c["function"]["arguments"])
        except orjson.JSONDecodeError:
            arguments = {}
        content.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                        "input": arguments if isinstance(arguments, dict) else {}})  # fmt: skip
    if not content:  # Anthropic's responses always hold a block
        content.append({"type": "text", "text": ""})
    stop_sequence = matched if isinstance(matched, str) and matched in (req.stop_sequences or []) else None
    reason = "stop_sequence" if stop_sequence is not None else STOP_REASONS.get(finish or "stop", "end_turn")
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": req.model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }


async def events(body: dict[str, Any]) -> AsyncIterator[bytes]:
    """A finished message as the Messages API's stream: message_start, each block started, its
    text or input JSON in one delta, stopped, then message_delta (the stop reason) and message_stop."""

    def event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    opening = {**body, "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": body["usage"]["input_tokens"], "output_tokens": 0}}  # fmt: skip
    yield event("message_start", message=opening)
    for i, block in enumerate(body["content"]):
        if block["type"] == "text":
            yield event("content_block_start", index=i, content_block={"type": "text", "text": ""})
            yield event("content_block_delta", index=i, delta={"type": "text_delta", "text": block["text"]})
        else:
            yield event("content_block_start", index=i, content_block={**block, "input": {}})
            partial = orjson.dumps(block["input"]).decode()
            yield event("content_block_delta", index=i, delta={"type": "input_json_delta", "partial_json": partial})
        yield event("content_block_stop", index=i)
    delta = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
    yield event("message_delta", delta=delta, usage={"output_tokens": body["usage"]["output_tokens"]})
    yield event("message_stop")
