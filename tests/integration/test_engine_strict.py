"""The CPU engine is as strict as SGLang 0.5.23 where rlhpc meets it (issue 40), and the engines
rlhpc starts are set up for it.

Real server processes: one as SGLang ships (no switch set, no flag), one as rlhpc starts its
engines (``engine_env``, and ``--enable-deterministic-inference`` as in a deterministic run).
tests/unit/test_sglang_strict.py reads each rule in SGLang's sources; here the server follows it.
Cost: five CPU engine starts (two shared, three that die), about 50 s on two busy cores.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from support.engines import engine_client, start_server, stop_server

from rlhpc.engine_server.sglang import engine_env
from rlhpc.model import load_model
from rlhpc.wire import switches
from rlhpc.wire.client import EngineClient, EngineUnavailable

HEALTH_WAIT_S = "4"  # SGLANG_HEALTH_CHECK_TIMEOUT for the shipped engine: SGLang's rule, a shorter wait
DETERMINISTIC = ["--enable-deterministic-inference"]


def as_shipped() -> dict[str, str]:
    """This environment without any of SGLang's switches: SGLang's defaults."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    return {**env, switches.HEALTH_CHECK_TIMEOUT: HEALTH_WAIT_S}


@pytest.fixture(scope="module")
def shipped(model_path: str, tmp_path_factory: pytest.TempPathFactory):
    proc, url, _ = start_server(model_path, tmp_path_factory.mktemp("shipped"), "shipped", env=as_shipped())
    yield engine_client(url)
    stop_server(proc)


@pytest.fixture(scope="module")
def rlhpc_engine(model_path: str, tmp_path_factory: pytest.TempPathFactory):
    env = engine_env(as_shipped())
    proc, url, _ = start_server(model_path, tmp_path_factory.mktemp("rlhpc"), "rlhpc", DETERMINISTIC, env=env)
    yield engine_client(url)
    stop_server(proc)


def seeded(seed: int | None, temperature: float = 1.0, n: int = 12) -> dict:
    params = {"max_new_tokens": n, "temperature": temperature, "ignore_eos": True}
    return params if seed is None else {**params, "sampling_seed": seed}


def generate(c: EngineClient, prompts: list[list[int]], params: dict | list[dict]) -> list[dict]:
    return c.generate(input_ids=prompts, sampling_params=params, return_logprob=True)


# ------------------------------------------------------------------ /health


def test_health_runs_a_generation_and_a_paused_engine_answers_503(shipped: EngineClient) -> None:
    assert shipped.health(timeout_s=10)  # idle: its own one-token generation is the progress it waits for
    shipped.pause_generation("in_place")
    try:
        assert not shipped.health(timeout_s=10)  # nothing moves for SGLANG_HEALTH_CHECK_TIMEOUT s: 503
        assert not shipped.health_generate(timeout_s=10)
    finally:
        shipped.continue_generation()
    assert shipped.health(timeout_s=10)


def test_rlhpcs_engines_answer_health_when_paused(rlhpc_engine: EngineClient) -> None:
    """rlhpc's liveness checks (5 s) and the router's never see a paused engine as dead."""
    rlhpc_engine.pause_generation("in_place")
    try:
        assert rlhpc_engine.health(timeout_s=5)
    finally:
        rlhpc_engine.continue_generation()


# ------------------------------------------------------------------ seeds


def test_seeds_are_ignored_without_deterministic_inference(shipped: EngineClient) -> None:
    prompts = [[1, 5, 9]] * 4
    out = [o["output_ids"] for o in generate(shipped, prompts, seeded(7))]
    assert len({tuple(ids) for ids in out}) > 1  # one seed, four different samples


def test_deterministic_inference_honours_seeds_and_seeds_the_unseeded_42(rlhpc_engine: EngineClient) -> None:
    prompts = [[1, 5, 9]] * 3
    once = [o["output_ids"] for o in generate(rlhpc_engine, prompts, seeded(7))]
    again = [o["output_ids"] for o in generate(rlhpc_engine, prompts, seeded(7))]
    assert once == again and len({tuple(ids) for ids in once}) == 1
    unseeded = [o["output_ids"] for o in generate(rlhpc_engine, prompts[:1], seeded(None))]
    assert unseeded == [o["output_ids"] for o in generate(rlhpc_engine, prompts[:1], seeded(42))]


