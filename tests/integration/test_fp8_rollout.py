"""FP8 rollout for real: a CPU engine on the block-FP8 copy of a model, pushed the trainer's weights
quantized on the trainer side over both channels (shared memory, a gloo broadcast).

One engine for the module (~10 s with the 256-wide model's build); the model is 256 wide so that
every projection fits SGLang's 128 x 128 blocks (the default tiny model's k/v do not: refused).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from support.engines import assert_generation_matches, engine_client, named, start_server, stop_server, trainer_model
from support.jobs import submit

from rlhpc.metrics import read_metrics
from rlhpc.weights import fp8
from rlhpc.weights.expert_names import checkpoint_named
from rlhpc.weights.sender import make_weight_sender
from rlhpc.wire.client import EngineClient

WIDE = {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rlhpc.model import TinyModelConfig, build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "wide", TinyModelConfig(**WIDE)))


@pytest.fixture(scope="module")
def fp8_path(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(fp8.write_checkpoint(model_path, tmp_path_factory.mktemp("q") / "fp8"))


@pytest.fixture(scope="module")
def engine(fp8_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineClient]:
    proc, url, _ = start_server(fp8_path, tmp_path_factory.mktemp("engine"), "fp8")
    yield engine_client(url, timeout_s=60)
    stop_server(proc)
    assert proc.returncode == 0


def dequantized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every projection replaced by what an FP8 engine computes with."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if fp8.quantizes(name, p.shape):
                p.copy_(fp8.dequantize(*fp8.quantize(p)))
    return model


def engine_bytes(client: EngineClient, name: str, like: torch.Tensor) -> torch.Tensor:
    """The engine's tensor, as bytes: FP8 values travel as the floats they are, exactly."""
    got = torch.tensor(client.get_weights_by_name(name, truncate_size=1 << 20), dtype=torch.float32)
    return got.to(like.dtype).view(torch.uint8)


def assert_engine_holds_quantized(client: EngineClient, model: torch.nn.Module) -> None:
    want = dict(fp8.quantized_named(checkpoint_named(named(model))))
    assert any(n.endswith(fp8.SCALE) for n in want)
    for name, t in want.items():
        assert torch.equal(engine_bytes(client, name, t), t.contiguous().view(torch.uint8)), name


def test_the_engine_starts_on_the_quantized_copy(fp8_path: str, model_path: str, engine: EngineClient) -> None:
    assert fp8.is_fp8_checkpoint(fp8_path) and not fp8.is_fp8_checkpoint(model_path)
    from rlhpc.model import load_model

    base = load_model(model_path)
    assert_engine_holds_quantized(engine, base)
    # its logprobs are transformers' forward of the dequantized weights
    assert_generation_matches(engine, dequantized(base), model_path)


@pytest.mark.parametrize("colocate", [True, False])
def test_a_push_lands_byte_for_byte_as_the_trainer_quantized_it(
    colocate: bool, model_path: str, engine: EngineClient
) -> None:
    """Colocated, the engine's memory is released first and taken back (cluster.offload), as
    the loop does around training: the FP8 weights and scales are re-allocated and re-sent."""
    if colocate:
        bytes_before = engine.get_server_info()["internal_states"][0]["weights_bytes"]
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        assert engine.get_server_info()["internal_states"][0]["weights_bytes"] == bytes_before
    model = trainer_model(model_path, seed=3 if colocate else 4)
    sender = make_weight_sender(
        [engine], [1], colocate=colocate, master_address="127.0.0.1", backend="gloo", bucket_bytes=64 << 10
    )
    try:
        sender.connect()
        sender.send(fp8.quantized_named(checkpoint_named(named(model))), version=5)
    finally:
        sender.close()
    assert engine.get_weight_version() == "5"
    assert_engine_holds_quantized(engine, model)
    assert_generation_matches(engine, dequantized(model), model_path)


def test_a_full_precision_push_to_an_fp8_weight_is_cast_as_sglang_s_loader_casts(
    model_path: str, engine: EngineClient
) -> None:
    """SGLang's weight loader copies into the FP8 parameter (``param.data.copy_``): the values
    are cast without new scales. The CPU engine does the same (the trainer never sends it)."""
    name = "model.layers.0.mlp.down_proj.weight"
    w = torch.full((256, 256), 0.5)
    sender = make_weight_sender(
        [engine], [1], colocate=True, master_address="127.0.0.1", backend="gloo", bucket_bytes=1 << 20
    )
    try:
        sender.send([(name, w)], version=6)
    finally:
        sender.close()
    assert torch.equal(engine_bytes(engine, name, w.to(fp8.FP8)), w.to(fp8.FP8).view(torch.uint8))


def test_a_run_with_fp8_rollout_trains_and_logs_the_mismatch(tmp_path: Path) -> None:
    """The one local job of FP8 rollout (~25 s): the first start quantizes the model for the
    engines, every push lands, TIS is on by default and the engines' distance from the trainer
    is logged (non-zero: they sample from FP8 weights, the trainer holds float32)."""
    run = tmp_path / "run"
    wide = [f"model.tiny.{k}={v}" for k, v in WIDE.items()]
    p = submit(run, "rollout.num_rollout=2", "checkpoint.save_interval=null", "eval.interval=null",
               "rollout.quantization=fp8", *wide)  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert fp8.is_fp8_checkpoint(run / "engine_model_fp8")
    assert yaml.safe_load((run / "config.yaml").read_text())["algo"]["tis"] is True
    metrics = [m for m in read_metrics(run) if "rollout_logprob_abs_diff" in m]
    assert len(metrics) == 2
    for m in metrics:
        assert m["rollout_logprob_abs_diff"] > 1e-5 and "tis_weight" in m and "tis_clipfrac" in m
    assert "quantize" in {json.loads(line)["phase"] for line in (run / "startup.jsonl").read_text().splitlines()}
