"""LoRA adapters on the CPU engine server, over real HTTP, against transformers + peft.

One module-scoped server started with SGLang's LoRA flags; adapters made by ``peft`` on the tiny
model (random A and B, so they change the tokens), pushed as the trainer pushes them
(``serialize_tensor_dict``) or loaded from the PEFT directory ``save_pretrained`` writes. The
refusals' words are SGLang's (pinned in tests/unit/test_sglang_protocol.py).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from support.engines import KEYS, engine_client, start_server, stop_server, transformers_greedy

from rlhpc.model import load_model, load_tokenizer
from rlhpc.weights.tensor_transport import serialize_tensor_dict
from rlhpc.wire import lora as L
from rlhpc.wire import protocol as P
from rlhpc.wire.client import EngineClient, RequestRefused

MAX_RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]  # down_proj left out: refused
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, str]]:
    serving = L.LoraServing(MAX_RANK, tuple(TARGETS), max_loras_per_batch=2)  # 3 in a batch: run in two parts
    proc, url, _ = start_server(model_path, tmp_path_factory.mktemp("lora"), "engine", serving.flags())
    yield proc, url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server: tuple[subprocess.Popen, str]) -> EngineClient:
    return engine_client(server[1], timeout_s=120)


def make_adapter(model_path: str, out: Path, seed: int, r: int, targets: list[str]) -> tuple[PeftModel, Path]:
    """A peft adapter with random A and B (peft's init would make B zero: no change), saved in
    PEFT's format (adapter_config.json + adapter_model.safetensors)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0, init_lora_weights=False)
    model = get_peft_model(load_model(model_path), config).eval()
    model.save_pretrained(out)
    return model, out


def push(client: EngineClient, name: str, adapter_dir: Path) -> dict[str, str]:
    """As the trainer pushes: the PEFT config and {PEFT name: tensor}, serialized as a weight push's."""
    payload, _keep = serialize_tensor_dict(load_file(adapter_dir / "adapter_model.safetensors"))
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    req = P.LoadLoRAAdapterFromTensorsReqInput(lora_name=name, config_dict=config, serialized_named_tensors=[payload])
    return client.load_lora_adapter_from_tensors(req)


@pytest.fixture(scope="module")
def adapters(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PeftModel, Path]]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": make_adapter(model_path, root / "attn", 1, 4, ["q_proj", "v_proj", "o_proj"]),
        "mlp": make_adapter(model_path, root / "mlp", 2, 8, ["gate_proj", "up_proj", "k_proj"]),
    }


def prompts(model_path: str) -> list[list[int]]:
    tok = load_tokenizer(model_path)
    return [[tok.bos_token_id, *tok(t, add_special_tokens=False).input_ids] for t in ("12+30=", "xyz", "hello q")]


def check(out: dict, want: tuple[list[int], list[float]]) -> None:
    assert out["output_ids"] == want[0]
    got = [lp for lp, _, _ in out["meta_info"][P.MetaInfo.OUTPUT_TOKEN_LOGPROBS]]
    assert got == pytest.approx(want[1], abs=1e-5)


def test_a_pushed_adapter_generates_as_transformers_with_peft(client: EngineClient, model_path: str, adapters) -> None:
    peft_model, adapter_dir = adapters["attn"]
    assert push(client, "attn", adapter_dir) == {"attn": L.TENSOR_LORA_PATH}
    ids = prompts(model_path)
    eos = load_tokenizer(model_path).eos_token_id
    outs = client.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, lora_path="attn")
    for out, want in zip(outs, transformers_greedy(peft_model, ids, GREEDY["max_new_tokens"], eos), strict=True):
        check(out, want)
    base = client.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True)
    assert [o["output_ids"] for o in base] != [o["output_ids"] for o in outs]  # the adapter made a difference
    # the prompt's logprobs (what a teacher or a KL reads) are the adapter's too
    lps = client.generate(
        input_ids=ids[0], sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0,
        lora_path="attn",
    )["meta_info"][P.MetaInfo.INPUT_TOKEN_LOGPROBS]  # fmt: skip
    with torch.no_grad():
        ref = torch.log_softmax(peft_model(torch.tensor([ids[0]])).logits[0], -1)
    assert [e[0] for e in lps[1:]] == pytest.approx(
        [ref[j - 1, ids[0][j]].item() for j in range(1, len(ids[0]))], abs=1e-5
    )


def test_two_adapters_and_the_base_in_one_batch_each_get_their_own(
    client: EngineClient, model_path: str, adapters
) -> None:
    """One /generate of three prompts naming attn, mlp and none (more than --max-loras-per-batch 2:
    run in two parts, as SGLang's scheduler does), and the same through a router-like client that
    sends each prompt alone: each equals its own reference."""
    if "mlp" not in client.load_lora_adapter(P.LoadLoRAAdapterReqInput("mlp", str(adapters["mlp"][1]))):
        pytest.fail("mlp not loaded")
    ids = prompts(model_path)
    eos = load_tokenizer(model_path).eos_token_id
    base_model = load_model(model_path).eval()
    refs = [
        transformers_greedy(m, [x], GREEDY["max_new_tokens"], eos)[0]
        for m, x in zip((adapters["attn"][0], adapters["mlp"][0], base_model), ids)
    ]
    names = ["attn", "mlp", None]
    for out, want in zip(
        client.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, lora_path=names), refs
    ):
        check(out, want)
    one_by_one = EngineClient(client.base_url, 120, api_key=KEYS[client.base_url], per_prompt=True)
    try:
        for out, want in zip(
            one_by_one.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, lora_path=names), refs
        ):
            check(out, want)
    finally:
        one_by_one.close()
    assert len({tuple(r[0]) for r in refs}) == 3  # three different answers: a mix-up would show


