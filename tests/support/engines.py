"""CPU engine servers for tests: start/stop a server process (port 0 + ready file, as EngineActor does),
and the checks that an engine holds a trainer's weights."""

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rlhpc.model import load_model, load_tokenizer
from rlhpc.wire.client import EngineClient
from rlhpc.wire.engine_key import new_key

# url -> the engine key its server requires (``engine_client`` sends it)
KEYS: dict[str, str] = {}


def key_file(work: Path, name: str) -> Path:
    return work / f"{name}.engine_key"


def start_server(
    model_path: str,
    work: Path,
    name: str,
    extra_args: list[str] | None = None,
    key_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str, Path]:
    """Start a CPU engine server on port 0 that requires a fresh engine key (``key_file``, and
    ``engine_client(url)`` sends it), or the one in ``key_path`` (engines of one pool share a key);
    return (process, url, ready file). ``env``: its environment (default: this one's)."""
    ready = work / f"{name}.ready.json"
    key_path = key_path or key_file(work, name)
    key = new_key(key_path) if key_path == key_file(work, name) else key_path.read_text().strip()
    log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhpc.engine_server.cpu", "--model-path", model_path, "--port", "0"]
        + ["--ready-file", str(ready), "--parent-pid", str(os.getpid())]
        + ["--api-key-file", str(key_path), *(extra_args or [])],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, (work / f"{name}.log").read_text()
        assert time.monotonic() < deadline, "server did not get ready"
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    url = f"http://{info['host']}:{info['port']}"
    KEYS[url] = key
    return proc, url, ready


def engine_client(url: str, timeout_s: float = 600.0) -> EngineClient:
    """A client of a server ``start_server`` started, sending its key."""
    return EngineClient(url, timeout_s, api_key=KEYS[url])


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def trainer_model(model_path: str, seed: int, device: str = "cpu") -> torch.nn.Module:
    """The engine's model with every parameter moved: a trainer a few steps ahead."""
    model = load_model(model_path, device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.05).to(device))
    return model


def named(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, p in model.named_parameters():
        yield name, p.detach()


def assert_engine_holds(client: EngineClient, model: torch.nn.Module) -> None:
    for name, p in model.named_parameters():
        got = torch.tensor(client.get_weights_by_name(name, truncate_size=1 << 20), dtype=p.dtype)
        assert torch.equal(got, p.detach().cpu()), f"{client.base_url}: {name} differs"


def transformers_greedy(
    model: torch.nn.Module, ids: list[list[int]], max_new_tokens: int, eos_token_id: int | None
) -> list[tuple[list[int], list[float]]]:
    """The reference an engine's greedy answer must equal: transformers' own ``generate`` (no
    sampling, one prompt at a time: no padding), and each new token's logprob the log-softmax of
    a plain forward over prompt + answer. (output ids, their logprobs) per prompt. ``eos_token_id``
    None: no stop token (an id past the vocabulary, which is never generated)."""
    device = next(model.parameters()).device
    stop = model.config.vocab_size if eos_token_id is None else eos_token_id
    out = []
    with torch.no_grad():
        for prompt in ids:
            x = torch.tensor([prompt], device=device)
            seq = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=stop,
                pad_token_id=stop,
            )[0]
            new = seq[len(prompt) :].tolist()
            lp = torch.log_softmax(model(seq[None]).logits[0].float(), -1)
            out.append((new, [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(new)]))
    return out


def assert_generation_matches(client: EngineClient, model: torch.nn.Module, model_path: str) -> None:
    """The engine's greedy answers and their logprobs are transformers' with ``model``'s weights."""
    tok = load_tokenizer(model_path)
    ids = [[tok.bos_token_id, *tok(t, add_special_tokens=False).input_ids] for t in ("3+4=", "abc")]
    outs = client.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0}, return_logprob=True)
    for out, (want, logprobs) in zip(outs, transformers_greedy(model, ids, 8, tok.eos_token_id), strict=True):
        assert out["output_ids"] == want
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(logprobs, abs=1e-4)


def in_process_send(engine, answered):
    """A ``Generation`` send over an in-process CPU ``Engine``: each request generated as the
    server would, ``answered(request, outputs)`` told of each one (what a test checks)."""

    def send(requests, done):
        out = []
        for c, r in enumerate(requests):
            items, _ = engine.normalize(
                {"input_ids": r.input_ids, "sampling_params": r.sampling_params, "return_logprob": True}
            )
            out.append(engine.generate(items, engine.next_seq()))
            answered(r, out[-1])
            done(c, out[-1])
        return out

    return send


def generate_in_background(client: EngineClient, rid: str, tokens: int = 120) -> tuple[threading.Thread, list[dict]]:
    """A greedy generation of ``tokens`` tokens (the tiny model's context is 128) in a thread,
    returned once the engine runs it."""
    out: list[dict] = []
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t = threading.Thread(
        target=lambda: out.append(client.generate(input_ids=[1, 5], sampling_params=params, rid=rid)), daemon=True
    )
    t.start()
    deadline = time.monotonic() + 60
    while not client.get_server_info()["internal_states"][0]["running_batch"]:
        assert t.is_alive() and time.monotonic() < deadline, "the generation never started"
        time.sleep(0.01)
    return t, out
