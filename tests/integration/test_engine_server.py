"""The CPU engine server over real HTTP: SGLang-shaped I/O, seeded determinism, pause, EngineActor.

Its routes and field names are rlhpc.wire.protocol's, checked against SGLang's sources in
tests/unit/test_sglang_protocol.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
import urllib3
from support.engines import KEYS, engine_client, generate_in_background, start_server, stop_server, transformers_greedy

from rlhpc.engine_server.cpu.server import parse_args
from rlhpc.errors import RlhpcError
from rlhpc.model import load_model, load_tokenizer
from rlhpc.wire import lora
from rlhpc.wire import protocol as P
from rlhpc.wire.client import EngineClient, RequestRefused
from rlhpc.wire.protocol import MetaInfo, Route

# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def server(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    # deterministic, as in a `deterministic: true` run: the seeded tests need their seeds honoured
    flags = ["--enable-deterministic-inference"]
    proc, url, ready = start_server(model_path, tmp_path_factory.mktemp("srv"), "engine", flags)
    yield proc, url, ready
    stop_server(proc)
    assert proc.returncode == 0, "SIGTERM should end the server cleanly"
    assert not ready.exists(), "the ready file goes away with the server"


@pytest.fixture(scope="module")
def client(server: tuple[subprocess.Popen, str, Path]) -> EngineClient:
    return engine_client(server[1], timeout_s=60)


def prompts(tok, texts: list[str]) -> list[list[int]]:
    return [[tok.bos_token_id, *tok(t, add_special_tokens=False).input_ids] for t in texts]


# ------------------------------------------------------------------ command line


def test_device_option() -> None:
    assert parse_args(["--model-path", "m"]).device == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # a clear argparse error, not a crash while loading
            parse_args(["--model-path", "m", "--device", "cuda"])


# ------------------------------------------------------------------ server


def test_ready_file_health_and_info(server: tuple[subprocess.Popen, str, Path], client: EngineClient) -> None:
    proc, url, ready = server
    info = json.loads(ready.read_text())
    assert set(info) == {"host", "port", "pid"} and info["pid"] == proc.pid and info["port"] > 0
    assert client.health() and client.health_generate()
    model_info = client.get_model_info()
    assert model_info["is_generation"] is True and model_info["weight_version"] == "default"
    server_info = client.get_server_info()
    assert server_info["tp_size"] == 1 and server_info["weight_version"] == "default"
    assert server_info["device"] == "cpu"  # --device defaults to cpu
    assert client.get_weight_version() == "default"
    client.flush_cache()


def test_generate_returns_sglang_shapes(client: EngineClient, model_path: str) -> None:
    tok = load_tokenizer(model_path)
    ids = prompts(tok, ["1+1=", "abc"])
    params = [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 1}, {"max_new_tokens": 3, "temperature": 0}]
    outs = client.generate(input_ids=ids, sampling_params=params, return_logprob=True, rid="req")
    assert isinstance(outs, list) and len(outs) == 2
    for out, p, want_max in zip(outs, ids, (6, 3)):
        assert set(out) == {"text", "output_ids", "meta_info"}
        meta = out["meta_info"]
        # with return_logprob: every key but top-k, the prompt tokens' (those with logprob_start_len)
        # and the routed experts (return_routed_experts, on a MoE engine started for it)
        asked_for_apart = {MetaInfo.OUTPUT_TOP_LOGPROBS, MetaInfo.INPUT_TOKEN_LOGPROBS, MetaInfo.ROUTED_EXPERTS}
        assert MetaInfo.all() - asked_for_apart <= set(meta)
        assert meta["prompt_tokens"] == len(p) and meta["completion_tokens"] == len(out["output_ids"]) <= want_max
        assert meta["finish_reason"]["type"] in ("stop", "length")
        if meta["finish_reason"]["type"] == "length":
            assert meta["finish_reason"]["length"] == want_max
        else:
            assert meta["finish_reason"]["matched"] == out["output_ids"][-1] == tok.eos_token_id
        lps = meta["output_token_logprobs"]
        assert [t for _, t, _ in lps] == out["output_ids"] and all(lp <= 0 and txt is None for lp, _, txt in lps)
    assert [o["meta_info"]["id"] for o in outs] == ["req_0", "req_1"]

    single = client.generate(input_ids=ids[0], sampling_params={"max_new_tokens": 2})
    assert isinstance(single, dict) and "output_token_logprobs" not in single["meta_info"]
    by_text = client.generate(text="1+1=", sampling_params={"max_new_tokens": 2, "temperature": 0})
    # text is encoded as SGLang's tokenizer manager does: the tokenizer's own special tokens added
    assert isinstance(by_text, dict) and by_text["meta_info"]["prompt_tokens"] == len(tok("1+1=").input_ids) == 5

    n3 = client.generate(input_ids=ids[0], sampling_params={"max_new_tokens": 2, "n": 3})
    assert isinstance(n3, list) and len(n3) == 3


def test_seeded_samples_do_not_depend_on_the_batch(client: EngineClient, model_path: str) -> None:
    tok = load_tokenizer(model_path)
    a, b, c = prompts(tok, ["7*8=", "hello world", "1"])

    def params(seed: int) -> dict:
        return {"max_new_tokens": 12, "temperature": 1.0, "top_p": 0.9, "sampling_seed": seed}

    alone = client.generate(input_ids=[a], sampling_params=[params(11)])[0]["output_ids"]
    batched = client.generate(input_ids=[b, a, c], sampling_params=[params(5), params(11), params(6)])
    assert batched[1]["output_ids"] == alone
    again = client.generate(input_ids=[a, a], sampling_params=[params(11), params(12)])
    assert again[0]["output_ids"] == alone
    assert again[1]["output_ids"] != alone  # another seed, another sample (12 tokens: a tie is ~impossible)


def test_greedy_is_transformers_greedy_generation(client: EngineClient, model_path: str) -> None:
    tok = load_tokenizer(model_path)
    model = load_model(model_path).eval()
    ids = prompts(tok, ["12+30=", "xyz", "q"])
    outs = client.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 10, "temperature": 0.0}, return_logprob=True
    )
    for out, (want, logprobs) in zip(outs, transformers_greedy(model, ids, 10, tok.eos_token_id), strict=True):
        assert out["output_ids"] == want
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(logprobs, abs=1e-5)


def test_prompt_logprobs_are_transformers_log_softmax_in_sglangs_shape(client: EngineClient, model_path: str) -> None:
    """return_logprob with logprob_start_len (what a teacher is asked): each prompt token from the
    start, [logprob, id, None], its logprob transformers' log-softmax of the position before it,
    the first entry's None (as SGLang answers); per request its own start; none without one."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(model_path)
    ids = prompts(tok, ["12+30=42", "xyz abc"])
    outs = client.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=[3, 0]
    )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for out, x, start in zip(outs, ids, (3, 0)):
        entries = out["meta_info"][MetaInfo.INPUT_TOKEN_LOGPROBS]
        assert [e[1] for e in entries] == x[start:] and entries[0][0] is None
        assert all(e[2] is None for e in entries) and out["output_ids"] == []
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([x])).logits[0], -1)
        expected = [ref[j - 1, x[j]].item() for j in range(start + 1, len(x))]
        assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=1e-5)
    plain = client.generate(input_ids=ids[0], sampling_params={"max_new_tokens": 1}, return_logprob=True)
    assert MetaInfo.INPUT_TOKEN_LOGPROBS not in plain["meta_info"]
    with pytest.raises(RlhpcError, match="logprob_start_len"):
        client.generate(
            input_ids=ids[0], sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=99
        )


