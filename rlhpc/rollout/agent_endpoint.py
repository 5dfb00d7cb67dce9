"""The endpoint a black-box agent (``rollout.agent``) is pointed at: what agent harnesses speak.

It runs in the driver process, on loopback, for one generation: a uvicorn server on a thread of
its own (``base_url`` ends in ``/v1``), serving

- ``/v1/chat/completions`` and ``/v1/models`` (OpenAI's chat API),
- ``/v1/responses`` (OpenAI's Responses API: input items, ``previous_response_id`` within the episode),
- ``/v1/messages`` (Anthropic's Messages API),
- ``/v1/completions`` (a raw prompt, text or token ids: no chat template needed).

Each episode has its own key (the ``api_key`` its agent gets, as ``Authorization: Bearer`` or
Anthropic's ``x-api-key``); a request with no known key is answered 401 and its connection closed.
Every connection is guarded (``rlhpc.util.http_guard``, as the CPU engine's): a deadline for each
request's headers and body, caps on connections, header and body sizes, so other users of the node
cannot exhaust the driver's descriptors.

The three chat APIs become one thing: chat messages (``openai_responses``, ``anthropic_messages``
convert theirs as SGLang does), rendered with the run's chat template (``data.chat_template``, the
request's tools passed to it) through the one rendering path (``data.prompts``: control tokens in
the messages' text stay text) and sent to the engines as token ids through the episode's
``EngineHandle`` (recorded there: prompt and output ids, logprobs, weight versions). When a request
continues the episode's previous one (the same messages, then the assistant message this endpoint
answered, then new ones) its prompt is the previous prompt, the engine's own output tokens, and
the template's tokens for the new messages (``episodes.Conversation.extend``): the engine sees the
tokens it generated, never a re-tokenization of their text, and ``trajectories.assemble`` merges
the calls into one sample. A completion whose prompt text continues the previous one (its prompt,
then the text the engine generated) is, likewise, the previous ids, the engine's tokens and the
new text's. Any other request is rendered whole (and starts a new sample).

Sampling is the run's (``rollout.temperature``, ``top_p``, the knobs, a seed per call); a request's
token limit may lower ``rollout.max_new_tokens`` (and the context's room does), its stop strings add
to ``rollout.stop``. Its own ``temperature``, ``top_p``, ``top_k`` and ``seed`` are ignored: the run
samples on-policy. Tool calls are read by ``rollout.tool_parser`` from the text decoded with special
tokens kept (SGLang does so whenever tools are offered: ``<tool_call>`` is a special token of some
tokenizers). A bad request (a token limit below 1, a conversation that leaves no room in the
context, a field it cannot honour, messages the template refuses) is that request's 4xx with the
reason; the run and the other episodes go on.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from rlhpc.engine_server.cpu.requests import stop_strings
from rlhpc.errors import RlhpcError
from rlhpc.rollout.episodes import Conversation, TemplateBreaksPrefix
from rlhpc.rollout.trajectories import EngineHandle, Generated
from rlhpc.util.http_guard import GuardLimits, trust, uvicorn_options
from rlhpc.wire import anthropic_messages as anthropic
from rlhpc.wire import openai_responses as responses
from rlhpc.wire.openai_messages import assistant_message, openai_error, sse_events, template_message
from rlhpc.wire.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    HarnessRoute,
    OpenAIRoute,
    ResponsesRequest,
    unsupported_fields,
)
from rlhpc.wire.protocol import EngineError, MetaInfo
from rlhpc.wire.tool_calls import ParsedCall, ParsedOutput

log = logging.getLogger(__name__)

MODEL_NAME = "rlhpc-policy"  # what /v1/models lists; any model name a request gives is served by the policy
MAX_RESPONSES = 64  # an episode's responses kept for previous_response_id (the latest)
Error = Callable[[str, int], JSONResponse]


def limits_for(episodes: int) -> GuardLimits:
    """The guard's limits for a generation of ``episodes`` agents: room for a few connections each
    (an agent's client keeps its own; the guard keeps it within half the driver's descriptors),
    accepted 128 at a time: what a burst of connections holds before the cap closes them."""
    return GuardLimits(max_connections=max(256, 4 * episodes), backlog=128)


class Refused(Exception):
    """A request the endpoint answers with a 4xx: the agent's to handle; the run goes on."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message, self.status = message, status