# ------------------------------------------------------------------ logprobs


def _reference(model_path: str, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """The output tokens' logprobs under transformers' softmax of logits / temperature."""
    model = load_model(model_path)
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]


@pytest.mark.parametrize("engine", ["shipped", "rlhpc_engine"])
def test_logprobs_follow_the_temperature_unless_the_original_logprob_switch_is_set(
    engine: str, model_path: str, request: pytest.FixtureRequest
) -> None:
    c = request.getfixturevalue(engine)
    prompt = [1, 5, 9, 2]
    out = generate(c, [prompt], [seeded(3, temperature=0.7)])[0]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    scaled = _reference(model_path, prompt, out["output_ids"], 0.7)
    original = _reference(model_path, prompt, out["output_ids"], 1.0)
    assert not torch.allclose(scaled, original, atol=1e-3)  # the check can tell them apart
    want = scaled if engine == "shipped" else original  # rlhpc sets SGLANG_RETURN_ORIGINAL_LOGPROB
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    greedy = generate(c, [prompt], [seeded(None, temperature=0.0)])[0]  # SGLang: temperature 1, top-k 1
    got = torch.tensor([lp for lp, _, _ in greedy["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, _reference(model_path, prompt, greedy["output_ids"], 1.0), atol=1e-4, rtol=0)


def test_an_offloaded_engine_fails_health_unless_it_skips_the_generation(
    shipped: EngineClient, rlhpc_engine: EngineClient
) -> None:
    """Last of the shared engines' tests: after a resume they need new weights to generate."""
    for c in (shipped, rlhpc_engine):
        c.release_memory_occupation()
    try:
        assert not shipped.health(timeout_s=10)  # its generation cannot run on released memory
        assert rlhpc_engine.health(timeout_s=5)  # rlhpc's: answered without one
    finally:
        for c in (shipped, rlhpc_engine):
            c.resume_memory_occupation()


# ------------------------------------------------------------------ memory calls that kill SGLang's server


def _dies(proc, c: EngineClient, call, log: Path, cause: str) -> None:
    with pytest.raises(EngineUnavailable):  # the call gets no answer: the server is gone
        call()
    assert proc.wait(15) != 0
    assert not c.health(timeout_s=2)
    assert cause in log.read_text() and "Scheduler hit an exception" in log.read_text()


def test_resuming_memory_that_is_not_released_kills_the_engine(model_path: str, tmp_path: Path) -> None:
    proc, url, _ = start_server(model_path, tmp_path, "resume", env=as_shipped())
    try:
        c = engine_client(url)
        _dies(proc, c, c.resume_memory_occupation, tmp_path / "resume.log", "KeyError: 'kv_cache'")
    finally:
        stop_server(proc)


def test_releasing_memory_twice_kills_the_engine(model_path: str, tmp_path: Path) -> None:
    proc, url, _ = start_server(model_path, tmp_path, "twice", env=as_shipped())
    try:
        c = engine_client(url)
        c.release_memory_occupation(["weights"])
        _dies(proc, c, c.release_memory_occupation, tmp_path / "twice.log", "not active (tags ['weights'])")
    finally:
        stop_server(proc)


def test_releasing_memory_under_a_running_batch_kills_the_engine(model_path: str, tmp_path: Path) -> None:
    """Paused in place, a batch keeps its cache: SGLang's release asserts an idle engine."""
    proc, url, _ = start_server(model_path, tmp_path, "busy", env=as_shipped())
    try:
        c = engine_client(url)
        batch = lambda: generate(c, [[1, 5]] * 64, seeded(1, n=120))  # noqa: E731 - seconds of decoding here
        long = threading.Thread(target=lambda: _swallow(batch), daemon=True)
        long.start()
        deadline = time.monotonic() + 60
        while c.get_server_info()["internal_states"][0]["decode_steps"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        c.pause_generation("in_place")
        _dies(proc, c, c.release_memory_occupation, tmp_path / "busy.log", "should be called only when server is idle")
    finally:
        stop_server(proc)


def _swallow(fn) -> None:
    try:
        fn()
    except EngineUnavailable:
        pass  # the server died under it
