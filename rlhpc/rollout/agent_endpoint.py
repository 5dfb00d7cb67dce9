"""The OpenAI-compatible endpoint a black-box agent (``rollout.agent``) is pointed at.

It runs in the driver process, on loopback, for one generation: a uvicorn server on a thread
of its own, serving ``/v1/chat/completions`` and ``/v1/models`` (``base_url`` ends in ``/v1``,
as the OpenAI client expects). Each episode has its own key (the ``api_key`` its agent gets);
a request with no known key is answered 401, so an agent can only talk as its own episode.

A request's messages are rendered with the run's chat template (``data.chat_template``,
``apply_chat_template``, the request's ``tools`` passed to it) and sent to the engines as token
ids through the episode's ``EngineHandle`` (recorded there: prompt and output ids, logprobs,
weight versions). When a request continues the episode's previous one (the same messages, then
the assistant message this endpoint answered, then new ones) its prompt is the previous prompt,
the engine's own output tokens, and the template's tokens for the new messages
(``episodes.Conversation.extend``): the engine sees the tokens it generated, never a
re-tokenization of their text, and ``trajectories.assemble`` merges the calls into one sample.
Any other request is rendered whole (and starts a new sample).

Sampling is the run's (``rollout.temperature``, ``top_p``, the knobs, a seed per call); a
request's ``max_tokens`` / ``max_completion_tokens`` may lower ``rollout.max_new_tokens``, and
its ``stop`` strings add to ``rollout.stop``. Its own ``temperature``, ``top_p`` and ``seed`` are
ignored: the run samples on-policy. Answers are OpenAI's shape (``openai_routes``), tool calls
read by ``rollout.tool_parser``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from rlhpc.errors import RlhpcError
from rlhpc.rollout.episodes import Conversation, TemplateBreaksPrefix
from rlhpc.rollout.trajectories import EngineHandle, Generated
from rlhpc.wire.openai_messages import assistant_message, openai_error, sse_events, template_message
from rlhpc.wire.openai_protocol import ChatCompletionRequest, OpenAIRoute, unsupported_fields
from rlhpc.wire.protocol import EngineError, MetaInfo
from rlhpc.wire.tool_calls import ParsedCall, ParsedOutput

log = logging.getLogger(__name__)

MODEL_NAME = "rlhpc-policy"  # what /v1/models lists; any model name a request gives is served by the policy


class _Episode:
    """One episode's state: its engine handle, and its last call (to extend)."""

    def __init__(self, handle: EngineHandle):
        self.handle = handle
        self.chat: Conversation | None = None  # the last call's chat, replies as generated
        self.request: list[dict] = []  # the last request's messages, as compared
        self.tools: list[dict] | None = None
        self.ids: list[int] = []  # the last call's prompt and output
        self.output: Generated | None = None
        self.answer: dict | None = None  # the assistant message answered, as compared
        self.transcript: list[dict] = []  # the last request's messages and the answer


def _same(message: dict) -> tuple:
    """What two OpenAI messages must share to be the same turn: role, text, tool calls (name and
    parsed arguments); ids, names and fields the client adds (``refusal: None``) do not count."""
    m = template_message({k: v for k, v in message.items() if v is not None})
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"].get("arguments"), sort_keys=True))
        for c in m.get("tool_calls") or []
    )
    return m.get("role"), m.get("content") or "", calls