class _Episode:
    """One episode's state: its engine handle, and its last call (to extend)."""

    def __init__(self, handle: EngineHandle):
        self.handle = handle
        self.chat: Conversation | None = None  # the last chat call's conversation, replies as generated
        self.request: list[tuple] = []  # the last chat request's messages, as compared
        self.tools: list[dict] | None = None
        self.ids: list[int] = []  # the last chat call's prompt and output
        self.output: Generated | None = None
        self.answer: tuple | None = None  # the assistant message answered, as compared
        self.transcript: list[dict] = []  # the last chat request's messages and the answer
        self.completion: tuple[str, list[int], Generated] | None = None  # the last completion: prompt text, ids, output
        self.responses: collections.OrderedDict[str, list[dict]] = collections.OrderedDict()  # id -> its items


def _same(message: dict) -> tuple:
    """What two OpenAI messages must share to be the same turn: role, text, tool calls (name and
    parsed arguments); ids, names and fields the client adds (``refusal: None``) do not count."""
    m = template_message({k: v for k, v in message.items() if v is not None})
    calls = tuple(
        (c["function"]["name"], json.dumps(c["function"].get("arguments"), sort_keys=True))
        for c in m.get("tool_calls") or []
    )
    return m.get("role"), m.get("content") or "", calls


