"""OpenAI chat messages and responses as SGLang writes them, for both servers that answer the
OpenAI routes: the CPU engine (``rlhpc.engine_server.cpu.openai_routes``) and the agent endpoint
(``rlhpc.rollout.agent_endpoint``)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi.responses import JSONResponse

from rlhpc.wire.protocol import EngineError
from rlhpc.wire.tool_calls import ParsedOutput


def openai_error(message: str, status: int = 400) -> JSONResponse:
    """SGLang's ErrorResponse body (what the openai client reads as the error)."""
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI message as chat templates read it (as SGLang prepares it): text parts joined with
    a space, and tool-call arguments as objects rather than JSON text (templates write them with tojson)."""
    msg = dict(message)
    content = msg.get("content")
    if isinstance(content, list):
        kinds = {part.get("type") for part in content if isinstance(part, dict)}
        if kinds - {"text"}:
            raise EngineError(f"content parts of type {sorted(kinds - {'text'})} are not supported by the CPU engine")
        msg["content"] = " ".join(part["text"] for part in content)
    calls = msg.get("tool_calls")
    if isinstance(calls, list):
        msg["tool_calls"] = [_call_with_object_arguments(c) for c in calls]
    return msg


def _call_with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = orjson.loads(function["arguments"])
        except orjson.JSONDecodeError as e:  # SGLang's words
            raise EngineError("Assistant tool call function.arguments must be valid JSON.") from e
    return {**call, "function": function}


def assistant_message(
    text: str, finish: dict[str, Any], parsed: ParsedOutput | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A choice's message and finish fields for an output ``text`` whose tool calls were read as
    ``parsed`` (None: not read): with calls, the content is the text before them."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if parsed is not None and parsed.calls:
        message["content"] = parsed.content
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "index": k,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for k, c in enumerate(parsed.calls)
        ]
        if finish["finish_reason"] == "stop":  # as SGLang: the turn ended to call tools
            finish = {"finish_reason": "tool_calls", "matched_stop": None}
    return message, finish


async def sse_events(body: dict, req: Any) -> AsyncIterator[bytes]:
    """A finished response as SSE chunks: per choice one with its text (chat: role and content,
    then its tool calls) and the finish reason, then usage if asked, then ``[DONE]``."""
    chat = body["object"] == "chat.completion"
    head = {k: body[k] for k in ("id", "created", "model")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    for c in body["choices"]:
        if chat:
            delta = {k: v for k, v in c["message"].items() if v is not None}
            choice = {"index": c["index"], "delta": delta, "logprobs": c["logprobs"]}
        else:
            choice = {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"]}
        yield _sse({**head, "choices": [{**choice, "finish_reason": None}]})
        end = {"index": c["index"], "finish_reason": c["finish_reason"], "matched_stop": c["matched_stop"]}
        end.update({"delta": {}} if chat else {"text": ""})
        yield _sse({**head, "choices": [end]})
    if (req.stream_options or {}).get("include_usage"):
        yield _sse({**head, "choices": [], "usage": body["usage"]})
    yield b"data: [DONE]\n\n"


def _sse(chunk: dict) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"