def test_stop_tokens_ignore_eos_and_zero_length(client: EngineClient, model_path: str) -> None:
    tok = load_tokenizer(model_path)
    ids = prompts(tok, ["abc"])[0]
    free = client.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    first = free["output_ids"][0]
    stopped = client.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [first]}
    )
    assert stopped["output_ids"] == [first]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    zero = client.generate(input_ids=[ids, ids], sampling_params=[{"max_new_tokens": 0}, {"max_new_tokens": 3}])
    assert zero[0]["output_ids"] == [] and len(zero[1]["output_ids"]) <= 3


def test_bad_requests_fail_clearly(client: EngineClient) -> None:
    with pytest.raises(RlhpcError, match=r"top_k must be -1 \(disable\) or at least 1, got 0"):
        client.generate(input_ids=[1, 5], sampling_params={"top_k": 0})
    with pytest.raises(RlhpcError, match="frequency_penalty=0.5 is not supported"):  # not implemented: refused
        client.generate(input_ids=[1, 5], sampling_params={"frequency_penalty": 0.5})
    with pytest.raises(RlhpcError, match="unknown sampling param 'temprature'"):
        client.generate(input_ids=[1, 5], sampling_params={"temprature": 0.5})
    with pytest.raises(RlhpcError, match="out of range"):
        client.generate(input_ids=[1, 10_000])
    with pytest.raises(RlhpcError, match="unknown parameter"):
        client.get_weights_by_name("no.such.weight")
    with pytest.raises(RlhpcError, match="unreachable"):
        EngineClient("http://127.0.0.1:9", timeout_s=2).get_weight_version()


