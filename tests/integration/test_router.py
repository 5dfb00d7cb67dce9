"""sglang_router, the real one (0.3.2), in front of CPU engines: it serves only a client with the
engine key and no command line of its process tree carries the key (issue 32, item 3); batches
go through it as the loop sends them, and what an engine receives through it is what was sent
(issue 40). Where the router's own behaviour is asserted, an engine that records what it gets
stands behind it (``Recorder``): the router is the thing under test there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import psutil
import pytest
import urllib3
from support.engines import engine_client, start_server, stop_server
from support.sglang_wheel import request_structs

from rlhpc.engine_server import sglang as sg
from rlhpc.engine_server.sglang import Router
from rlhpc.wire import protocol as P
from rlhpc.wire.client import EngineClient, EngineUnavailable, RequestRefused
from rlhpc.wire.engine_key import new_key
from rlhpc.wire.protocol import Route

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pool(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Router, str, list[str], Path]]:
    """Two CPU engines sharing one key, the router in front, each started as a ``deterministic: true``
    job starts it (SGLang's switches of ``engine_env``, seeds honoured; the router's judgement
    off): (router, key, engine URLs, work dir)."""
    work = tmp_path_factory.mktemp("router")
    key = new_key(work / "engine_key")
    env, args = sg.engine_env(os.environ), ["--enable-deterministic-inference"]
    engines = [start_server(model_path, work, f"e{i}", args, work / "engine_key", env) for i in range(2)]
    router = Router("127.0.0.1", work / "router.log", 60.0, work / "engine_key")
    try:
        router.start([u for _, u, _ in engines])
        yield router, key, [u for _, u, _ in engines], work
    finally:
        router.stop()
        for proc, _, _ in engines:
            stop_server(proc)


def test_the_router_serves_with_the_key_and_no_command_line_carries_it(pool) -> None:
    router, key, _, work = pool
    tree = [psutil.Process(router.proc.pid), *psutil.Process(router.proc.pid).children(recursive=True)]
    for proc in tree:
        assert key not in " ".join(proc.cmdline()) and key not in str(proc.environ())
    assert "--api-key-file" in router.proc.args and key not in " ".join(router.proc.args)  # as started
    assert set(sg.ROUTER_JUDGEMENT_OFF) <= set(router.proc.args)  # no health checks, circuit breaker, retries
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert key not in ps

    client = EngineClient(router.url, timeout_s=60, api_key=key, router=True)
    outs = [client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 1.0,
                                                                  "sampling_seed": s}) for s in range(4)]  # fmt: skip
    assert all(1 <= len(o["output_ids"]) == o["meta_info"]["completion_tokens"] <= 4 for o in outs)
    body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}'
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = urllib3.request("POST", router.url + "/generate", body=body, headers=headers, timeout=30, retries=False)
        assert resp.status == 401, resp.data[:200]
    assert key not in (work / "router.log").read_text()


def test_the_router_ends_when_the_driver_that_started_it_is_killed(pool) -> None:
    """The router runs in a session of its own, which a SIGKILL of the driver's group misses (one
    was found serving, orphaned, after a killed local run): it watches the driver (--parent-pid)."""
    router, _, urls, work = pool
    assert router.proc.args[router.proc.args.index("--parent-pid") + 1] == str(os.getpid())
    # a stand-in driver: starts a router as Router.start does, says its pid, and is SIGKILLed
    code = (
        "import os, subprocess, sys, time\n"
        "from rlhpc.engine_server import sglang as sg\n"
        f"cmd = sg.router_command(sys.executable, {urls!r}, '127.0.0.1', sg.free_port('127.0.0.1'), "
        f"sg.free_port('127.0.0.1'), None, str(os.getpid()))\n"
        "p = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\ntime.sleep(600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    routed = psutil.Process(int(driver.stdout.readline()))
    deadline = time.monotonic() + 60
    while not routed.children() and time.monotonic() < deadline:  # until its watcher is forked
        time.sleep(0.05)
    group = [routed, *routed.children(recursive=True)]  # the router and its watcher
    assert routed.is_running() and len(group) == 2
    driver.kill()
    driver.wait()
    gone, alive = psutil.wait_procs(group, timeout=60)
    for p in alive:
        p.kill()
    assert not alive, [p.cmdline() for p in alive]


# What the router answers without the key (sglang_router 0.3.2 has no switch to put them behind
# it or turn them off): its liveness and readiness, the engine count, the served model's name.
# Nothing generates, nothing changes (its /health_generate asks no engine); its /engine_metrics
# finds no engine /metrics (rlhpc starts none). docs/architecture/who-can-steer.md.
KEYLESS = {"/health", "/liveness", "/readiness", "/health_generate", "/get_server_info", "/v1/models"}


def test_without_the_key_the_router_answers_only_its_probes_and_names(pool, model_path: str) -> None:
    router, _, _, _ = pool
    answered = set()
    for route in sorted(KEYLESS | {"/get_model_info", "/workers", "/get_loads", "/flush_cache", "/engine_metrics"}):
        resp = urllib3.request("GET", router.url + route, timeout=30, retries=False)
        if resp.status == 200:
            answered.add(route)
    assert answered == KEYLESS
    models = urllib3.request("GET", router.url + "/v1/models", timeout=30, retries=False).json()
    assert [m["id"] for m in models["data"]] == [model_path]  # the model path: the one thing it names
    # /get_model_info goes on to an engine without the key, which refuses it
    assert urllib3.request("GET", router.url + "/get_model_info", timeout=30, retries=False).status == 401
    for route in ("/generate", "/flush_cache", "/v1/completions", "/v1/chat/completions"):
        resp = urllib3.request("POST", router.url + route, body=b"{}", timeout=30, retries=False)
        assert resp.status == 401, (route, resp.status)


def batch(n: int) -> dict:
    """The loop's request: n prompts, one sampling-params dict each (each sample's own seed)."""
    return {
        "input_ids": [[1 + i % 5, 7, 3 + i] for i in range(n)],
        "sampling_params": [
            {"max_new_tokens": 5, "temperature": 1.0, "top_p": 0.9, "sampling_seed": 1000 + i, "ignore_eos": True}
            for i in range(n)
        ],
        "return_logprob": True,
        "logprob_start_len": [1] * n,
        "rid": [f"r{i}" for i in range(n)],
    }


def one(body: dict, i: int) -> dict:
    """Prompt i of a ``batch`` alone."""
    return {k: v[i] if isinstance(v, list) else v for k, v in body.items()}


def test_a_batch_goes_through_the_router_prompt_by_prompt_with_each_samples_seed(pool) -> None:
    router, key, urls, _ = pool
    body = batch(6)
    # the router refuses the batch as an engine takes it (what EngineClient.generate sent before)
    raw = urllib3.request(
        "POST", router.url + Route.GENERATE, json=body, headers={"Authorization": f"Bearer {key}"}, retries=False
    )
    assert raw.status == 422 and b"sampling_params[0]: invalid type: map" in raw.data, raw.data
    engine = engine_client(urls[0], timeout_s=60)
    assert len(engine.generate(**body)) == 6  # ... which an engine serves

    client = EngineClient(router.url, timeout_s=60, api_key=key, router=True)
    outs = client.generate(**body)
    assert [o["meta_info"]["id"] for o in outs] == body["rid"]  # in order, each rid reached an engine
    for i, out in enumerate(outs):  # the tokens of that sample's seed, as an engine gives them for it alone
        alone = engine.generate(**one(body, i))
        assert out["output_ids"] == alone["output_ids"] and len(out["output_ids"]) == 5
        assert out["meta_info"]["output_token_logprobs"] == alone["meta_info"]["output_token_logprobs"]
        assert out["meta_info"]["input_token_logprobs"] == alone["meta_info"]["input_token_logprobs"]
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    assert client.generate(**one(body, 0))["meta_info"]["id"] == "r0"  # one prompt: a dict


def test_a_request_an_engine_refuses_through_the_router_is_one_error_naming_it(pool) -> None:
    router, key, _, _ = pool
    client = EngineClient(router.url, timeout_s=60, api_key=key, router=True)
    body = batch(3)
    body["input_ids"][1] = [1, 10**6]  # no such token
    with pytest.raises(RequestRefused) as err:
        client.generate(**body)
    problem = err.value.problem
    assert f"sglang router {router.url}/generate refused prompt 1 of 3" in problem, problem
    assert "sampling_seed 1001" in problem and "rid r1" in problem and "HTTP 400" in problem
    assert "token id out of range" in problem and err.value.status == 400  # the engine's own words


class Recorder(ThreadingHTTPServer):
    """An engine as the router sees it: /health, /server_info and /model_info answered, every other
    request recorded (path and JSON body) and answered with the next of ``statuses`` (then 200);
    while ``silent`` is set, a POST is recorded and never answered (an engine on a lost node)."""

    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict | None]] = []
        self.statuses: list[int] = []
        self.silent = threading.Event()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self, status: int, obj: object) -> None:
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                recorder.seen.append(("GET", self.path, None))
                info = {"model_path": "recorder", "served_model_name": "recorder", "is_generation": True}
                self.answer(200, info if "info" in self.path else {})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.seen.append(("POST", self.path, json.loads(body) if body else None))
                while recorder.silent.is_set():
                    time.sleep(0.05)
                status = recorder.statuses.pop(0) if recorder.statuses else 200
                out = {"text": "", "output_ids": [], "meta_info": {"id": "x"}, "error": "boom"}
                ids = (json.loads(body) if body else {}).get("input_ids")
                batch = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
                self.answer(status, [out] * len(ids) if batch else out)  # a batch: one answer a prompt

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def posts(self) -> list[dict]:
        return [body for method, path, body in self.seen if method == "POST" and path == Route.GENERATE]


@pytest.fixture
def recorded(tmp_path: Path) -> Iterator[tuple[Recorder, EngineClient]]:
    """The router over a Recorder; a client of it."""
    recorder = Recorder()
    new_key(tmp_path / "engine_key")
    router = Router("127.0.0.1", tmp_path / "router.log", 60.0, tmp_path / "engine_key")
    try:
        client = EngineClient(router.start([recorder.url]), timeout_s=30, api_key=router.api_key, router=True)
        yield recorder, client
    finally:
        router.stop()
        recorder.shutdown()


# A value away from SGLang's default for every sampling param rlhpc sends or the CPU engine takes
SENT = {
    "max_new_tokens": 7, "temperature": 0.7, "top_p": 0.93, "top_k": 5, "sampling_seed": (1 << 62) - 3,
    "stop_token_ids": [2, 3], "ignore_eos": True, "skip_special_tokens": False, "no_stop_trim": True,
    "min_p": 0.123456789, "frequency_penalty": 0.2, "presence_penalty": 0.3, "repetition_penalty": 1.1,
    "min_new_tokens": 1, "stop": ["x", "yz"], "stop_regex": "a+", "json_schema": "{}", "regex": "r",
    "ebnf": "e", "structural_tag": "s", "logit_bias": {"5": 1.0}, "n": 2,
    "spaces_between_special_tokens": False, "stream_interval": 3, "custom_params": {"a": 1},
}  # fmt: skip


def test_what_an_engine_receives_through_the_router_is_what_was_sent(recorded, tmp_path: Path) -> None:
    recorder, client = recorded
    client_key = (tmp_path / "engine_key").read_text().strip()
    assert set(SENT) == P.SAMPLING_PARAMS
    req = P.GenerateReqInput(input_ids=[5, 6, 7], sampling_params=SENT, return_logprob=True, logprob_start_len=1,
                             rid="abc", lora_path="run-3")  # fmt: skip
    sent = P.generate_body(req)  # as generate sends it, without its refusal of what is dropped
    headers = {"Authorization": f"Bearer {client_key}"}
    assert urllib3.request("POST", client.base_url + Route.GENERATE, json=sent, headers=headers).status == 200
    [got] = recorder.posts()
    # every field arrives as sent, and every sampling param but those the router drops; floats
    # are float32 in the router, as in SGLang's sampler
    assert {k: got[k] for k in sent if k != "sampling_params"} == {
        k: v for k, v in sent.items() if k != "sampling_params"
    }
    params = got["sampling_params"]
    assert set(SENT) - set(params) == P.ROUTER_DROPPED_SAMPLING_PARAMS
    for k, v in params.items():
        assert (np.float32(v) == np.float32(SENT[k])) if isinstance(v, float) else v == SENT[k], k
    # what the router adds is SGLang's default, or (model) no field of SGLang's request: ignored
    defaults = request_structs()["GenerateReqInput"]
    added = {k: v for k, v in got.items() if k not in sent}
    assert added.pop("model") is None and "model" not in defaults
    assert added and all(defaults[k].default == v for k, v in added.items()), added

    # generate refuses a dropped param at a value that matters, before sending anything
    with pytest.raises(RequestRefused, match="logit_bias.*does not pass on") as err:
        client.generate(input_ids=[[5], [6]], sampling_params=[{}, {"logit_bias": {"5": 1.0}}])
    assert "prompt 1 of 2" in str(err.value) and "rollout.sglang.router: false" in str(err.value)
    client.generate(input_ids=[5], sampling_params={"logit_bias": {}, "stream_interval": 2})  # harmless
    assert len(recorder.posts()) == 2

    # a batch the seeds do not matter to (engines without deterministic inference) goes as a few
    # batched requests, one sampling-params dict, return_logprob and logprob_start_len each: the
    # router passes such a chunk on as sent (a string rid too, which SGLang expands to rid_i)
    shared = {k: v for k, v in SENT.items() if k not in P.ROUTER_DROPPED_SAMPLING_PARAMS | P.SEED_PARAMS}
    chunk = P.generate_body(P.GenerateReqInput(input_ids=[[5, 6], [7], [8, 9, 10]], sampling_params=shared,
                                               return_logprob=True, logprob_start_len=1, rid="abc", lora_path="run-3"))  # fmt: skip
    assert urllib3.request("POST", client.base_url + Route.GENERATE, json=chunk, headers=headers).status == 200
    got = recorder.posts()[-1]
    assert {k: got[k] for k in chunk if k != "sampling_params"} == {
        k: v for k, v in chunk.items() if k != "sampling_params"
    }
    assert set(got["sampling_params"]) == set(shared)
    for k, v in got["sampling_params"].items():
        assert (np.float32(v) == np.float32(shared[k])) if isinstance(v, float) else v == shared[k], k
    # ... as EngineClient sends it: the prompts in `spread` chunks, the answers one a prompt
    unseeded = EngineClient(client.base_url, timeout_s=30, api_key=client_key, router=True, seeds_used=False, spread=2)
    try:
        before = len(recorder.posts())
        prompts = [[i, 1] for i in range(5)]
        outs = unseeded.generate(input_ids=prompts, sampling_params=[{"max_new_tokens": 2, "sampling_seed": i}
                                                                     for i in range(5)], return_logprob=True)  # fmt: skip
        sent = recorder.posts()[before:]
        assert len(outs) == 5 and sorted(b["input_ids"] for b in sent) == [prompts[:2], prompts[2:]]
        assert all(b["sampling_params"]["max_new_tokens"] == 2 and "sampling_seed" not in b["sampling_params"]
                   for b in sent)  # fmt: skip
    finally:
        unseeded.close()

    # return_routed_experts is not passed on (algo.routing_replay refuses the router for it)
    routed = P.generate_body(P.GenerateReqInput(input_ids=[5], sampling_params={}, return_routed_experts=True))
    assert urllib3.request("POST", client.base_url + Route.GENERATE, json=routed, headers=headers).status == 200
    assert routed["return_routed_experts"] is True and "return_routed_experts" not in recorder.posts()[-1]


def test_the_router_leaves_every_judgement_of_the_engines_to_the_job(recorded, tmp_path: Path) -> None:
    recorder, client = recorded
    recorder.statuses = [500] * 12
    for _ in range(12):
        with pytest.raises(EngineUnavailable, match="HTTP 500"):
            client.generate(input_ids=[1], sampling_params={"max_new_tokens": 1})
    assert len(recorder.posts()) == 12  # no retries: each failure comes back at once
    assert client.generate(input_ids=[1], sampling_params={"max_new_tokens": 1})["meta_info"]["id"] == "x"
    # ... and no circuit breaker: after 12 failures the engine is still routed to

    # no periodic /health, even at a one-second interval (SGLang's /health generates a token)
    for judged in (False, True):
        recorder.seen.clear()
        cmd = sg.router_command(sys.executable, [recorder.url], "127.0.0.1", sg.free_port("127.0.0.1"),
                                sg.free_port("127.0.0.1"))  # fmt: skip
        if judged:
            cmd = [a for a in cmd if a not in sg.ROUTER_JUDGEMENT_OFF]
        proc = subprocess.Popen([*cmd, "--health-check-interval-secs", "1"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
        try:  # its check at start-up, then 4 s of what follows (a loaded machine starts it late)
            deadline = time.monotonic() + 60
            while not any(seen[:2] == ("GET", "/health") for seen in recorder.seen) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(4)
        finally:
            proc.terminate()
            proc.wait(15)
        checks = sum(1 for method, path, _ in recorder.seen if (method, path) == ("GET", "/health"))
        assert checks >= 3 if judged else checks == 1, (judged, checks)  # 1: its check at start-up


def test_the_router_stops_at_once_with_a_request_held_by_a_silent_engine(tmp_path: Path) -> None:
    # sglang_router waits up to --shutdown-grace-period-secs (180 s by default) for its requests
    # in flight before it ends; one held by an engine on a lost node made every re-route and every
    # stop wait out stop()'s whole grace and end in a SIGKILL
    recorder = Recorder()
    recorder.silent.set()
    new_key(tmp_path / "engine_key")
    router = Router("127.0.0.1", tmp_path / "router.log", 60.0, tmp_path / "engine_key")
    try:
        client = EngineClient(router.start([recorder.url]), timeout_s=60, api_key=router.api_key, router=True)
        held = threading.Thread(target=_ignore_errors, args=(client.generate,), kwargs={"input_ids": [1]})
        held.start()
        deadline = time.monotonic() + 30
        while not recorder.posts() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert recorder.posts(), "the request never reached the engine"
        proc = router.proc
        router.stop()
        assert proc.returncode in (0, -signal.SIGTERM), proc.returncode  # ended on SIGTERM, not killed
    finally:
        router.stop()
        recorder.silent.clear()
        recorder.shutdown()


def _ignore_errors(fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except Exception:  # the router went away under it: what is asserted is how the router ended
        pass