def _parse(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise Refused(f"invalid request: {e.errors(include_url=False, include_context=False)}") from e


def _engine_fields(req: ChatCompletionRequest | CompletionRequest) -> list[str]:
    """SGLang's sampling extensions the CPU engine's routes take, at values the run's sampling does not."""
    fields = (("stop_token_ids", req.stop_token_ids, (None, [])), ("ignore_eos", req.ignore_eos, (False,)),
              ("no_stop_trim", req.no_stop_trim, (False,)), ("skip_special_tokens", req.skip_special_tokens, (True,)),
              ("lora_path", req.lora_path, (None,)))  # fmt: skip
    # lora_path: the run chooses the adapter its agents generate with, not the agents
    return [f"{k}={v!r}" for k, v, ok in fields if v not in ok] + ([f"n={req.n}"] if req.n != 1 else [])


def _refuse_unsupported(bad: list[str]) -> None:
    if bad:
        raise Refused(
            f"not supported by rlhpc's agent endpoint: {', '.join(bad)}; leave them out (the run samples "
            "on-policy with its own settings, and its data.chat_template renders the messages)"
        )


class AgentEndpoint:
    """The endpoint of one generation's agents (a context manager: served while inside)."""

    def __init__(
        self,
        tokenizer: Any,
        template: str | None,
        template_name: str,
        parser: Callable[[str], Any] | None,
        context_len: int | None = None,
        host: str = "127.0.0.1",
        limits: GuardLimits | None = None,
    ):
        self.tokenizer, self.template, self.template_name, self.parser = tokenizer, template, template_name, parser
        self.context_len, self.vocab = context_len, len(tokenizer)
        self._episodes: dict[str, _Episode] = {}
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))  # port 0: no probe-then-bind race with other runs on the node
        self._sock.set_inheritable(False)
        port = self._sock.getsockname()[1]
        self.base_url = f"http://{host}:{port}/v1"
        limits = limits or limits_for(1)
        # log_config=None: uvicorn's own would configure the driver's logging (the httpx logger among it)
        config = uvicorn.Config(
            self._app(), log_level="warning", access_log=False, lifespan="off", log_config=None,
            **uvicorn_options(limits, "the agent endpoint"),
        )  # fmt: skip
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
        """End the episode of ``key``: its final transcript (the last chat request's messages and the answer)."""
        return self._episodes.pop(key).transcript

    # ------------------------------------------------------------------ routes

    def _app(self) -> FastAPI:
        app = FastAPI()

        def episode(request: Request) -> _Episode | None:
            auth = request.headers.get("authorization", "")
            key = (
                auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else request.headers.get("x-api-key")
            )
            return self._episodes.get(key or "")

        async def serve(request: Request, error: Error, handler: Callable[[_Episode, bytes], Awaitable[Response]]):
            ep = episode(request)
            if ep is None:
                refusal = error("missing or unknown episode key", 401)
                refusal.headers["connection"] = "close"  # a caller without a key keeps no connection open
                return refusal
            trust(request.scope)  # an agent's connection: the guard never sheds it for a newer one
            try:
                return await handler(ep, await request.body())
            except Refused as e:
                return error(e.message, e.status)

        @app.get(OpenAIRoute.MODELS)
        async def models(request: Request) -> Response:
            async def answer(ep: _Episode, body: bytes) -> Response:
                card = {"id": MODEL_NAME, "object": "model", "created": int(time.time()), "owned_by": "rlhpc"}
                return Response(orjson.dumps({"object": "list", "data": [card]}), media_type="application/json")

            return await serve(request, openai_error, answer)

        @app.post(OpenAIRoute.CHAT_COMPLETIONS)
        async def chat(request: Request) -> Response:
            return await serve(request, openai_error, self._chat)

        @app.post(OpenAIRoute.COMPLETIONS)
        async def completions(request: Request) -> Response:
            return await serve(request, openai_error, self._completions)

        @app.post(HarnessRoute.RESPONSES)
        async def responses_route(request: Request) -> Response:
            return await serve(request, responses.error, self._responses)

        @app.post(HarnessRoute.MESSAGES)
        async def messages(request: Request) -> Response:
            return await serve(request, anthropic.error, self._messages)

        return app

    # ------------------------------------------------------------------ the four APIs

    async def _chat(self, ep: _Episode, raw: bytes) -> Response:
        req = _parse(ChatCompletionRequest, raw)
        bad = unsupported_fields(req)
        # declared for the CPU engine's routes, not served here: refused rather than dropped
        bad += [f"{k}={v!r}" for k, v in (("chat_template_kwargs", req.chat_template_kwargs),
                                          ("top_logprobs", req.top_logprobs)) if v]  # fmt: skip
        _refuse_unsupported(bad + _engine_fields(req))
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        out, message, finish, prompt = await self._converse(
            ep, req.messages, req.tools, req.tool_choice, limit, req.stop
        )
        choice: dict[str, Any] = {"index": 0, "message": message, **finish, "logprobs": None}
        if req.logprobs:
            choice["logprobs"] = {"content": [self._logprob(t, lp) for t, lp in zip(out.tokens, out.logprobs)]}
        if req.return_token_ids or req.return_prompt_token_ids:
            choice["prompt_token_ids"] = prompt
        if req.return_token_ids:
            choice["response_token_ids"] = out.tokens
        body = self._openai_body("chatcmpl", "chat.completion", req.model, choice, prompt, out)
        if req.stream:
            return StreamingResponse(sse_events(body, req), media_type="text/event-stream")
        return Response(orjson.dumps(body), media_type="application/json")

    async def _responses(self, ep: _Episode, raw: bytes) -> Response:
        req = _parse(ResponsesRequest, raw)
        _refuse_unsupported(unsupported_fields(req))
        history: list[dict] = []
        if req.previous_response_id is not None:
            if req.previous_response_id not in ep.responses:
                raise Refused(f"previous_response_id {req.previous_response_id!r} is not one of this episode's", 404)
            history = ep.responses[req.previous_response_id]
        items = [*history, *responses.input_items(req)]
        try:
            messages, tools = responses.chat_messages(req, items), responses.chat_tools(req)
        except EngineError as e:
            raise Refused(str(e)) from e
        out, message, finish, prompt = await self._converse(
            ep, messages, tools, req.tool_choice, req.max_output_tokens, req.stop
        )
        output = responses.output_items(message)
        body = responses.response_body(req, output, finish["finish_reason"], len(prompt), len(out.tokens))
        ep.responses[body["id"]] = [*items, *output]
        while len(ep.responses) > MAX_RESPONSES:
            ep.responses.popitem(last=False)
        if req.stream:
            return StreamingResponse(responses.events(body), media_type="text/event-stream")
        return Response(orjson.dumps(body), media_type="application/json")

    async def _messages(self, ep: _Episode, raw: bytes) -> Response:
        req = _parse(anthropic.AnthropicMessagesRequest, raw)
        _refuse_unsupported(anthropic.unsupported_fields(req))
        choice = (req.tool_choice or {}).get("type", "auto")
        try:
            messages, tools = anthropic.chat_messages(req), anthropic.chat_tools(req)
        except EngineError as e:
            raise Refused(str(e)) from e
        out, message, finish, prompt = await self._converse(
            ep, messages, tools, "none" if choice == "none" else choice, req.max_tokens, req.stop_sequences
        )
        usage = (len(prompt), len(out.tokens))
        body = anthropic.message_body(req, message, finish["finish_reason"], out.matched, usage)
        if req.stream:
            return StreamingResponse(anthropic.events(body), media_type="text/event-stream")
        return Response(orjson.dumps(body), media_type="application/json")

    async def _completions(self, ep: _Episode, raw: bytes) -> Response:
        req = _parse(CompletionRequest, raw)
        bad = unsupported_fields(req) + _engine_fields(req)
        if req.logprobs:  # the run's engine calls ask for the sampled token's logprob only
            bad.append(f"logprobs={req.logprobs} (top logprobs; 0 gives each token's own)")
        _refuse_unsupported(bad)
        text, prompt = self._completion_prompt(ep, req.prompt)
        out = await self._generate(ep, prompt, self._sampling(ep, prompt, req.max_tokens, req.stop, False))
        ep.completion = (text, prompt, out) if text is not None else None
        choice: dict[str, Any] = {"index": 0, "text": out.text, "logprobs": None}
        choice.update({"finish_reason": out.finish_reason, "matched_stop": out.matched})
        if req.logprobs is not None:
            tokens = [self.tokenizer.decode([t]) for t in out.tokens]
            choice["logprobs"] = {"text_offset": [-1] * len(tokens), "token_logprobs": out.logprobs,
                                  "tokens": tokens, "top_logprobs": []}  # fmt: skip
        if req.return_token_ids:
            choice["token_ids"], choice["prompt_token_ids"] = out.tokens, prompt
        body = self._openai_body("cmpl", "text_completion", req.model, choice, prompt, out)
        if req.stream:
            return StreamingResponse(sse_events(body, req), media_type="text/event-stream")
        return Response(orjson.dumps(body), media_type="application/json")

    @staticmethod
    def _openai_body(
        prefix: str, kind: str, model: str | None, choice: dict, prompt: list[int], out: Generated
    ) -> dict:
        version = out.weight_versions[0] if out.weight_versions else 0
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model or MODEL_NAME,
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(out.tokens),
                "total_tokens": len(prompt) + len(out.tokens),
            },
            "metadata": {MetaInfo.WEIGHT_VERSION: str(version)},
        }

    # ------------------------------------------------------------------ one engine call

    async def _converse(
        self,
        ep: _Episode,
        messages: list[dict],
        tools: list[dict] | None,
        tool_choice: Any,
        limit: int | None,
        stop: str | list[str] | None,
    ) -> tuple[Generated, dict, dict, list[int]]:
        """One chat call: (the engine's output, the assistant message, its finish fields, the prompt ids)."""
        if tool_choice not in ("auto", "none", None):
            raise Refused(
                f"tool_choice={tool_choice!r} is not supported: the run samples on-policy and cannot force a "
                "call; use auto (or none)"
            )
        if self.template is None:
            raise Refused(
                "this run has no chat template (data.chat_template: none, or a tokenizer without one), so chat "
                "messages cannot be rendered; send the prompt itself to /v1/completions, or set data.chat_template"
            )
        parse_tools = bool(tools) and tool_choice != "none"
        try:
            prompt = self._prompt(ep, messages, tools)
        except (RlhpcError, EngineError, ValueError, TypeError) as e:  # messages the template cannot take
            raise Refused(f"the messages cannot be rendered: {e}") from e
        out = await self._generate(ep, prompt, self._sampling(ep, prompt, limit, stop, parse_tools))
        parsed = self._calls(out.text) if parse_tools else None
        message, finish = assistant_message(
            out.text, {"finish_reason": out.finish_reason, "matched_stop": out.matched}, parsed
        )
        # the next call extends this one where it sends these messages and this answer back
        ep.request, ep.tools, ep.ids, ep.output = [_same(m) for m in messages], tools, prompt + out.tokens, out
        ep.answer = _same(message)
        ep.transcript = [*messages, message]
        return out, message, finish, prompt

    def _sampling(
        self, ep: _Episode, prompt: list[int], limit: int | None, stop: str | list[str] | None, keep_special: bool
    ) -> dict[str, Any]:
        """The call's sampling overrides, checked as the engine would check them, so that a bad
        request is refused here, alone, and never reaches an engine batch it would fail whole."""
        if limit is not None and limit < 1:
            raise Refused(f"the token limit must be at least 1, got {limit}")
        run = ep.handle.params["max_new_tokens"]
        sampling: dict[str, Any] = {"max_new_tokens": run if limit is None else min(limit, run)}
        if self.context_len is not None:
            room = self.context_len - len(prompt)
            if room < 1:
                raise Refused(
                    f"the prompt is {len(prompt)} tokens and the model's context {self.context_len}: no room for "
                    "a reply; send a shorter conversation"
                )
            sampling["max_new_tokens"] = min(sampling["max_new_tokens"], room)
        if stop:
            try:
                sampling["stop"] = stop_strings(
                    [*ep.handle.params.get("stop", []), *([stop] if isinstance(stop, str) else stop)]
                )
            except EngineError as e:
                raise Refused(str(e)) from e
        if keep_special:  # as SGLang with tools offered: the parser must see <tool_call> even where it is special
            sampling["skip_special_tokens"] = False
        return sampling

    async def _generate(self, ep: _Episode, prompt: list[int], sampling: dict[str, Any]) -> Generated:
        if not prompt:
            raise Refused("the prompt is empty")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise Refused(f"a prompt token id is outside the tokenizer's range [0, {self.vocab})")
        number, fut = ep.handle.submit(prompt, sampling)
        return ep.handle.record(number, prompt, await asyncio.wrap_future(fut))

    # ------------------------------------------------------------------ prompts

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
            chat, output, ids = ep.chat, ep.output, ep.ids
            ep.output = None  # extended once: a concurrent call of the episode renders whole
            try:
                new = [template_message(m) for m in messages[n + 1 :]]
                return ids + chat.extend(output.tokens, output.text, new)
            except TemplateBreaksPrefix as e:  # rendered whole: the calls become separate samples
                log.debug("agent call rendered whole: %s", e)
        assert self.template is not None
        ep.chat = Conversation(
            self.tokenizer, self.template, self.template_name, [template_message(m) for m in messages], tools
        )
        return ep.chat.prompt_ids

    def _completion_prompt(self, ep: _Episode, prompt: Any) -> tuple[str | None, list[int]]:
        """(its text, its ids) of a completion's prompt: token ids as given; text that continues
        the previous completion (its prompt, then text the engine generated) as the previous ids,
        the engine's tokens and the rest's; other text encoded as SGLang encodes it (the prompt is
        the agent's own template: its control tokens are tokens)."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if not all(isinstance(t, int) for t in prompt):
                raise Refused("give one prompt (a text or a list of token ids): the endpoint answers n=1 per call")
            return None, list(prompt)
        if ep.completion is not None:
            text, ids, out = ep.completion
            for k, shown in self._shown(out):
                head = text + shown
                if prompt.startswith(head):
                    rest = prompt[len(head) :]
                    tail = self.tokenizer(rest, add_special_tokens=False)["input_ids"] if rest else []
                    return prompt, ids + out.tokens[:k] + list(tail)
        return prompt, list(self.tokenizer(prompt)["input_ids"])

    def _shown(self, out: Generated) -> list[tuple[int, str]]:
        """(k, the text of the engine's first k tokens) that a continuing prompt may start with:
        all its tokens, or all but a stop token that ended it (not in the text it was answered)."""
        shown = [(len(out.tokens), self.tokenizer.decode(out.tokens, skip_special_tokens=False))]
        if out.tokens and isinstance(out.matched, int) and out.tokens[-1] == out.matched:
            shown.append((len(out.tokens) - 1, self.tokenizer.decode(out.tokens[:-1], skip_special_tokens=False)))
        return shown

    # ------------------------------------------------------------------ answers

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
