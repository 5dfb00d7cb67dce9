"""HTTP client for one rollout engine: SGLang's native routes, SGLang's field names.

The same client drives a real SGLang server (GPU clusters) and ``rlhpc.engine_server.cpu``
(CPU machines, CI). Routes and request bodies come from ``rlhpc.wire.protocol``, the one place
that names them (tests check it against SGLang's sources).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp
import orjson
import urllib3
import uvloop
from urllib3.connection import HTTPConnection

from rlhpc.errors import RlhpcError
from rlhpc.wire import protocol as P
from rlhpc.wire.engine_key import auth_headers
from rlhpc.wire.protocol import Route

log = logging.getLogger(__name__)


class EngineUnavailable(RlhpcError):
    """The engine did not answer (connection refused/reset, timeout) or answered 5xx: it may be dead."""


class RequestRefused(RlhpcError):
    """The engine or the router answered 4xx: the request itself is wrong, and sent again it would
    be refused again, so it is never retried as an engine failure."""

    def __init__(self, problem: str, fix: str, status: int | None):
        """``status``: the HTTP status answered (None: refused here, before it was sent)."""
        super().__init__(problem, fix)
        self.status = status


# ------------------------------------------------------------------ connections

# A node that loses power sends no reset: a request to it would wait out its whole read timeout
# (minutes for a generation), deaf to the node-loss check. TCP keepalive probes an idle connection
# every few seconds, and a user timeout bounds unacknowledged sends, so the kernel gives up on a
# silent peer in ~15 s while a busy but live server (its kernel answers the probes) is waited for.
CONNECT_TIMEOUT_S = 10.0
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 5, 2, 4
USER_TIMEOUT_MS = 15_000


def _socket_options() -> list[tuple[int, int, int]]:
    options = [*HTTPConnection.default_socket_options, (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
        ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS),
    ):
        if hasattr(socket, name):  # Linux has them all; elsewhere the system's keepalive defaults apply
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


# Bodies are coded with orjson (as SGLang's server does): a rollout's answer is 256 samples with
# their logprobs, ~160 KB of JSON, which the standard library decodes in ~2.7 ms per rollout.

# Connections kept per engine: the pool's request threads and a push's calls share them.
POOL_SIZE = 16
# Prompts a client sends at once, one request each (``EngineClient.generate`` with
# ``per_prompt``), each with its connection (``PromptSender``): the
# engines behind the router batch what arrives together, so this bounds their batches, as
# rlhpc.rollout.sampler.MAX_SAMPLES_PER_REQUEST bounds a request without the router. Well
# under the 1024 open files a node often allows a process, and under the connections a CPU
# engine keeps that have not sent their headers yet (guard.MAX_PENDING).
ROUTER_IN_FLIGHT = 256


def engine_connections(api_key: str | None, size: int = POOL_SIZE) -> urllib3.PoolManager:
    """Connections that notice a silent peer (see above), carrying the engine key. urllib3 itself,
    not requests on top of it: a round trip to the CPU engine took 1.9 ms against 3.3 ms
    (interleaved in one process), and a weight push is several round trips. No retries: a failed request is the pool's to handle."""
    return urllib3.PoolManager(
        maxsize=size, socket_options=_socket_options(), headers=auth_headers(api_key), retries=False
    )


def _keepalive_socket(addr: tuple) -> socket.socket:
    """A connection's socket for aiohttp (``TCPConnector(socket_factory=...)``), with the options above."""
    family, kind, proto, _, _ = addr
    sock = socket.socket(family, kind, proto)
    for level, name, value in _socket_options():
        sock.setsockopt(level, name, value)
    return sock


class SenderClosed(RuntimeError):
    """The client was closed (the job started the router or engine again) while a batch was being sent."""