def test_lora_on_an_engine_without_it_is_refused_in_sglangs_words(client: EngineClient) -> None:
    """Without --enable-lora (tests/integration/test_engine_lora.py has an engine with it)."""
    with pytest.raises(RequestRefused, match=re.escape(lora.requested_not_enabled("a"))):
        client.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 1}, lora_path="a")
    for call in (
        lambda: client.unload_lora_adapter("a"),
        lambda: client.load_lora_adapter(P.LoadLoRAAdapterReqInput("a", "/nowhere")),
        lambda: client.load_lora_adapter_from_tensors(P.LoadLoRAAdapterFromTensorsReqInput("a", {}, ["x"])),
    ):
        with pytest.raises(RequestRefused, match=re.escape(lora.NOT_ENABLED)) as refused:
            call()
        assert refused.value.status == 400


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"temperature": "nan"}, "temperature must be a number"),
        ({"temperature": -1}, "temperature must be a non-negative finite number"),
        ({"n": -5}, "n must be at least 1"),
        ({"n": 10**9}, "more than the CPU engine takes at once"),
        ({"max_new_tokens": 10**9}, "exceeds the model's maximum context length of 128 tokens"),
        ({"max_new_tokens": 126}, "You requested a total of 129 tokens"),
        ({}, "You requested a total of 131 tokens"),  # SGLang's default max_new_tokens, 128
        ({"top_p": True}, "top_p must be a number"),
        ({"stop_token_ids": "2"}, "stop_token_ids must be a list"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"repetition_penalty": 0}, "repetition_penalty must be in (0, 2]"),
    ],
)
def test_requests_no_engine_could_serve_are_refused_as_sglang_does(client: EngineClient, params, message) -> None:
    # Issue 32, items 6 and 10: SGLang refuses prompt + max_new_tokens over the context length
    # (one request for 10^9 tokens once grew the engine to 8 GB and blocked every other).
    with pytest.raises(RlhpcError, match=re.escape(message)):
        client.generate(input_ids=[1, 5, 7], sampling_params={"max_new_tokens": 4, **params} if params else {})
    assert len(client.generate(input_ids=[1, 5, 7], sampling_params={"max_new_tokens": 125})["output_ids"]) <= 125


