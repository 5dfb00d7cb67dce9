"""SGLang's OpenAI-compatible routes on the CPU engine: /v1/models, /v1/completions, /v1/chat/completions.

A request becomes a native /generate batch (one row per prompt and choice, so every check of
/generate applies) and the rows' outputs become OpenAI choices, with SGLang's extensions: the
sampled token ids (``return_token_ids``), ``matched_stop``, the weight versions in ``metadata``.
Chat messages are rendered by the model's own chat template (``apply_chat_template``, ``tools``
passed to it); tool calls in the output are read in the Hermes/Qwen format
(``rlhpc.wire.tool_calls``), from the text decoded with special tokens kept whenever the request
offers tools (SGLang's rule). As SGLang, the messages' text is tokenized with the template's text
(its control tokens parse): rlhpc's own chats go through ``rlhpc.data.prompts`` instead. ``stream: true`` is answered as server-sent events once the
whole batch is done (the CPU engine does not decode incrementally): the client sees the same
chunks, all at the end. Field names: ``rlhpc.wire.openai_protocol``.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from rlhpc.engine_server.cpu.requests import MAX_TOP_LOGPROBS, Item, check_rows, lora_rows
from rlhpc.engine_server.cpu.runner import Engine
from rlhpc.wire import lora
from rlhpc.wire.openai_messages import assistant_message, openai_error, sse_events, template_message
from rlhpc.wire.openai_protocol import (
    REQUEST_TEMPLATE_REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRoute,
    unsupported_fields,
)
from rlhpc.wire.protocol import EngineError, MetaInfo
from rlhpc.wire.tool_calls import parse_hermes

log = logging.getLogger("rlhpc.cpu_server")

Generate = Callable[[list[Item], int], Awaitable[list[dict[str, Any]]]]
Prepare = Callable[..., Awaitable[Any]]


def add_openai_routes(app: FastAPI, engine: Engine, generate: Generate, prepare: Prepare) -> None:
    """Serve the OpenAI routes on ``app``; ``generate(items, seq)`` runs a native batch,
    ``prepare(fn, *args)`` runs ``fn`` off the event loop (a request's rendering and rows)."""

    @app.get(OpenAIRoute.MODELS)
    async def models() -> dict[str, Any]:
        card = {
            "id": engine.model_path,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",  # SGLang's value; clients that check it see the same
            "root": engine.model_path,
            "max_model_len": engine.context_len,
        }
        # the adapters loaded, each a model of its own (SGLang lists them so, the base as their parent)
        adapters = [
            {**card, "id": name, "root": path, "parent": engine.model_path, "max_model_len": None}
            for name, path in engine.adapters.listing().items()
        ]
        return {"object": "list", "data": [card, *adapters]}

    async def serve(request: Request, model: type[BaseModel], build: Callable[[Any], Any]) -> Response:
        seq = engine.next_seq()
        try:
            req = model.model_validate_json(await request.body())
        except ValidationError as e:
            return openai_error(f"invalid request to {request.url.path}: {e.errors(include_url=False)}")
        bad = unsupported_fields(req)
        if bad:
            return openai_error(f"not supported by the CPU engine: {', '.join(bad)}; leave them out")
        try:
            items, answer = await prepare(build, req)  # a template renders off the event loop
            outs = await generate(items, seq)
            body = answer(outs)
        except EngineError as e:
            return openai_error(str(e))
        except ValueError as e:  # a template that refuses the messages, bad numbers
            return openai_error(f"{type(e).__name__}: {e}")
        except Exception as e:
            log.exception("%s failed", request.url.path)
            return openai_error(f"{type(e).__name__}: {e}", status=500)
        if req.stream:
            return StreamingResponse(sse_events(body, req), media_type="text/event-stream")
        return Response(orjson.dumps(body), media_type="application/json")

    @app.post(OpenAIRoute.COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, lambda req: _completion(engine, req))

    @app.post(OpenAIRoute.CHAT_COMPLETIONS)
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, lambda req: _chat(engine, req))


# ------------------------------------------------------------------ requests -> native rows


