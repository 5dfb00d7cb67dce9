"""The engine server on a GPU (``--device cuda``): weight sync into GPU memory, CUDA IPC, release.

Skipped without CUDA. The test process is the trainer; the engine is a real server process on
cuda:0, so colocated CUDA IPC crosses a real process boundary on the same GPU. The NCCL case
needs two GPUs (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.engines import (
    assert_engine_holds,
    assert_generation_matches,
    engine_client,
    named,
    start_server,
    stop_server,
    trainer_model,
)

from rlhpc.errors import RlhpcError
from rlhpc.model import TinyModelConfig, build_tiny_model, load_model
from rlhpc.weights.broadcast import DistributedWeightSender
from rlhpc.weights.shared_memory import TensorWeightSender
from rlhpc.wire.client import EngineClient

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# big enough that releasing the weights shows in the allocator's reserved memory (~13 MB)
TINY = TinyModelConfig(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TINY))


@pytest.fixture(scope="module")
def engine(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineClient]:
    work = tmp_path_factory.mktemp("engine")
    proc, url, _ = start_server(model_path, work, "gpu", ["--device", "cuda"])
    yield engine_client(url, timeout_s=120)
    stop_server(proc)
    assert proc.returncode == 0, Path(work / "gpu.log").read_text()


def reserved(client: EngineClient) -> int:
    return client.get_server_info()["internal_states"][0]["cuda_memory_reserved_bytes"]


def test_engine_runs_on_the_gpu(engine: EngineClient, model_path: str) -> None:
    assert engine.get_server_info()["device"] == "cuda"
    assert reserved(engine) > 0
    assert_generation_matches(engine, load_model(model_path, "cuda:0"), model_path)


def test_colocated_cuda_tensors_travel_by_ipc(engine: EngineClient, model_path: str) -> None:
    model = trainer_model(model_path, seed=1, device="cuda:0")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sender = TensorWeightSender([engine], [1], bucket_bytes=4 << 20)  # several buckets
    sender.send(named(model), version=3)
    sender.send(named(model), version=4)  # handles of freed clones must not be served stale
    sender.close()
    assert engine.get_weight_version() == "4"
    assert_engine_holds(engine, model)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])
    assert_generation_matches(engine, model, model_path)


def test_gloo_group_lands_on_a_gpu_engine(engine: EngineClient, model_path: str) -> None:
    model = trainer_model(model_path, seed=2, device="cpu")
    sender = DistributedWeightSender([engine], [1], "127.0.0.1", "gloo", 4 << 20, group_name="gloo_gpu", timeout=60)
    try:
        sender.connect()
        sender.send(named(model), version=5)
    finally:
        sender.close()
    assert_engine_holds(engine, model)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two CUDA devices: NCCL needs the trainer and the engine on different GPUs",
)
def test_nccl_group_lands_on_a_gpu_engine(engine: EngineClient, model_path: str) -> None:
    model = trainer_model(model_path, seed=3, device="cuda:1")  # the engine holds cuda:0
    sender = DistributedWeightSender([engine], [1], "127.0.0.1", "nccl", 4 << 20, group_name="nccl_gpu", timeout=60)
    try:
        sender.connect()
        sender.send(named(model), version=6)
    finally:
        sender.close()
    assert_engine_holds(engine, model)


def test_release_gives_gpu_memory_back(engine: EngineClient, model_path: str) -> None:
    full = reserved(engine)
    weights = engine.get_server_info()["internal_states"][0]["weights_bytes"]
    engine.release_memory_occupation()
    # returned to the driver, not just to torch's cache (a segment shared with buffers may stay)
    assert reserved(engine) < full - 0.9 * weights
    with pytest.raises(RlhpcError, match="memory is released"):
        engine.generate(input_ids=[1, 5], sampling_params={"max_new_tokens": 2})
    engine.resume_memory_occupation()
    assert reserved(engine) >= weights
    model = trainer_model(model_path, seed=4, device="cuda:0")
    sender = TensorWeightSender([engine], [1], bucket_bytes=4 << 20)
    sender.send(named(model), version=7)
    sender.close()
    assert_engine_holds(engine, model)
    assert_generation_matches(engine, model, model_path)


def test_colocated_pushes_to_two_engines_free_every_ipc_buffer(model_path: str, tmp_path: Path) -> None:
    """Each engine gets a pickle of its own (issue 40, item 3): CUDA IPC's reference count of the
    push's device buffer returns to zero once both have loaded, so the trainer's device memory
    is flat across pushes (one pickle read by two engines kept a bucket per push)."""
    servers = [start_server(model_path, tmp_path, f"gpu{i}", ["--device", "cuda"]) for i in range(2)]
    try:
        clients = [engine_client(url, timeout_s=120) for _, url, _ in servers]
        model = trainer_model(model_path, seed=5, device="cuda:0")  # not flat: each bucket is packed
        sender = TensorWeightSender(clients, [1, 1], bucket_bytes=4 << 20)
        sender.send(named(model), version=8)
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        after_one = torch.cuda.memory_allocated()
        for version in range(9, 14):
            sender.send(named(model), version=version)
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        assert torch.cuda.memory_allocated() <= after_one
        sender.close()
        for c in clients:
            assert c.get_weight_version() == "13"
            assert_engine_holds(c, model)
    finally:
        for proc, _, _ in servers:
            stop_server(proc)