def test_garbage_to_any_route_is_a_400_and_the_engine_serves_on(model_path: str, tmp_path: Path) -> None:
    # its own server: some garbage parses as a valid body (a release of all memory, a pause)
    proc, url, _ = start_server(model_path, tmp_path, "garbage")
    client = engine_client(url, timeout_s=60)
    headers = {"Authorization": f"Bearer {KEYS[url]}", "Content-Type": "application/json"}
    bodies = [b"garbage", b"[]", b"1", b'"x"', b"null", b'{"rid": {"a": 1}}', b'{"mode": 5}', b'{"tags": 7}']
    try:
        # not the memory routes: a body that parses as a release of all memory, sent twice, kills
        # the engine as it kills SGLang's (tests/integration/test_engine_strict.py)
        memory = {Route.RELEASE_MEMORY_OCCUPATION, Route.RESUME_MEMORY_OCCUPATION}
        for route in sorted(set(Route.all().values()) - {Route.HEALTH_GENERATE} - memory):
            for body in bodies:
                resp = urllib3.request("POST", url + route, body=body, headers=headers, timeout=30, retries=False)
                assert resp.status < 500, (route, body, resp.status, resp.data[:200])
        client.continue_generation()  # some garbage parsed as a pause
        assert client.health()
    finally:
        stop_server(proc)


def test_weight_updates_need_a_session_as_in_sglang(client: EngineClient) -> None:
    """SGLang refuses both updates outside begin/end_weight_update, a second begin and an end
    without a begin: HTTP 400 with success=false and its message (protocol.py holds the texts)."""

    def post(route: str, body: dict) -> tuple[int, dict]:
        resp = client._http.request(
            "POST", f"{client.base_url}{route}", json=body, timeout=60
        )  # carries the engine key
        return resp.status, resp.json()

    tensor = P.UpdateWeightsFromTensorReqInput(serialized_named_tensors=["x"])
    distributed = P.UpdateWeightsFromDistributedReqInput(names=[], dtypes=[], shapes=[])
    for route, req in (
        (Route.UPDATE_WEIGHTS_FROM_TENSOR, tensor),
        (Route.UPDATE_WEIGHTS_FROM_DISTRIBUTED, distributed),
    ):
        assert post(route, P.body(req)) == (400, {"success": False, "message": P.outside_session_message(route)})
    assert post(Route.END_WEIGHT_UPDATE, {}) == (400, {"success": False, "message": P.NO_SESSION_OPEN})
    assert post(Route.BEGIN_WEIGHT_UPDATE, {"selector": "everything"})[0] == 400
    client.begin_weight_update()
    try:
        assert post(Route.BEGIN_WEIGHT_UPDATE, {}) == (400, {"success": False, "message": P.SESSION_ALREADY_OPEN})
        # inside the session the update itself is looked at (and this payload refused for itself)
        with pytest.raises(RlhpcError, match="cannot read serialized_named_tensors") as refused:
            client.update_weights_from_tensor(tensor)
        assert "begin_weight_update" not in str(refused.value)
    finally:
        assert client.end_weight_update()["success"]
    with pytest.raises(RlhpcError, match="no weight-update session is open"):
        client.end_weight_update()
    assert client.get_weight_version() == "default"  # nothing was loaded


def test_pause_holds_new_requests_until_continue(client: EngineClient) -> None:
    client.pause_generation(mode="in_place")
    assert client.get_server_info()["internal_states"][0]["paused"] is True
    assert client.get_model_info()  # control routes keep answering while paused (not /health: it generates)
    done: list[dict] = []
    t = threading.Thread(
        target=lambda: done.append(client.generate(input_ids=[1, 5, 6], sampling_params={"max_new_tokens": 2}))
    )
    t.start()
    time.sleep(0.5)
    assert not done, "a paused engine must not generate"
    client.continue_generation()
    t.join(10)
    assert done and done[0]["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def test_abort_mode_aborts_requests_queued_before_the_pause(client: EngineClient) -> None:
    results: list[dict] = []
    client.pause_generation(mode="in_place")
    t = threading.Thread(
        target=lambda: results.append(client.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 4}))
    )
    t.start()
    time.sleep(0.3)
    client.pause_generation(mode="abort")  # SGLang's default: in-flight and queued requests end now
    client.continue_generation()
    t.join(10)
    assert results[0]["meta_info"]["finish_reason"]["type"] == "abort"
    after = client.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 2})
    assert after["meta_info"]["finish_reason"]["type"] != "abort"