def _sampling(req: CompletionRequest | ChatCompletionRequest, max_new_tokens: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,  # None: up to the context length, as SGLang
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
    }
    if req.top_k is not None:  # chat's default; the native rules apply
        params["top_k"] = req.top_k
    return params


def _rows(
    engine: Engine, prompts: list[list[int]], req: Any, params: dict[str, Any], top_logprobs: int | None
) -> list[Item]:
    """One native row per prompt and choice, prompt-major (choice index = prompt * n + k). With a
    ``seed``, choice k samples with seed + k: n choices of one seed would otherwise be n copies."""
    if req.n < 1:
        raise EngineError(f"n must be at least 1, got {req.n}")
    check_rows(len(prompts) * req.n)  # before a row is built: n = 2,000,000 built them all first
    rows = [(p, k) for p in prompts for k in range(req.n)]
    adapters = lora_rows(lora.openai_adapter(req.model, engine.model_path, req.lora_path), len(prompts))
    body = {
        "input_ids": [p for p, _ in rows],
        "lora_path": [name for name in adapters for _ in range(req.n)],  # rows are prompt-major
        "sampling_params": [{**params, "sampling_seed": None if req.seed is None else req.seed + k} for _, k in rows],
        "return_logprob": [top_logprobs is not None] * len(rows),
        "top_logprobs_num": [top_logprobs or 0] * len(rows),
    }
    items, _ = engine.normalize(body)
    return items


def _prompts(engine: Engine, prompt: Any) -> list[list[int]]:
    """CompletionRequest.prompt: text, texts, token ids or lists of token ids (SGLang's forms)."""
    if isinstance(prompt, str):
        return [engine.tokenizer.encode(prompt)]
    if not prompt:
        raise EngineError("prompt cannot be empty")
    if isinstance(prompt[0], str):
        return [engine.tokenizer.encode(p) for p in prompt]
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _completion(engine: Engine, req: CompletionRequest) -> tuple[list[Item], Callable[[list[dict]], dict]]:
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise EngineError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}")
    prompts = _prompts(engine, req.prompt)
    items = _rows(engine, prompts, req, _sampling(req, req.max_tokens), req.logprobs)

    def answer(outs: list[dict]) -> dict:
        choices = []
        for i, (it, out) in enumerate(zip(items, outs)):
            choice = {"index": i, "text": out["text"], **_finish(out)}
            choice["logprobs"] = _completion_logprobs(engine, out) if req.logprobs is not None else None
            if req.return_token_ids:
                choice["token_ids"] = out["output_ids"]
                choice["prompt_token_ids"] = it.prompt
            choices.append(choice)
        return _response("text_completion", req, outs, prompts, choices)

    return items, answer