class AgentEndpoint:
    """The endpoint of one generation's agents (a context manager: served while inside)."""

    def __init__(self, tokenizer: Any, template: str, template_name: str, parser: Any | None, host: str = "127.0.0.1"):
        self.tokenizer, self.template, self.template_name, self.parser = tokenizer, template, template_name, parser
        self._episodes: dict[str, _Episode] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))  # port 0: no probe-then-bind race with other runs on the node
        port = self._sock.getsockname()[1]
        self.base_url = f"http://{host}:{port}/v1"
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="rlhpc-agent-endpoint", daemon=True)

    def _serve(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._sock]))

    def __enter__(self) -> AgentEndpoint:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RlhpcError(
                    f"the agent endpoint on {self.base_url} did not start",
                    "see the log above for uvicorn's error",
                )
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def open(self, handle: EngineHandle) -> str:
        """A new episode's key: its requests go to ``handle``."""
        key = secrets.token_urlsafe(24)
        self._episodes[key] = _Episode(handle)
        return key

    def close(self, key: str) -> list[dict]:
        """End the episode of ``key``: its final transcript (the last request's messages and the answer)."""
        return self._episodes.pop(key).transcript

    # ------------------------------------------------------------------ routes

    def _app(self) -> FastAPI:
        app = FastAPI()

        def episode(request: Request) -> _Episode | None:
            auth = request.headers.get("authorization", "")
            return self._episodes.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None

        @app.get(OpenAIRoute.MODELS)
        async def models(request: Request) -> Response:
            if episode(request) is None:
                return openai_error("missing or unknown episode key", 401)
            card = {"id": MODEL_NAME, "object": "model", "created": int(time.time()), "owned_by": "rlhpc"}
            return Response(orjson.dumps({"object": "list", "data": [card]}), media_type="application/json")

        @app.post(OpenAIRoute.CHAT_COMPLETIONS)
        async def chat(request: Request) -> Response:
            ep = episode(request)
            if ep is None:
                return openai_error("missing or unknown episode key", 401)
            try:
                req = ChatCompletionRequest.model_validate_json(await request.body())
            except ValidationError as e:
                return openai_error(f"invalid request: {e.errors(include_url=False)}")
            bad = unsupported_fields(req)
            # declared for the CPU engine's routes, not served here: refused rather than dropped
            bad += [f"{k}={v!r}" for k, v in (("chat_template_kwargs", req.chat_template_kwargs),
                                              ("top_logprobs", req.top_logprobs)) if v]  # fmt: skip
            if bad or req.n != 1:
                return openai_error(
                    f"not supported by rlhpc's agent endpoint: {', '.join(bad) or f'n={req.n}'}; leave them out "
                    "(the run's data.chat_template renders the messages)"
                )
            try:
                body = await self._complete(ep, req)
            except (ValueError, EngineError) as e:  # messages the template refuses, content it cannot take
                return openai_error(f"{type(e).__name__}: {e}")
            if req.stream:
                return StreamingResponse(sse_events(body, req), media_type="text/event-stream")
            return Response(orjson.dumps(body), media_type="application/json")

        return app

    def _prompt(self, ep: _Episode, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """The call's prompt ids: the previous call's tokens extended, where the messages continue it."""
        seen = [_same(m) for m in messages]
        n = len(ep.request)
        continues = (
            ep.chat is not None
            and ep.output is not None
            and ep.answer is not None
            and tools == ep.tools
            and len(messages) > n + 1
            and seen[:n] == ep.request
            and seen[n] == ep.answer
        )
        if continues:
            assert ep.chat is not None and ep.output is not None
            try:
                new = [template_message(m) for m in messages[n + 1 :]]
                return ep.ids + ep.chat.extend(ep.output.tokens, ep.output.text, new)
            except TemplateBreaksPrefix as e:  # rendered whole: the calls become separate samples
                log.debug("agent call rendered whole: %s", e)
        ep.chat = Conversation(
            self.tokenizer, self.template, self.template_name, [template_message(m) for m in messages], tools
        )
        return ep.chat.prompt_ids

    async def _complete(self, ep: _Episode, req: ChatCompletionRequest) -> dict:
        prompt = self._prompt(ep, req.messages, req.tools)
        sampling: dict[str, Any] = {}
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if limit is not None:
            sampling["max_new_tokens"] = min(limit, ep.handle.params["max_new_tokens"])
        if req.stop:
            sampling["stop"] = [
                *ep.handle.params.get("stop", []),
                *([req.stop] if isinstance(req.stop, str) else req.stop),
            ]
        number, fut = ep.handle.submit(prompt, sampling)
        out = ep.handle.record(number, prompt, await asyncio.wrap_future(fut))
        parsed = self._calls(out.text) if req.tools and req.tool_choice != "none" else None
        finish = {"finish_reason": out.finish_reason, "matched_stop": out.matched}
        message, finish = assistant_message(out.text, finish, parsed)
        # the next call extends this one where it sends these messages and this answer back
        ep.request, ep.tools, ep.ids, ep.output = [_same(m) for m in req.messages], req.tools, prompt + out.tokens, out
        ep.answer = _same(message)
        ep.transcript = [*req.messages, message]
        choice: dict[str, Any] = {"index": 0, "message": message, **finish, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": [self._logprob(t, lp) for t, lp in zip(out.tokens, out.logprobs)]}
        if req.return_token_ids or req.return_prompt_token_ids:
            choice["prompt_token_ids"] = prompt
        if req.return_token_ids:
            choice["response_token_ids"] = out.tokens
        version = out.weight_versions[0] if out.weight_versions else 0
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model or MODEL_NAME,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out.tokens),
                "total_tokens": len(prompt) + len(out.tokens),
            },
            "metadata": {MetaInfo.WEIGHT_VERSION: str(version)},
        }

    def _calls(self, text: str) -> ParsedOutput:
        assert self.parser is not None
        out = self.parser(text)
        if isinstance(out, ParsedOutput):
            return out
        calls = [c if isinstance(c, ParsedCall) else ParsedCall(c.name, c.arguments) for c in out]
        return ParsedOutput(text.split("<tool_call>")[0].strip() if calls else text, calls)

    def _logprob(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.tokenizer.decode([token])
        return {"token": text, "bytes": list(text.encode()), "logprob": logprob, "top_logprobs": []}