# ------------------------------------------------------------------ weight updates beside requests in flight


def test_begin_waits_for_the_requests_in_flight_unless_paused(client: EngineClient) -> None:
    """SGLang's begin (and end, and each update) takes the model-update lock that every request
    holds: it waits for them on an engine that is not paused, and goes at once on a paused one."""
    t, out = generate_in_background(client, "begin-waits")
    client.begin_weight_update()
    state = client.get_server_info()["internal_states"][0]
    assert state["requests_in_flight"] == 0 and state["decode_steps"] == 120  # it ran to its end first
    client.end_weight_update()
    t.join(60)
    assert out[0]["meta_info"]["finish_reason"]["type"] == "length"  # finished, not aborted

    t, out = generate_in_background(client, "begin-paused")
    client.pause_generation(mode="in_place")
    client.begin_weight_update()
    client.end_weight_update()
    assert not out  # held by the pause, not waited for
    client.continue_generation()
    t.join(60)
    assert out[0]["meta_info"]["finish_reason"]["type"] == "length"


def test_a_pause_that_aborts_answers_once_nothing_is_in_flight(client: EngineClient) -> None:
    t, out = generate_in_background(client, "pause-drains")
    try:
        client.pause_generation(mode="abort")
        # answered before the pause was: nothing in flight when it returns (the client's thread
        # may read that answer later, on a loaded machine)
        assert client.get_server_info()["internal_states"][0]["requests_in_flight"] == 0
        t.join(60)
        assert out and out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        client.continue_generation()  # a failure here must not leave the module's engine paused
    t.join(60)


def test_a_cache_flush_with_a_request_running_fails_as_sglangs(
    client: EngineClient, model_path: str, request: pytest.FixtureRequest
) -> None:
    """An update asked to flush (the last bucket) while a request runs (pause in place) loads the
    weights but fails, recording no version; /flush_cache answers 400 until the engine is idle."""
    from rlhpc.weights.tensor_transport import serialize_named_tensors

    name = "model.norm.weight"
    before = torch.tensor(client.get_weights_by_name(name, truncate_size=10**6))
    version = client.get_weight_version()
    t, out = generate_in_background(client, "flush-busy")
    client.pause_generation(mode="in_place")
    request.addfinalizer(client.continue_generation)  # never leave the module's engine paused
    with pytest.raises(RlhpcError, match="HTTP 400"):
        client.flush_cache()
    payload, keep = serialize_named_tensors([(name, before + 1)])
    client.begin_weight_update()
    try:
        req = P.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload], weight_version="busy")
        with pytest.raises(RlhpcError, match=re.escape(P.FLUSH_BUSY)):
            client.update_weights_from_tensor(req)
    finally:
        client.end_weight_update()
    assert torch.equal(torch.tensor(client.get_weights_by_name(name, truncate_size=10**6)), before + 1)
    assert client.get_weight_version() == version  # loaded, but no version recorded
    client.abort_request(rid="flush-busy")
    t.join(60)
    assert out[0]["meta_info"]["finish_reason"]["type"] == "abort"
    client.flush_cache()  # idle now
    client.update_weight_version(version)
    client.continue_generation()
    payload, keep = serialize_named_tensors([(name, before)])  # as the other tests found it
    client.begin_weight_update()
    client.update_weights_from_tensor(P.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload]))
    client.end_weight_update()


