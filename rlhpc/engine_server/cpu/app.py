"""The CPU engine's HTTP app: SGLang's native routes (``rlhpc.wire.protocol.Route``) over an
``Engine``, and its OpenAI-compatible ones (``openai_routes``).

Request bodies are validated as the protocol's dataclasses (SGLang's field names; fields SGLang
clients may send and we do not use are ignored). /generate bodies are read by hand, since SGLang
answers a single prompt with a dict and a batch with a list.

With a key (``build_app(..., api_key=KEY)``) every request, to every path but ``GET /health``,
must carry ``Authorization: Bearer KEY`` or is answered 401: the check is middleware in front of
the router, so no route can be added without it. /health is exempt as in SGLang (probes, and
sglang_router's health checks, carry no key). SGLang exempts every path starting /health, /ready
or /metrics; /health_generate keeps the key here.

Where SGLang is strict, so is this server (docs/architecture/engines.md has the table):
/health and /health_generate run a one-token generation and answer 200 once the engine made
progress, 503 when it made none within ``SGLANG_HEALTH_CHECK_TIMEOUT`` seconds (a paused
engine); /health answers 200 at once when ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` is off.
What kills SGLang's scheduler (resuming memory that is not released, releasing it twice or
while a batch runs) ends this server's process without an answer, as SGLang's server dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError
from starlette.routing import Route as StarletteRoute

from rlhpc.engine_server.cpu.batching import Batcher
from rlhpc.engine_server.cpu.openai_routes import add_openai_routes
from rlhpc.engine_server.cpu.requests import Item
from rlhpc.engine_server.cpu.runner import Engine, SchedulerDied
from rlhpc.util.http_guard import trust
from rlhpc.wire import protocol as P
from rlhpc.wire import switches
from rlhpc.wire.engine_key import HEADER, authorized
from rlhpc.wire.protocol import PAUSE_MODES, EngineError, Route

log = logging.getLogger("rlhpc.cpu_server")

_PAUSE = TypeAdapter(P.PauseGenerationReqInput)


# SGLang's /health: the generation it queues, and how often it looks for progress
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
HEALTH_INPUT_IDS = [0]
HEALTH_SAMPLING_PARAMS = {"max_new_tokens": 1, "temperature": 0.0}
HEALTH_POLL_S = 1.0


def die(reason: str) -> NoReturn:
    """The process ends at once, as SGLang's server does when its scheduler dies: the request
    in flight gets no answer, and the next ones find no server."""
    log.critical("Scheduler hit an exception: %s; the server exits (as SGLang's does)", reason)
    logging.shutdown()
    os._exit(1)


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


# FastAPI (0.165 on) looks up an OpenTelemetry provider on every request, environment reads
# included: ~4 % of the engine's time on a routed rollout's 256 requests. The engine exports none.
_NO_TELEMETRY = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)
# ASGI hands header names lowercased
_HEADER_NAME = HEADER.lower().encode("latin-1")
# SGLang's key middleware answers a refused request with this body (sglang/srt/utils/auth.py)
UNAUTHORIZED = {"error": "Unauthorized"}


class RequireKey:
    """ASGI middleware: a request without the engine key never reaches a route (401)."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            header = next((v for k, v in scope["headers"] if k == _HEADER_NAME), None)
            if authorized(header.decode("latin-1") if header is not None else None, self.api_key):
                trust(scope)  # a key holder's connection: the guard never sheds it for a newer one
            elif not (scope["path"] == Route.HEALTH and scope["method"] == "GET"):
                # kept open after the 401, as SGLang's (sglang/srt/utils/auth.py): the HTTP guard
                # bounds what a keyless caller holds, as it does for the open /health
                await JSONResponse(UNAUTHORIZED, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ModelUpdateLock:
    """SGLang's ``model_update_lock`` (``sglang/srt/utils/aio_rwlock.py``): every generation
    request holds it shared from after the pause until answered; a weight call on an engine that
    is not paused takes it alone, so it waits until every request in flight has finished, and a
    request arriving meanwhile waits behind it (writers first)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self.readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting_writers += 1
            try:
                await self._cond.wait_for(lambda: not self._writer and not self.readers)
                self._writer = True
            finally:
                self._waiting_writers -= 1
        try:
            yield
        finally:
            async with self._cond:
                self._writer = False
                self._cond.notify_all()

    async def drained(self) -> None:
        """Until no request holds the lock (SGLang's pause in mode abort waits for this)."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self.readers)


class Workers:
    """The engine's two worker threads: generation batches one at a time, and control calls
    (weights, memory) in arrival order. Routes hand their work to them and await it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.gen = ThreadPoolExecutor(max_workers=1, thread_name_prefix="generate")
        # an OpenAI request's chat template and rows: never on the event loop, which serves /health
        self.prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")
        self.ctl = ThreadPoolExecutor(max_workers=1, thread_name_prefix="control")
        self.ctl_queued = 0  # control calls handed to ctl and not yet back on the event loop
        self.weight_calls_waiting = 0  # weight calls waiting for model_update behind another
        self.model_update = ModelUpdateLock()
        self.resumed = asyncio.Event()  # cleared while generation is paused
        self.resumed.set()

    @staticmethod
    async def on(pool: ThreadPoolExecutor, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def generate(self, fn: Any, *args: Any) -> Any:
        """A batch, as SGLang takes a request: after the pause, holding ``model_update`` shared."""
        await self.resumed.wait()
        async with self.model_update.reader():
            self.engine.in_flight += 1
            try:
                return await self.on(self.gen, fn, *args)
            finally:
                self.engine.in_flight -= 1

    async def weight_call(self, fn: Any, *args: Any, quick: bool = False) -> JSONResponse:
        """A weight-update session call or update, as SGLang's tokenizer manager runs them: at
        once on a paused engine, else holding ``model_update`` alone (after the requests in flight)."""
        if not self.resumed.is_set():
            return await self.success_route(fn, *args, quick=quick)
        self.weight_calls_waiting += 1
        waiting = True
        try:
            async with self.model_update.writer():
                self.weight_calls_waiting -= 1
                waiting = False
                return await self.success_route(fn, *args, quick=quick)
        finally:
            if waiting:  # cancelled while waiting (the caller went away)
                self.weight_calls_waiting -= 1

    async def resolve_adapters(self, items: list[Item]) -> None:
        """The rows' LoRA adapters, as SGLang's tokenizer manager resolves them: once the pause is over."""
        await self.resumed.wait()
        self.engine.resolve_adapters(items)

    async def prepare(self, fn: Any, *args: Any) -> Any:
        return await self.on(self.prep, fn, *args)

    async def control(self, fn: Any, *args: Any, quick: bool = False) -> Any:
        """A control call, in order with the others. ``quick`` (a state flip, never blocking) runs
        right here when no other is queued or running: the same order, without the thread hop
        that made begin/end cost 2.5 round trips; behind a pending update it waits its turn."""
        if quick and not self.ctl_queued:
            return fn(*args)
        self.ctl_queued += 1
        try:
            return await self.on(self.ctl, fn, *args)
        finally:
            self.ctl_queued -= 1

    async def success_route(self, fn: Any, *args: Any, quick: bool = False) -> JSONResponse:
        """A control call answered as SGLang answers its weight routes: ``{success, message}``."""
        try:
            message = await self.control(fn, *args, quick=quick)
        except EngineError as e:  # a refusal: its message as SGLang words it
            log.warning("%s refused: %s", getattr(fn, "__name__", fn), e)
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        except Exception as e:  # SGLang answers these routes with success=false, not a raise
            log.warning("%s failed: %s", getattr(fn, "__name__", fn), e)
            return JSONResponse({"success": False, "message": f"{type(e).__name__}: {e}"}, status_code=400)
        return JSONResponse({"success": True, "message": message})

    async def batch_route(self, raw: bytes, what: str, run: Any) -> Response:
        """A /generate or /classify body: a JSON object, run as one batch by ``run(body)`` (a
        coroutine). A single prompt is answered with a dict, a batch with a list, as SGLang."""
        try:
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise EngineError("the request body must be a JSON object")
            outs, single = await run(body)
        except EngineError as e:
            return error_response(str(e))
        except ValueError as e:  # bad JSON (orjson's error is one), bad numbers
            return error_response(f"{type(e).__name__}: {e}")
        except Exception as e:
            log.exception("%s failed", what)
            return error_response(f"{type(e).__name__}: {e}", status=500)
        # orjson, as SGLang's server: a batch's answers are ~160 KB, 3.7 ms with the standard library
        return Response(orjson.dumps(outs[0] if single else outs), media_type="application/json")


def build_app(
    engine: Engine,
    address: dict[str, Any],
    api_key: str | None = None,
    env: Mapping[str, str] = os.environ,
) -> FastAPI:
    """FastAPI app with SGLang's native routes. ``address`` holds host/port once bound.
    ``api_key``: required on every request (None: no check; the server allows that on loopback only).
    ``env``: where SGLang's switches are read (``rlhpc.wire.switches``)."""
    app = FastAPI(openapi_url=None, **_NO_TELEMETRY)
    workers = Workers(engine)
    # /generate requests waiting together share a batch, unless the engine is deterministic
    app.state.batcher = Batcher(
        lambda items, seq: workers.generate(engine.generate, items, seq), merge=not engine.deterministic
    )
    app.state.engine = engine
    app.state.flags = {"shutting_down": False}

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(f"invalid request to {request.url.path}: {exc.errors()}")

    _add_health_and_info(app, engine, address, workers, env)
    _add_generation(app, engine, workers)
    _add_weights_and_memory(app, engine, workers)

    async def generate_items(items: list[Item], seq: int) -> list[dict[str, Any]]:
        await workers.resolve_adapters(items)
        return await workers.generate(engine.generate, items, seq)

    add_openai_routes(
        app, engine, generate_items, workers.prepare
    )  # behind the same key (the middleware covers every path)
    # added last, so outermost of ours: no request reaches a route without the key, /generate's
    # shortcut (HotRoute) included
    if api_key is not None:
        app.add_middleware(RequireKey, api_key=api_key)
    return app


def _add_health_and_info(
    app: FastAPI, engine: Engine, address: dict[str, Any], workers: Workers, env: Mapping[str, str]
) -> None:
    state = app.state.flags
    generation = switches.env_bool(env, switches.HEALTH_GENERATION, True)
    timeout_s = switches.health_check_timeout_s(env)

    async def health_generation(rid: str) -> None:
        if engine.classifier:  # SGLang scores the one token on an embedding model
            await workers.generate(engine.classify, [HEALTH_INPUT_IDS])
            return
        items, _ = engine.normalize(
            {"input_ids": HEALTH_INPUT_IDS, "sampling_params": HEALTH_SAMPLING_PARAMS, "rid": rid}
        )
        await workers.generate(engine.generate, items, engine.next_seq())

    @app.get(Route.HEALTH)
    @app.get(Route.HEALTH_GENERATE)
    async def health(request: Request) -> Response:
        """SGLang's: healthy once the engine makes progress (any batch's decoding step) after
        the check began; the one-token generation it queues makes some on an idle engine."""
        if state["shutting_down"]:
            return Response(status_code=503)
        if not generation and request.url.path == Route.HEALTH:
            return Response(status_code=200)
        tic = time.monotonic()
        rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"
        task = asyncio.ensure_future(health_generation(rid))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its failure shows as no progress
        while time.monotonic() < tic + timeout_s:
            await asyncio.sleep(HEALTH_POLL_S)
            if engine.last_progress > tic:
                return Response(status_code=200)
        engine.abort(rid)  # queued behind a pause: dropped when it runs
        log.error("Health check failed: no progress for %d s (paused, or busy with nothing)", timeout_s)
        return Response(status_code=503)

    @app.get(Route.MODEL_INFO_OLD)
    @app.get(Route.MODEL_INFO)
    async def get_model_info() -> dict[str, Any]:
        return engine.model_info()

    @app.get(Route.SERVER_INFO_OLD)
    @app.get(Route.SERVER_INFO)
    async def get_server_info() -> dict[str, Any]:
        info = engine.server_info(address.get("host", ""), address.get("port", 0))
        # control calls (weights, memory) handed to the control thread or waiting for the model
        # behind an update, not yet answered: a test holds an update and sees a later call queue
        # behind it, not a timeout
        info["internal_states"][0]["control_calls_queued"] = workers.ctl_queued + workers.weight_calls_waiting
        return info


class RawRoute:
    """A route's ASGI app without FastAPI's per-request machinery (its request object, exit
    stacks, exception wrappers): ``handle(receive)`` reads the body and answers. For /generate,
    which the router sends one prompt at a time: 256 requests a rollout, each of which cost the
    engine ~0.3 ms of its one core in the HTTP stack, over twice the tiny model's generation
    (docs/benchmarks.md, 2026-12-07)."""

    def __init__(self, handle: Any):
        self.handle = handle

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        response = await self.handle(receive)
        if response is not None:  # None: the client went away before its body arrived
            await response(scope, receive, send)


class HotRoute:
    """ASGI middleware: a request for ``route`` (a ``RawRoute``'s, with its methods) goes straight
    to it, past FastAPI's exception and exit-stack middleware and the route table, which cost as
    much again as the route. Inside the key middleware (see ``build_app``)."""

    def __init__(self, app: Any, route: StarletteRoute):
        self.app, self.route = app, route

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        route = self.route
        if scope["type"] == "http" and scope["path"] == route.path and scope["method"] in route.methods:
            await route.app(scope, receive, send)
        else:
            await self.app(scope, receive, send)


async def read_body(receive: Any) -> bytes | None:
    """A request's whole body from ASGI messages (None when the client disconnected)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _add_generation(app: FastAPI, engine: Engine, workers: Workers) -> None:
    async def generate(receive: Any) -> Response | None:
        seq = engine.next_seq()  # arrival order decides what an abort_all covers
        raw = await read_body(receive)
        if raw is None:
            return None

        async def run(body: dict) -> tuple[list[dict], bool]:
            items, single = engine.normalize(body)
            await workers.resolve_adapters(items)
            return await app.state.batcher.generate(items, seq), single

        return await workers.batch_route(raw, "generate", run)

    route = StarletteRoute(Route.GENERATE, RawRoute(generate), methods=["POST", "PUT"])
    app.router.routes.append(route)  # in the table too: what the app serves, and where HotRoute points
    app.add_middleware(HotRoute, route=route)

    @app.api_route(Route.CLASSIFY, methods=["POST", "PUT"])
    async def classify(request: Request) -> Any:
        async def run(body: dict) -> tuple[list[dict], bool]:
            inputs, single = engine.normalize_classify(body)
            return await workers.generate(engine.classify, inputs), single  # in turn with generation batches

        return await workers.batch_route(await request.body(), "classify", run)

    @app.api_route(Route.FLUSH_CACHE, methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0) -> Response:
        # Nothing is cached between requests (no radix cache), but as SGLang's the flush goes
        # through only on an idle engine (Engine.flushable); ``timeout``: wait that long for it.
        deadline = asyncio.get_running_loop().time() + max(0.0, timeout)
        while not engine.flushable():
            if asyncio.get_running_loop().time() >= deadline:
                return Response(content=P.FLUSH_FAILED, status_code=400)
            await asyncio.sleep(0.01)
        return Response(content="Cache flushed.\n", status_code=200)

    @app.post(Route.PAUSE_GENERATION)
    async def pause_generation(request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            req = _PAUSE.validate_json(raw) if raw.strip() else P.PauseGenerationReqInput()
        except ValidationError as e:  # a body that is no PauseGenerationReqInput: refused, as SGLang's 422
            return error_response(f"invalid request to {Route.PAUSE_GENERATION}: {e.errors(include_url=False)}")
        if req.mode not in PAUSE_MODES:
            return error_response(f"unknown pause mode {req.mode!r}")
        engine.pause_mode = req.mode
        engine.running.clear()
        workers.resumed.clear()  # new requests wait before the model-update lock, as SGLang's
        if req.mode == "abort":
            engine.abort(abort_all=True)
            await workers.model_update.drained()  # SGLang answers once none is left in flight
        # in_place/retract: the running batch waits between two decoding steps and goes on with
        # the weights loaded by then (retract: its KV cache recomputed with them, see Engine._step_hook)
        log.info("generation paused (%s)", req.mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post(Route.CONTINUE_GENERATION)
    async def continue_generation() -> JSONResponse:
        engine.running.set()
        workers.resumed.set()
        log.info("generation continued")
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post(Route.ABORT_REQUEST)
    async def abort_request(req: P.AbortReq) -> Response:
        engine.abort(req.rid, req.abort_all)
        return Response(status_code=200)


def _add_weights_and_memory(app: FastAPI, engine: Engine, workers: Workers) -> None:
    success = workers.success_route

    @app.post(Route.INIT_WEIGHTS_UPDATE_GROUP)
    async def init_weights_update_group(req: P.InitWeightsUpdateGroupReqInput) -> JSONResponse:
        return await success(engine.init_group, req)

    @app.post(Route.DESTROY_WEIGHTS_UPDATE_GROUP)
    async def destroy_weights_update_group(req: P.DestroyWeightsUpdateGroupReqInput) -> JSONResponse:
        return await success(engine.destroy_group, req.group_name)

    @app.post(Route.BEGIN_WEIGHT_UPDATE)
    async def begin_weight_update(req: P.BeginWeightUpdateReqInput) -> JSONResponse:
        return await workers.weight_call(engine.begin_weight_update, req, quick=True)

    @app.post(Route.END_WEIGHT_UPDATE)
    async def end_weight_update(req: P.EndWeightUpdateReqInput) -> JSONResponse:
        return await workers.weight_call(engine.end_weight_update, quick=True)

    @app.post(Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED)
    async def update_weights_from_distributed(req: P.UpdateWeightsFromDistributedReqInput) -> JSONResponse:
        if req.abort_all_requests:  # before waiting for them, as SGLang
            engine.abort(abort_all=True)
        return await workers.weight_call(engine.update_from_distributed, req)

    @app.post(Route.UPDATE_WEIGHTS_FROM_TENSOR)
    async def update_weights_from_tensor(req: P.UpdateWeightsFromTensorReqInput) -> JSONResponse:
        if req.abort_all_requests:  # before waiting for them, as SGLang
            engine.abort(abort_all=True)
        return await workers.weight_call(engine.update_from_tensor, req)

    @app.post(Route.UPDATE_WEIGHT_VERSION)
    async def update_weight_version(req: P.UpdateWeightVersionReqInput) -> JSONResponse:
        if req.abort_all_requests:  # and then at once, without the lock (SGLang's route says so)
            engine.abort(abort_all=True)
        await workers.control(engine.set_weight_version, req.new_version, quick=True)
        message = f"Weight version updated to {req.new_version}"
        return JSONResponse({"success": True, "message": message, "new_version": req.new_version})

    @app.api_route(Route.GET_WEIGHTS_BY_NAME, methods=["GET", "POST"])
    async def get_weights_by_name(req: P.GetWeightsByNameReqInput) -> Any:
        try:
            return JSONResponse(await workers.control(engine.get_weights_by_name, req.name, req.truncate_size))
        except EngineError as e:
            return error_response(str(e))

    async def memory(fn: Any, tags: list[str] | None) -> Any:
        try:
            await workers.control(fn, tags)
        except EngineError as e:
            return error_response(str(e))
        except SchedulerDied as e:
            die(str(e))
        return None

    async def lora(fn: Any, req: Any) -> JSONResponse:
        """An adapter call, in order with the other control calls, answered as SGLang's
        LoRAUpdateOutput: 200, or 400 with ``success`` false and the reason."""
        try:
            loaded = await workers.control(fn, req)
        except EngineError as e:
            log.warning("%s refused: %s", fn.__name__, e)
            listing = engine.adapters.listing() if engine.adapters.enabled else None
            out = P.LoRAUpdateOutput(success=False, error_message=str(e), loaded_adapters=listing)
            return JSONResponse(P.body(out), status_code=400)
        return JSONResponse(P.body(P.LoRAUpdateOutput(success=True, error_message="", loaded_adapters=loaded)))

    @app.post(Route.LOAD_LORA_ADAPTER)
    async def load_lora_adapter(req: P.LoadLoRAAdapterReqInput) -> JSONResponse:
        return await lora(engine.load_lora_adapter, req)

    @app.post(Route.LOAD_LORA_ADAPTER_FROM_TENSORS)
    async def load_lora_adapter_from_tensors(req: P.LoadLoRAAdapterFromTensorsReqInput) -> JSONResponse:
        return await lora(engine.load_lora_adapter_from_tensors, req)

    @app.post(Route.UNLOAD_LORA_ADAPTER)
    async def unload_lora_adapter(req: P.UnloadLoRAAdapterReqInput) -> JSONResponse:
        return await lora(engine.unload_lora_adapter, req)

    @app.api_route(Route.RELEASE_MEMORY_OCCUPATION, methods=["GET", "POST"])
    async def release_memory_occupation(req: P.ReleaseMemoryOccupationReqInput) -> Any:
        return await memory(engine.release, req.tags)

    @app.api_route(Route.RESUME_MEMORY_OCCUPATION, methods=["GET", "POST"])
    async def resume_memory_occupation(req: P.ResumeMemoryOccupationReqInput) -> Any:
        return await memory(engine.resume, req.tags)