def test_unloaded_adapters_as_sglang_treats_them(client: EngineClient, model_path: str, adapters) -> None:
    """Unloaded, a pushed adapter cannot be named again (SGLang would reload it from a path it
    lacks), a path-loaded one is loaded again from its path; a name never loaded is refused."""
    ids = prompts(model_path)[0]
    push(client, "gone", adapters["attn"][1])
    assert "gone" not in client.unload_lora_adapter("gone")
    with pytest.raises(RequestRefused, match="Failed to implicitly load LoRA adapter gone"):
        client.generate(input_ids=ids, sampling_params=GREEDY, lora_path="gone")
    client.load_lora_adapter(P.LoadLoRAAdapterReqInput("disk", str(adapters["mlp"][1])))
    want = client.generate(input_ids=ids, sampling_params=GREEDY, lora_path="disk")["output_ids"]
    client.unload_lora_adapter("disk")
    assert client.generate(input_ids=ids, sampling_params=GREEDY, lora_path="disk")["output_ids"] == want
    with pytest.raises(RequestRefused, match="Got LoRA adapter that has never been loaded: nobody"):
        client.generate(input_ids=ids, sampling_params=GREEDY, lora_path="nobody")
    with pytest.raises(RequestRefused, match=r"LoRA with name nobody does not exist\. Loaded LoRAs: dict_keys"):
        client.unload_lora_adapter("nobody")


def test_adapters_the_engine_cannot_hold_are_refused_in_sglangs_words(
    client: EngineClient, model_path: str, adapters, tmp_path: Path
) -> None:
    _, too_big = make_adapter(model_path, tmp_path / "r16", 3, 2 * MAX_RANK, ["q_proj"])
    _, down = make_adapter(model_path, tmp_path / "down", 4, 4, ["down_proj"])
    fit = r"incompatible with the current LoRA memory pool configuration.*--max-lora-rank.*--lora-target-modules"
    for name, adapter_dir in (("big", too_big), ("down", down)):
        with pytest.raises(RequestRefused, match=f"LoRA adapter {name} with rank .* is {fit}"):
            push(client, name, adapter_dir)
    push(client, "twice", adapters["attn"][1])
    with pytest.raises(RequestRefused, match="Failed to load LoRA adapter twice because it is already loaded"):
        push(client, "twice", adapters["mlp"][1])
    # a tensor that does not fit the model: refused whole, nothing held
    tensors = load_file(adapters["attn"][1] / "adapter_model.safetensors")
    name = next(n for n in tensors if n.endswith("lora_A.weight"))
    tensors[name] = tensors[name][:, :-1]
    payload, _keep = serialize_tensor_dict(tensors)
    config = json.loads((adapters["attn"][1] / "adapter_config.json").read_text())
    bad = P.LoadLoRAAdapterFromTensorsReqInput(lora_name="bad", config_dict=config, serialized_named_tensors=[payload])
    with pytest.raises(RequestRefused, match="lora_A .* needs"):
        client.load_lora_adapter_from_tensors(bad)
    assert "bad" not in client.unload_lora_adapter("twice")


def test_openai_routes_list_adapters_and_take_base_colon_adapter(
    client: EngineClient, model_path: str, adapters
) -> None:
    """/v1/models lists each adapter with the base as its parent; ``model: "BASE:NAME"`` generates
    with the adapter, as the native route's ``lora_path`` does."""
    push(client, "oa", adapters["attn"][1])
    cards = {c["id"]: c for c in client._json("GET", "/v1/models")["data"]}
    assert cards["oa"]["parent"] == model_path and cards["oa"]["root"] == L.TENSOR_LORA_PATH
    ids = prompts(model_path)[1]
    native = client.generate(input_ids=ids, sampling_params=GREEDY, lora_path="oa")["output_ids"]
    base = client.generate(input_ids=ids, sampling_params=GREEDY)["output_ids"]
    body = {"prompt": ids, "max_tokens": GREEDY["max_new_tokens"], "temperature": 0, "return_token_ids": True}
    for model, want in ((f"{model_path}:oa", native), (model_path, base), ("whatever:oa", native)):
        got = client._json("POST", "/v1/completions", {**body, "model": model})["choices"][0]["token_ids"]
        assert got == want, model
    assert native != base
    client.unload_lora_adapter("oa")


def test_an_adapter_replaced_during_a_pause_serves_the_requests_that_waited(
    client: EngineClient, model_path: str, adapters
) -> None:
    """A push of a new adapter version under the name in use: pause, unload, load, continue. A
    request arriving meanwhile waits for the pause to end and then generates with the new one
    (SGLang resolves a request's adapter after the pause)."""
    ids = prompts(model_path)[2]
    want = transformers_greedy(
        adapters["mlp"][0], [ids], GREEDY["max_new_tokens"], load_tokenizer(model_path).eos_token_id
    )
    push(client, "run", adapters["attn"][1])
    client.pause_generation("retract")
    try:
        client.unload_lora_adapter("run")
        out: list = []
        waiting = threading.Thread(
            target=lambda: out.append(
                client.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True, lora_path="run")
            )
        )
        waiting.start()
        time.sleep(1.0)  # it arrives while paused (were it refused, the thread would have ended)
        assert waiting.is_alive() and not out
        push(client, "run", adapters["mlp"][1])
    finally:
        client.continue_generation()
    waiting.join(60)
    check(out[0], want[0])
    client.unload_lora_adapter("run")
