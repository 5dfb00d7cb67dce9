"""HF <-> megatron-core GPTModel conversion, checked against real megatron-core on CPU over gloo."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
if torch.cuda.is_available():
    # These run megatron on the CPU through rlhpc.actor.megatron.cpu_shim, which refuses a GPU process.
    pytest.skip("CPU/gloo test of the megatron conversion; not written for GPU processes", allow_module_level=True)

from rlhpc.actor.megatron.convert import (  # noqa: E402
    gather_tp_shards,
    hf_to_megatron,
    load_into,
    megatron_to_hf,
    model_state_dict,
    shard_for_tp,
)
from rlhpc.model import TinyModelConfig, build_tiny_model, load_model  # noqa: E402

ARCHS = ["llama", "qwen2"]
# A few sequences of different lengths over the tiny char vocab (47 tokens).
SEQS = [[1, 5, 6, 21, 7, 30, 12, 40, 2], [1, 44, 3, 3, 18, 19, 20], [1, 9]]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron_models")
    # 4 query heads in 2 kv groups: GQA, and TP=2 gives each rank one whole group.
    return {a: build_tiny_model(root / a, TinyModelConfig(architecture=a, seed=3)) for a in ARCHS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_megatron(rank: int, world_size: int, tp_size: int, port: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rlhpc.actor.megatron.cpu_shim import apply_cpu_shim

    apply_cpu_shim()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    model_parallel_cuda_manual_seed(1234)


def _teardown_megatron() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rlhpc.actor.megatron.cpu_shim import remove_cpu_shim

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    remove_cpu_shim()


def _megatron_logits(model_dir: Path, tp_size: int, tp_rank: int) -> list[torch.Tensor]:
    """Full-vocab logits of the converted megatron model for each of SEQS (one sequence per call)."""
    from rlhpc.actor.megatron.model import build_gpt_model

    hf = load_model(model_dir)
    model = build_gpt_model(hf.config, tp_size=tp_size, parallel_output=False)
    load_into(model, hf_to_megatron(hf.state_dict(), hf.config, tp_size=tp_size, tp_rank=tp_rank))
    model.eval()
    out = []
    with torch.no_grad():
        for seq in SEQS:
            ids = torch.tensor([seq])
            pos = torch.arange(len(seq)).unsqueeze(0)
            logits = model(ids, pos, attention_mask=None)
            out.append(logits[0, :, : hf.config.vocab_size].clone())
    return out


def _hf_logits(model_dir: Path) -> list[torch.Tensor]:
    hf = load_model(model_dir).eval()
    with torch.no_grad():
        return [hf(torch.tensor([seq])).logits[0] for seq in SEQS]


@pytest.fixture(scope="module")
def megatron_tp1():
    """This process as a gloo group of one with megatron's model-parallel state (TP=1)."""
    _init_megatron(0, 1, 1, _free_port())
    yield
    _teardown_megatron()


@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_bit_exact(tiny_models, arch, tp_size):
    hf = load_model(tiny_models[arch])
    hf_sd = hf.state_dict()
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in hf_sd
    shards = [hf_to_megatron(hf_sd, hf.config, tp_size=tp_size, tp_rank=r) for r in range(tp_size)]
    back = megatron_to_hf(shards, hf.config)
    assert set(back) == set(hf_sd)
    for name, t in hf_sd.items():
        assert back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name
    # Gathering then re-sharding gives every rank's shard back exactly.
    full = gather_tp_shards(shards)
    for r in range(tp_size):
        again = shard_for_tp(full, tp_size, r)
        assert all(torch.equal(again[k], shards[r][k]) for k in shards[r])


@pytest.mark.parametrize("arch", ARCHS)
def test_megatron_logits_match_hf(tiny_models, megatron_tp1, arch):
    from rlhpc.actor.megatron.model import build_gpt_model

    hf = load_model(tiny_models[arch])
    model = build_gpt_model(hf.config, tp_size=1)
    load_into(model, hf_to_megatron(hf.state_dict(), hf.config))
    # Through the real module and back: still bit-exact.
    back = megatron_to_hf([model_state_dict(model)], hf.config)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())

    ref = _hf_logits(tiny_models[arch])
    got = _megatron_logits(tiny_models[arch], tp_size=1, tp_rank=0)
    for r, g in zip(ref, got):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


def _tp2_worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    _init_megatron(rank, 2, 2, port)
    try:
        logits = _megatron_logits(Path(model_dir), tp_size=2, tp_rank=rank)
        torch.save(logits, os.path.join(out_dir, f"logits_rank{rank}.pt"))
    finally:
        _teardown_megatron()


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_logits_match_tp1(tiny_models, megatron_tp1, tmp_path, arch):
    import torch.multiprocessing as mp

    mp.spawn(_tp2_worker, args=(_free_port(), str(tiny_models[arch]), str(tmp_path)), nprocs=2, join=True)
    tp1 = _megatron_logits(tiny_models[arch], tp_size=1, tp_rank=0)
    ref = _hf_logits(tiny_models[arch])
    for rank in range(2):
        tp2 = torch.load(tmp_path / f"logits_rank{rank}.pt")
        for a, b, r in zip(tp2, tp1, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)
