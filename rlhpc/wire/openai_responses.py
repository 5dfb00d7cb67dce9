"""OpenAI's Responses API (``/v1/responses``) as rlhpc's agent endpoint speaks it: a request's input
items as chat messages, as SGLang's ``serving_responses`` converts them (``instructions`` and
``developer`` messages as the one leading system message, a function call as an assistant tool
call, its output as a tool message, an assistant message and its calls merged into one turn); an
answer as output items (a ``message`` with its ``output_text``, then one ``function_call`` per
call); and, with ``stream``, the events the official client reads, all sent once the answer is
done. Field names: ``rlhpc.wire.openai_protocol.ResponsesRequest`` (checked against the wheel).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import JSONResponse

from rlhpc.wire.openai_protocol import ResponsesRequest
from rlhpc.wire.protocol import EngineError


def error(message: str, status: int = 400) -> JSONResponse:
    """OpenAI's error body for the Responses API (``error`` nested, as SGLang writes it there)."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(status, "api_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string is one user message)."""
    return [{"role": "user", "content": req.input}] if isinstance(req.input, str) else list(req.input)


def chat_messages(req: ResponsesRequest, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``items`` (the earlier responses' items, then this request's) as chat messages, after
    ``instructions``: the system texts coalesced into one leading system message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for item in items:
        message = _message(item)
        if message is None:
            continue
        last = messages[-1] if messages else None
        if message["role"] == "assistant" and last is not None and last["role"] == "assistant":
            messages[-1] = _merged(last, message)  # a message and its function calls: one turn
        else:
            messages.append(message)
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def _message(item: dict[str, Any]) -> dict[str, Any] | None:
    if not isinstance(item, dict):
        raise EngineError(f"an input item must be an object, got {str(item)[:80]}")
    kind = item.get("type")
    if kind == "function_call":
        arguments = item.get("arguments")
        call = {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"),
                "arguments": arguments if isinstance(arguments, str) else orjson.dumps(arguments or {}).decode()}}  # fmt: skip
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": _text(item.get("output", ""))}
    if kind not in (None, "message"):
        raise EngineError(
            f"input items of type {kind!r} are not supported by rlhpc's agent endpoint (messages, function_call "
            "and function_call_output are)"
        )
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise EngineError(f"an input message has role {role!r}; use user, assistant, system or developer")
    return {"role": "system" if role == "developer" else role, "content": _text(item.get("content", ""))}


def _text(content: Any) -> str:
    """A content string, or the text of its parts (``input_text``, ``output_text``) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise EngineError(f"content must be a string or a list of parts, got {str(content)[:80]}")
    kinds = {p.get("type") for p in content if isinstance(p, dict)} - {"input_text", "output_text", "text"}
    if kinds or not all(isinstance(p, dict) for p in content):
        raise EngineError(f"content parts of type {sorted(map(str, kinds))} are not supported (text parts are)")
    return "".join(p.get("text", "") for p in content)


def _merged(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    texts = [t for t in (first.get("content"), second.get("content")) if t]
    calls = [*(first.get("tool_calls") or []), *(second.get("tool_calls") or [])]
    return {"role": "assistant", "content": "\n\n".join(texts) or None, **({"tool_calls": calls} if calls else {})}


def chat_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """The request's function tools as chat tool schemas (what the chat template lists)."""
    tools = []
    for t in req.tools:
        if t.get("type") != "function" or not t.get("name"):
            raise EngineError(
                f"tools of type {t.get('type')!r} are not supported by rlhpc's agent endpoint; give function "
                "tools with a name (the agent runs its tools itself)"
            )
        function = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("description"):
            function["description"] = t["description"]
        tools.append({"type": "function", "function": function})
    return tools or None


def output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The assistant message answered (chat form) as output items: its text as a ``message`` (when
    it has text or no calls), then a ``function_call`` per tool call."""
    items: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        part = {"type": "output_text", "text": message.get("content") or "", "annotations": [], "logprobs": []}
        items.append(
            {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "completed", "role": "assistant",
             "content": [part]}
        )  # fmt: skip
    for c in calls:
        items.append(
            {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "completed", "call_id": c["id"],
             "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        )  # fmt: skip
    return items


def response_body(
    req: ResponsesRequest, items: list[dict[str, Any]], finish: str | None, prompt_tokens: int, output_tokens: int
) -> dict[str, Any]:
    """A ``response`` object: completed, or incomplete where the answer hit its token limit."""
    cut = finish == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "model": req.model or "rlhpc-policy",
        "output": items,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "parallel_tool_calls": True,
        "tool_choice": req.tool_choice,
        "tools": req.tools,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": (req.model_extra or {}).get("metadata") or {},
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        },
    }


async def events(body: dict[str, Any]) -> AsyncIterator[bytes]:
    """A finished response as the Responses API's stream: created, each output item added, its
    text or arguments in one delta and done, then completed (or incomplete)."""
    n = [0]

    def event(kind: str, **fields: Any) -> bytes:
        chunk = {"type": kind, "sequence_number": n[0], **fields}
        n[0] += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(chunk) + b"\n\n"

    opening = {**body, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=opening)
    yield event("response.in_progress", response=opening)
    for i, item in enumerate(body["output"]):
        if item["type"] == "message":
            part = item["content"][0]
            yield event(
                "response.output_item.added", output_index=i, item={**item, "status": "in_progress", "content": []}
            )
            ids = {"item_id": item["id"], "output_index": i, "content_index": 0}
            yield event("response.content_part.added", **ids, part={**part, "text": ""})
            yield event("response.output_text.delta", **ids, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **ids, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **ids, part=part)
        else:
            yield event(
                "response.output_item.added", output_index=i, item={**item, "status": "in_progress", "arguments": ""}
            )
            ids = {"item_id": item["id"], "output_index": i}
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, name=item["name"], arguments=item["arguments"])
        yield event("response.output_item.done", output_index=i, item=item)
    yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