def render_chat(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict] | None, kwargs: dict | None
) -> list[int]:
    """The prompt token ids of ``messages`` as the model's chat template renders them, with the
    assistant's turn opened: ``apply_chat_template`` itself, so the ids are the tokenizer's own."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise EngineError("the model's tokenizer has no chat_template; use /v1/completions")
    ids = tokenizer.apply_chat_template(
        [template_message(m) for m in messages],
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **(kwargs or {}),
    )
    return [int(t) for t in ids]


def check_template_kwargs(tokenizer: Any, kwargs: dict[str, Any] | None) -> None:
    """``chat_template_kwargs`` are the template's variables: a template of the request's own is
    refused (SGLang's rule), and so is a name of ``apply_chat_template``'s own arguments."""
    if not kwargs:
        return
    if "chat_template" in kwargs:
        raise EngineError(REQUEST_TEMPLATE_REFUSED)
    own = set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}
    if clash := sorted(own & set(kwargs)):
        raise EngineError(
            f"chat_template_kwargs may not set {', '.join(clash)}: apply_chat_template's own arguments; leave them out"
        )


def _chat(engine: Engine, req: ChatCompletionRequest) -> tuple[list[Item], Callable[[list[dict]], dict]]:
    top = req.top_logprobs if req.logprobs else None
    if req.logprobs and not 0 <= (top or 0) <= MAX_TOP_LOGPROBS:
        raise EngineError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    if req.top_logprobs and not req.logprobs:
        raise EngineError("top_logprobs needs logprobs=true")
    check_template_kwargs(engine.tokenizer, req.chat_template_kwargs)
    prompt = render_chat(engine.tokenizer, req.messages, req.tools, req.chat_template_kwargs)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    parse_tools = bool(req.tools) and req.tool_choice != "none"
    params = _sampling(req, max_new)
    if parse_tools:  # as SGLang (serving_chat): the parser must see <tool_call> even where it is a special token
        params["skip_special_tokens"] = False
    items = _rows(engine, [prompt], req, params, (top or 0) if req.logprobs else None)
    tool_names = {t.get("function", {}).get("name") for t in req.tools or []}

    def answer(outs: list[dict]) -> dict:
        choices = []
        for i, out in enumerate(outs):
            parsed = parse_hermes(out["text"], tool_names) if parse_tools else None
            message, finish = assistant_message(out["text"], _finish(out), parsed)
            choice: dict[str, Any] = {"index": i, "message": message, **finish}
            choice["logprobs"] = {"content": _chat_logprobs(engine, out)} if req.logprobs else None
            if req.return_token_ids or req.return_prompt_token_ids:
                choice["prompt_token_ids"] = prompt
            if req.return_token_ids:
                choice["response_token_ids"] = out["output_ids"]
            if req.return_meta_info:
                choice["meta_info"] = out["meta_info"]
            choices.append(choice)
        return _response("chat.completion", req, outs, [prompt], choices)

    return items, answer


# ------------------------------------------------------------------ native outputs -> OpenAI


def _finish(out: dict) -> dict[str, Any]:
    reason = out["meta_info"][MetaInfo.FINISH_REASON]
    return {"finish_reason": reason["type"], "matched_stop": reason.get("matched")}


def _response(kind: str, req: Any, outs: list[dict], prompts: list[list[int]], choices: list[dict]) -> dict:
    meta = outs[0]["meta_info"]
    completion = sum(o["meta_info"][MetaInfo.COMPLETION_TOKENS] for o in outs)
    prompt = sum(len(p) for p in prompts)  # each prompt once, however many choices it has (SGLang's usage)
    return {
        "id": meta[MetaInfo.ID],
        "object": kind,
        "created": int(time.time()),
        "model": req.model or "default",
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        "metadata": {
            MetaInfo.WEIGHT_VERSION: meta[MetaInfo.WEIGHT_VERSION],
            MetaInfo.WEIGHT_VERSIONS: meta[MetaInfo.WEIGHT_VERSIONS],
        },
    }


def _token_text(engine: Engine, token: int) -> str:
    return engine.tokenizer.decode([token])


def _completion_logprobs(engine: Engine, out: dict) -> dict[str, Any]:
    pairs = out["meta_info"][MetaInfo.OUTPUT_TOKEN_LOGPROBS]
    tops = out["meta_info"].get(MetaInfo.OUTPUT_TOP_LOGPROBS)
    return {
        "text_offset": [-1] * len(pairs),  # as SGLang: not computed
        "token_logprobs": [lp for lp, _, _ in pairs],
        "tokens": [_token_text(engine, t) for _, t, _ in pairs],
        "top_logprobs": [{_token_text(engine, t): lp for lp, t, _ in step} for step in tops] if tops else [],
    }


def _chat_logprobs(engine: Engine, out: dict) -> list[dict[str, Any]]:
    pairs = out["meta_info"][MetaInfo.OUTPUT_TOKEN_LOGPROBS]
    tops = out["meta_info"].get(MetaInfo.OUTPUT_TOP_LOGPROBS) or [[] for _ in pairs]
    return [
        {**_token_logprob(engine, lp, t), "top_logprobs": [_token_logprob(engine, tlp, tt) for tlp, tt, _ in step]}
        for (lp, t, _), step in zip(pairs, tops)
    ]


def _token_logprob(engine: Engine, logprob: float, token: int) -> dict[str, Any]:
    text = _token_text(engine, token)
    return {"token": text, "bytes": list(text.encode()), "logprob": logprob}


# ------------------------------------------------------------------ streaming