# ------------------------------------------------------------------ EngineActor


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0); it no longer runs
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def _wait_gone(pid: int, timeout_s: float = 15) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if _gone(pid):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.ray
def test_engine_actor_start_restart_shutdown(model_path: str, tmp_path: Path) -> None:
    from rlhpc.engine_server.host import EngineActor

    ray.init(num_cpus=4, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actor = EngineActor.options(num_gpus=1, num_cpus=1).remote(model_path, str(tmp_path), 0, 60.0, None)
        url = ray.get(actor.url.remote())
        pid = ray.get(actor.pid.remote())
        c = EngineClient(url, timeout_s=30)
        assert c.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 2, "temperature": 0})["output_ids"]
        assert ray.get(actor.is_alive.remote())
        c.pause_generation("in_place")  # issue 40: alive while paused (SGLang's /health would hold 20 s, then 503)
        assert ray.get(actor.is_alive.remote())
        c.continue_generation()

        new_url = ray.get(actor.restart.remote())
        new_pid = ray.get(actor.pid.remote())
        assert new_pid != pid and _wait_gone(pid)
        assert EngineClient(new_url).generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 2})["output_ids"]
        assert (tmp_path / "engine_0.log").read_text().count("starting at") == 2

        ray.get(actor.shutdown.remote())
        assert _wait_gone(new_pid), "shutdown must stop the server"
        assert not ray.get(actor.is_alive.remote())

        # The server must not outlive its actor's process.
        orphan = EngineActor.options(num_gpus=1, num_cpus=1).remote(model_path, str(tmp_path), 1, 60.0, None)
        orphan_pid = ray.get(orphan.pid.remote())
        ray.kill(orphan)
        assert _wait_gone(orphan_pid), "server outlived its killed actor"
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ weights changing mid-generation


def _generate_across_an_update(model_path: str, new_model: str, mode: str, pause_after: int) -> tuple[list, dict]:
    """Run one greedy generation on an in-process CPU engine; after ``pause_after`` decoding steps
    the engine is paused (``mode``), the weights of ``new_model`` are loaded as version "1", and
    generation continues. The pause comes from a forward hook, so it lands at a known step."""
    from rlhpc.engine_server.cpu.runner import Engine

    engine = Engine(model_path, "default")
    engine.pause_mode = mode
    forwards = []

    def pause_at_step(module, args):
        forwards.append(1)
        if len(forwards) == pause_after:
            engine.running.clear()  # the step after this one waits, off the model lock

    handle = engine.model.register_forward_pre_hook(pause_at_step)
    prompt = [1, 5, 9, 2]
    items, _ = engine.normalize({"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    out: list[dict] = []
    t = threading.Thread(target=lambda: out.extend(engine.generate(items, engine.next_seq())))
    t.start()
    new = load_model(new_model)
    engine.load_weights(list(new.named_parameters()))  # the model lock is free only once paused
    engine.set_weight_version("1")
    assert len(engine.steps) == pause_after
    engine.running.set()
    t.join(60)
    handle.remove()
    return prompt, out[0]


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rlhpc.config import TinyModelConfig
    from rlhpc.model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("m2") / "tiny", TinyModelConfig(seed=1)))


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_generation_straddling_a_weight_update_tags_every_token(model_path: str, other_model: str, mode) -> None:
    _, out = _generate_across_an_update(model_path, other_model, mode, pause_after=3)
    meta = out["meta_info"]
    n = len(out["output_ids"])
    assert n == 12
    assert meta[MetaInfo.WEIGHT_VERSIONS] == [
        {"version": "default", "start": 0, "end": 3},
        {"version": "1", "start": 3, "end": n},
    ]
    assert meta[MetaInfo.WEIGHT_VERSION] == "1"  # the last token's, as SGLang reports it


def test_retract_recomputes_the_cache_with_the_new_weights(model_path: str, other_model: str) -> None:
    """After a retract pause, the tokens made with the new weights are the new model's own
    continuation of the prompt and the tokens so far (as SGLang re-prefills retracted requests)."""
    prompt, out = _generate_across_an_update(model_path, other_model, "retract", pause_after=3)
    ids = out["output_ids"]
    ((ref, _),) = transformers_greedy(load_model(other_model).eval(), [prompt + ids[:3]], 9, None)
    assert ids[3:] == ref