class PromptSender:
    """A batch's prompts sent at once, one request each, from one event loop on a thread of its
    own, over ``in_flight`` kept-alive connections. Not a thread per prompt: 256 threads taking
    turns at the GIL, each through urllib3's pure-Python HTTP, cost the driver ~0.4 ms of CPU a
    prompt (a rollout of 256: ~100 ms, on the cores the router and the engines need); one loop
    with aiohttp's C parser ~0.15 ms (tools/bench/loop_overhead.py, docs/benchmarks.md)."""

    def __init__(self, api_key: str | None, in_flight: int):
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="prompts", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()
        self._closed = False
        self.session = self.run(self._open(api_key, in_flight))

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    @staticmethod
    async def _open(api_key: str | None, in_flight: int) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=in_flight, socket_factory=_keepalive_socket)
        return aiohttp.ClientSession(
            connector=connector,
            headers={**auth_headers(api_key), "Content-Type": "application/json"},
            cookie_jar=aiohttp.DummyCookieJar(),  # engines and the router set none: not looked up per request
        )

    def run(self, coro: Coroutine) -> Any:
        """``coro``'s result, run on the sender's loop (from any other thread)."""
        with self._lock:
            if self._closed:
                coro.close()
                raise SenderClosed("closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except concurrent.futures.CancelledError as e:  # close() cancelled it
            raise SenderClosed("closed while sending") from e

    @staticmethod
    def timeout(read_timeout_s: float) -> aiohttp.ClientTimeout:
        """A request's: no total (a prompt waits its turn for a connection), the connect and read timeouts."""
        return aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=read_timeout_s)

    async def post(self, url: str, body: bytes, timeout: aiohttp.ClientTimeout) -> tuple[int, bytes]:
        """One request: its status and body."""
        async with self.session.post(url, data=body, timeout=timeout) as r:
            return r.status, await r.read()

    def close(self) -> None:
        """Every send in flight ends (``SenderClosed``), the connections close, the thread ends."""
        with self._lock:
            if self._closed:
                return
            self._closed = True

        async def shut() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            await self.session.close()

        try:
            asyncio.run_coroutine_threadsafe(shut(), self._loop).result(timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


# ------------------------------------------------------------------ client


class EngineClient:
    """One engine's HTTP API, or (``router``) sglang_router's in front of several. Methods raise
    RlhpcError on connection failure, non-200 or success=false (``EngineUnavailable``: no answer
    or 5xx; ``RequestRefused``: 4xx)."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float = 600.0,
        api_key: str | None = None,
        router: bool = False,
        per_prompt: bool | None = None,
        adapter: str | None = None,
    ):
        """``api_key``: the job's engine key (``rlhpc.wire.engine_key``), sent on every request.
        ``adapter``: the LoRA adapter a generation names where it names none (the trained engines'
        ``POLICY_ADAPTER`` with actor.lora.push: adapter).
        ``router``: the URL is sglang_router's. ``per_prompt`` (default: ``router``): a batch goes
        as one request per prompt, all at once, as the router takes it; an engine of a routed pool
        gets them so too, so a request's tokens and logprobs are the same whichever way it went
        (the CPU engine computes a request as one batch)."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.router = router
        self.adapter = adapter
        self.per_prompt = router if per_prompt is None else per_prompt
        self.what = "sglang router" if router else "engine"  # who answered, in errors
        self._http = engine_connections(api_key, ROUTER_IN_FLIGHT if self.per_prompt else POOL_SIZE)
        # urllib3 sends the headers a request names instead of the pool's: the key goes with them
        self._json_headers = {**auth_headers(api_key), "Content-Type": "application/json"}
        # a batch's prompts in flight (made at the first batch)
        self._sender: PromptSender | None = None
        self._sender_lock = threading.Lock()
        self._api_key = api_key
        self._closed = False

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url!r}{', router=True' if self.router else ''})"

    # -------------------------------------------------------------- plumbing

    def _request(
        self,
        method: str,
        route: str,
        body: Any = None,
        timeout_s: float | None = None,
        send_body: bool = True,
        about: str = "",
    ) -> urllib3.BaseHTTPResponse:
        """``about``: what the request is, named in a refusal (e.g. the prompt and its seed)."""
        url = f"{self.base_url}{route}"
        data = orjson.dumps(body) if send_body and body is not None else None
        try:
            resp = self._http.request(
                method,
                url,
                body=data,
                headers=self._json_headers if data is not None else None,  # None: the key alone
                timeout=urllib3.Timeout(connect=CONNECT_TIMEOUT_S, read=timeout_s or self.timeout_s),
            )
        except urllib3.exceptions.HTTPError as e:
            raise self._unreachable(route, e) from e
        self._check_status(route, resp.status, resp.data, about)
        return resp

    def _unreachable(self, route: str, e: BaseException) -> EngineUnavailable:
        return EngineUnavailable(
            f"{self.what} {self.base_url} unreachable on {route}: {type(e).__name__}: {e}",
            f"check that the {self.what} is running (its log names the reason it stopped)",
        )

    def _check_status(self, route: str, status: int, data: bytes, about: str = "") -> None:
        """Raise unless ``status`` is 200 (``data``: the answer's body, its error text)."""
        if status >= 500:  # SGLang answers 5xx when its scheduler died or is shutting down
            raise EngineUnavailable(
                f"{self.what} {self.base_url}{route} answered HTTP {status}: {_error_text(data)}",
                f"see the {self.what}'s log: it may have crashed",
            )
        if 400 <= status < 500:
            raise RequestRefused(
                f"{self.what} {self.base_url}{route} refused {about or 'the request'} with HTTP {status}: "
                f"{_error_text(data)}",
                "the request itself is wrong (sent again it would be refused again): the message names "
                f"what, e.g. a sampling param or a prompt longer than the context; see also the {self.what}'s log",
                status,
            )
        if status != 200:
            raise RlhpcError(
                f"{self.what} {self.base_url}{route} answered HTTP {status}: {_error_text(data)}",
                f"see the message above and the {self.what}'s log",
            )

    def _json(self, method: str, route: str, body: Any = None, timeout_s: float | None = None, about: str = "") -> Any:
        return _decode(self._request(method, route, body, timeout_s, about=about).data)

    def _checked(self, route: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """POST to a route answering {"success", "message"}; raise on success=false."""
        out = self._json("POST", route, body, timeout_s)
        if not isinstance(out, dict) or not out.get("success", False):
            raise RlhpcError(f"engine {self.base_url}{route} failed: {out}", "see the message above and the engine log")
        return out

    # -------------------------------------------------------------- health and info

    def health(self, timeout_s: float = 5.0) -> bool:
        """True when /health answers 200 (False, not an error, when unreachable)."""
        return self._status(Route.HEALTH, timeout_s) == 200

    def _status(self, route: str, timeout_s: float) -> int | None:
        """GET ``route``'s HTTP status, None when unreachable."""
        try:
            return self._http.request("GET", f"{self.base_url}{route}", timeout=timeout_s).status
        except urllib3.exceptions.HTTPError:
            return None

    def health_generate(self, timeout_s: float = 60.0) -> bool:
        return self._status(Route.HEALTH_GENERATE, timeout_s) == 200

    def routed_engines(self) -> int:
        """A router's engines it routes to now (its /readiness; 0 while it answers nothing)."""
        try:
            ready = self._json("GET", P.ROUTER_READINESS, timeout_s=5.0)
        except RlhpcError:
            return 0
        return int(ready.get("healthy_workers", 0)) if isinstance(ready, dict) else 0

    def wait_healthy(self, deadline_s: float, poll_s: float = 0.2) -> None:
        """Block until /health answers 200, for at most ``deadline_s`` seconds from now."""
        end = time.monotonic() + deadline_s
        while not self.health(timeout_s=max(0.5, min(5.0, end - time.monotonic()))):
            if time.monotonic() >= end:
                raise RlhpcError(
                    f"engine {self.base_url} not healthy after {deadline_s:.0f}s",
                    "check the engine log; raise the startup timeout for large models",
                )
            time.sleep(poll_s)

    def _get_new_or_old(self, route: str, old_route: str) -> Any:
        """GET ``route``; on HTTP 404 (an older SGLang) its deprecated name ``old_route``."""
        try:
            return self._json("GET", route)
        except RequestRefused as e:
            if e.status != 404:
                raise
        return self._json("GET", old_route)

    def get_model_info(self) -> dict[str, Any]:
        """/model_info on recent SGLang, /get_model_info (deprecated there) on older ones."""
        return self._get_new_or_old(Route.MODEL_INFO, Route.MODEL_INFO_OLD)

    def get_server_info(self) -> dict[str, Any]:
        """/server_info on recent SGLang, /get_server_info (deprecated there) on older ones."""
        return self._get_new_or_old(Route.SERVER_INFO, Route.SERVER_INFO_OLD)

    def get_weight_version(self) -> str:
        """The loaded weights' version, from the model info (SGLang has no route of its own for it)."""
        return self.get_model_info()["weight_version"]

    # -------------------------------------------------------------- generation

    def generate(
        self,
        input_ids: list[int] | list[list[int]] | None = None,
        text: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        return_logprob: bool | list[bool] = False,
        rid: str | list[str] | None = None,
        timeout_s: float | None = None,
        logprob_start_len: int | list[int] | None = None,
        image_data: list[list[str]] | None = None,
        lora_path: str | list[str | None] | None = None,
        return_routed_experts: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """One dict for a single prompt, a list for a batch (as SGLang answers). ``logprob_start_len``
        (with ``return_logprob``): the prompt tokens' logprobs from there too. ``image_data``: a
        vision-language model's images, a list per prompt (``rlhpc.wire.protocol.GenerateReqInput``).
        ``lora_path``: the loaded LoRA adapter to generate with, by name (None: the base model),
        one for every prompt or one per prompt. ``return_routed_experts``: each token's experts
        (a MoE model; ``rlhpc.wire.protocol.routed_experts`` reads them).

        ``per_prompt`` (through the router): a batch goes as one request per prompt, all at once
        (sglang_router refuses a batch with per-prompt sampling params, and they carry each
        sample's seed; see ``rlhpc.wire.protocol.per_prompt``); the answers come back in prompt order."""
        if (input_ids is None) == (text is None):
            raise RlhpcError("generate needs exactly one of input_ids and text", "pass token ids or a prompt string")
        req = P.GenerateReqInput(
            text=text,
            input_ids=input_ids,
            sampling_params=sampling_params if sampling_params is not None else {},
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            rid=rid,
            image_data=image_data,
            lora_path=lora_path if lora_path is not None else self.adapter,
            return_routed_experts=return_routed_experts,
        )
        if not self.per_prompt:
            return self._generate(req, timeout_s, _describe(req))
        prompts = P.per_prompt(req)
        about = [_describe(p, i, len(prompts)) for i, p in enumerate(prompts)]
        for p, what in zip(prompts, about):
            lost = P.lost_through_router(p.sampling_params)
            if lost:  # refused on an engine of a routed pool too: the next request may take the router
                raise RequestRefused(
                    f"{what} asks for sampling param(s) {', '.join(lost)}, which sglang_router "
                    f"{P.ROUTER_VERSION} does not pass on to the engines (refused before sending)",
                    "leave them out, or set rollout.sglang.router: false to send requests to the engines directly",
                    status=None,
                )
        if not P.is_batch(req):
            return self._generate(prompts[0], timeout_s, about[0])
        bodies = [orjson.dumps(P.generate_body(p)) for p in prompts]
        try:
            return self._prompt_sender().run(self._send_all(bodies, about, timeout_s or self.timeout_s))
        except SenderClosed as e:  # the job started the router (or engine) again meanwhile
            raise EngineUnavailable(
                f"{self.what} {self.base_url} was replaced while a batch was being sent", "send it again"
            ) from e

    def _prompt_sender(self) -> PromptSender:
        with self._sender_lock:
            if self._closed:
                raise SenderClosed("closed")
            if self._sender is None:
                self._sender = PromptSender(self._api_key, ROUTER_IN_FLIGHT)
            return self._sender

    async def _send_all(self, bodies: list[bytes], about: list[str], timeout_s: float) -> list[Any]:
        """Every prompt's answer, in order (on the sender's loop). The first to fail ends the send:
        the prompts not answered yet are not waited for (nor sent, if still waiting for a connection)."""
        sender, url = self._sender, f"{self.base_url}{Route.GENERATE}"
        timeout = sender.timeout(timeout_s)

        async def one(body: bytes, what: str) -> Any:
            try:
                status, data = await sender.post(url, body, timeout)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise self._unreachable(Route.GENERATE, e) from e
            self._check_status(Route.GENERATE, status, data, what)
            return _decode(data)

        tasks = [asyncio.ensure_future(one(b, a)) for b, a in zip(bodies, about)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:  # the first in prompt order among those that failed
                raise failed[0].exception()
            return [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()

    def _generate(self, req: P.GenerateReqInput, timeout_s: float | None, about: str) -> Any:
        return self._json("POST", Route.GENERATE, P.generate_body(req), timeout_s, about)

    def classify(self, input_ids: list[list[int]], timeout_s: float | None = None) -> list[float]:
        """A reward model's score of each input (its first label), through SGLang's /classify."""
        req = P.EmbeddingReqInput(input_ids=input_ids)
        answers = self._json("POST", Route.CLASSIFY, P.body(req, drop_none=("text", "input_ids", "rid")), timeout_s)
        if isinstance(answers, dict):  # SGLang answers a batch of one as one dict
            answers = [answers]
        if not isinstance(answers, list) or len(answers) != len(input_ids):
            raise RlhpcError(
                f"engine {self.base_url}{Route.CLASSIFY} answered {str(answers)[:200]} to {len(input_ids)} inputs",
                "serve a *ForSequenceClassification model on the reward engines (SGLang: --is-embedding)",
            )
        return [float(a[P.EMBEDDING][0]) for a in answers]

    def flush_cache(self) -> None:
        """SGLang's /flush_cache; HTTP 400 (an RlhpcError) while requests are running or queued."""
        self._request("POST", Route.FLUSH_CACHE)  # no body

    def pause_generation(self, mode: str = "abort") -> None:
        """Modes: abort (SGLang's default) | retract | in_place; older SGLang ignores the body."""
        self._json("POST", Route.PAUSE_GENERATION, P.body(P.PauseGenerationReqInput(mode=mode)))

    def continue_generation(self) -> None:
        self._json("POST", Route.CONTINUE_GENERATION, P.body(P.ContinueGenerationReqInput()))

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._request("POST", Route.ABORT_REQUEST, P.body(P.AbortReq(rid=rid, abort_all=abort_all)))

    # -------------------------------------------------------------- weights

    # The three weight updates take their request as the protocol defines it (fields and defaults
    # written once, in rlhpc.wire.protocol), not as keyword arguments repeating them.

    def init_weights_update_group(self, req: P.InitWeightsUpdateGroupReqInput) -> dict[str, Any]:
        return self._checked(Route.INIT_WEIGHTS_UPDATE_GROUP, P.body(req))

    def destroy_weights_update_group(self, group_name: str, timeout_s: float | None = None) -> dict[str, Any]:
        req = P.DestroyWeightsUpdateGroupReqInput(group_name=group_name)
        return self._checked(Route.DESTROY_WEIGHTS_UPDATE_GROUP, P.body(req), timeout_s)

    def begin_weight_update(self, selector: str = "all") -> dict[str, Any]:
        """Open SGLang's weight-update session (refused while one is open); the updates below are
        refused outside one."""
        return self._checked(Route.BEGIN_WEIGHT_UPDATE, P.body(P.BeginWeightUpdateReqInput(selector=selector)))

    def end_weight_update(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Close the session (refused when none is open)."""
        return self._checked(Route.END_WEIGHT_UPDATE, P.body(P.EndWeightUpdateReqInput()), timeout_s)

    def update_weights_from_distributed(self, req: P.UpdateWeightsFromDistributedReqInput) -> dict[str, Any]:
        return self._checked(Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED, P.body(req))

    def update_weights_from_tensor(self, req: P.UpdateWeightsFromTensorReqInput) -> dict[str, Any]:
        return self._checked(Route.UPDATE_WEIGHTS_FROM_TENSOR, P.body(req))

    def update_weight_version(self, version: str, abort_all_requests: bool = False) -> dict[str, Any]:
        """Set the version alone (after SGLang refused a busy flush, see ``P.FLUSH_BUSY``)."""
        req = P.UpdateWeightVersionReqInput(new_version=version, abort_all_requests=abort_all_requests)
        return self._checked(Route.UPDATE_WEIGHT_VERSION, P.body(req))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        req = P.GetWeightsByNameReqInput(name=name, truncate_size=truncate_size)
        return self._json("POST", Route.GET_WEIGHTS_BY_NAME, P.body(req))

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """Tags: "weights", "kv_cache"; None = all."""
        req = P.ReleaseMemoryOccupationReqInput(tags=tags)
        self._json("POST", Route.RELEASE_MEMORY_OCCUPATION, P.body(req))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        req = P.ResumeMemoryOccupationReqInput(tags=tags)
        self._json("POST", Route.RESUME_MEMORY_OCCUPATION, P.body(req))

    # -------------------------------------------------------------- LoRA adapters

    def _lora(self, route: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, str]:
        """POST to an adapter route; the adapters loaded after it (name -> path). SGLang answers a
        refusal with HTTP 400 and ``{"success": false, "error_message"}``: raised as RequestRefused."""
        out = self._json("POST", route, body, timeout_s, about=f"adapter {body.get('lora_name')!r}")
        if not isinstance(out, dict) or not out.get("success", False):
            raise RlhpcError(f"engine {self.base_url}{route} failed: {out}", "see the message above and the engine log")
        return dict(out.get("loaded_adapters") or {})

    def load_lora_adapter(self, req: P.LoadLoRAAdapterReqInput, timeout_s: float | None = None) -> dict[str, str]:
        """An adapter from a PEFT directory the engine reads (on a shared file system for engines
        on other nodes), held under ``req.lora_name``; refused if that name is loaded."""
        return self._lora(Route.LOAD_LORA_ADAPTER, P.body(req), timeout_s)

    def load_lora_adapter_from_tensors(
        self, req: P.LoadLoRAAdapterFromTensorsReqInput, timeout_s: float | None = None
    ) -> dict[str, str]:
        """A pushed adapter: its PEFT config and tensors ({PEFT name: tensor}, serialized by
        ``rlhpc.weights.tensor_transport.serialize_tensor_dict`` for an engine on this node, one
        payload per TP rank), held under ``req.lora_name``; refused if that name is loaded."""
        return self._lora(Route.LOAD_LORA_ADAPTER_FROM_TENSORS, P.body(req), timeout_s)

    def unload_lora_adapter(self, lora_name: str, timeout_s: float | None = None) -> dict[str, str]:
        """Drop an adapter (after the requests using it finished); refused for a name not loaded."""
        return self._lora(
            Route.UNLOAD_LORA_ADAPTER, P.body(P.UnloadLoRAAdapterReqInput(lora_name=lora_name)), timeout_s
        )

    def close(self) -> None:
        with self._sender_lock:
            self._closed = True
            sender, self._sender = self._sender, None
        if sender is not None:  # a batch being sent ends with EngineUnavailable
            sender.close()
        self._http.clear()


def _describe(req: P.GenerateReqInput, i: int = 0, n: int = 1) -> str:
    """A /generate request as an error names it: prompt ``i`` of ``n``, its length, seed and rid."""
    prompt = req.text if req.text is not None else req.input_ids
    if P.is_batch(req):
        return f"a batch of {len(prompt)} prompts"
    params = req.sampling_params if isinstance(req.sampling_params, dict) else {}
    details = [f"{len(prompt)} {'characters' if req.text is not None else 'tokens'}"]
    if "sampling_seed" in params:
        details.append(f"sampling_seed {params['sampling_seed']}")
    if req.rid is not None:
        details.append(f"rid {req.rid}")
    return f"{f'prompt {i} of {n}' if n > 1 else 'a prompt'} ({', '.join(details)})"


def _decode(data: bytes) -> Any:
    """An answer's JSON (None when empty; its text when no JSON)."""
    if not data:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode(errors="replace")


def _error_text(data: bytes) -> str:
    """SGLang's error bodies: {"error": {"message"}}, {"message"}, {"detail"} or plain text."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode(errors="replace").strip()[:2000]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail"):
            if key in body:
                return str(body[key])
    return str(body)[:2000]
