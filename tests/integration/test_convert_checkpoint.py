"""tools/convert_checkpoint.py as a command: megatron actor checkpoints (any TP) -> HF, HF -> megatron."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")
if torch.cuda.is_available():
    # The checkpoint writers below run megatron on the CPU through the shim, which refuses a GPU process.
    pytest.skip(
        "a CUDA device is present: a CPU/gloo test of the megatron checkpoint conversion", allow_module_level=True
    )

from support.tiny_variants import TIED_LLAMA3, build_variant  # noqa: E402

from rlhpc.model import TinyModelConfig, build_tiny_model  # noqa: E402

TOOL = Path(__file__).resolve().parents[2] / "tools" / "convert_checkpoint.py"


def run_tool(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def convert(*args: str | Path) -> None:
    r = run_tool(*args)
    assert r.returncode == 0, r.stderr[-3000:]


def assert_same_weights(got_dir: Path, want: dict[str, torch.Tensor]) -> None:
    got = load_file(got_dir / "model.safetensors")
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name  # bit for bit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 query heads in 2 kv groups: TP=2 gives each rank one group; vocab 47 padded differently per TP.
    return build_tiny_model(tmp_path_factory.mktemp("convert") / "tiny", TinyModelConfig(seed=7))


def _save_rank(rank: int, world_size: int, tp: int, model_path: str, ckpt: str, rendezvous: str) -> None:
    """One rank of a megatron actor: one training step (weights move, Adam state exists), then save."""
    from rlhpc.actor.megatron.worker import MegatronTrainWorker
    from rlhpc.actor.rank import Rendezvous
    from rlhpc.actor.spec import ActorSpec
    from rlhpc.batch import RolloutBatch
    from rlhpc.config import Config

    cfg = Config()
    cfg.actor.backend = "megatron"
    cfg.actor.lr = 1e-2
    cfg.actor.megatron.tensor_model_parallel_size = tp
    w = MegatronTrainWorker(ActorSpec.from_config(cfg), model_path, rank, world_size)
    rdv = Path(rendezvous)
    if rank == 0:
        meet = w.rendezvous(one_node=True)
        rdv.with_suffix(".tmp").write_text(json.dumps(dataclasses.asdict(meet)))
        rdv.with_suffix(".tmp").rename(rdv)
    else:
        deadline = time.monotonic() + 60
        while not rdv.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        meet = Rendezvous(**json.loads(rdv.read_text()))
    w.init_process_group(meet)
    prompts, responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[20, 21], [22, 23, 24], [25]]
    logprobs = [[-1.0] * len(r) for r in responses]
    w.train(0, RolloutBatch(prompts, responses, logprobs, torch.zeros(3), torch.tensor([1.0, -0.5, 0.7]), 1))
    w.save(ckpt)
    weights = w.named_tensors()  # a collective: every TP rank takes part
    if rank == 0:
        torch.save(weights, Path(ckpt) / "saved_weights.pt")
    w.shutdown()


def test_tp2_actor_checkpoint_to_hf(tiny: Path, tmp_path: Path) -> None:
    """A checkpoint the actor wrote at TP=2 (model + optimizer) becomes the HF weights at TP=1."""
    import torch.multiprocessing as mp
    from megatron.core import dist_checkpointing

    ckpt = tmp_path / "checkpoints" / "rollout_000003"
    mp.spawn(_save_rank, args=(2, 2, str(tiny), str(ckpt), str(tmp_path / "rdv")), nprocs=2, join=True)
    meta = json.loads((ckpt / "actor" / "actor_meta.json").read_text())
    assert (meta["backend"], meta["tensor_model_parallel_size"]) == ("megatron", 2)
    keys = dist_checkpointing.load_tensors_metadata(str(ckpt / "actor" / "dist"))
    assert any(k.startswith("optimizer.") for k in keys)  # the tool must load the model part only

    saved = torch.load(ckpt / "saved_weights.pt")
    source = load_file(tiny / "model.safetensors")
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"], source["model.layers.0.mlp.up_proj.weight"])

    out = tmp_path / "hf"
    convert("to-hf", ckpt, out)
    assert_same_weights(out, saved)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (out / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp")]


def test_from_hf_round_trip_bf16(tiny: Path, tmp_path: Path) -> None:
    """from-hf writes a torch_dist checkpoint in the actor's layout; to-hf keeps its dtype (bf16).
    The model has tied embeddings and Llama 3 RoPE scaling (Llama-3.2-1B's kind): megatron holds
    no output layer, and the HF model written back has no lm_head of its own either."""
    tied = build_variant(tiny, tmp_path / "tied", TIED_LLAMA3)
    convert("from-hf", tied, tmp_path / "mg", "--tp", "2", "--dtype", "bfloat16")
    meta = json.loads((tmp_path / "mg" / "actor" / "actor_meta.json").read_text())
    assert meta["backend"] == "megatron" and meta["weights_only"] is True
    assert (tmp_path / "mg" / "actor" / "dist" / "metadata.json").is_file()
    convert("to-hf", tmp_path / "mg" / "actor", tmp_path / "hf")  # the actor/ directory itself is accepted too
    want = {k: v.to(torch.bfloat16) for k, v in load_file(tied / "model.safetensors").items()}
    assert "lm_head.weight" not in want
    assert_same_weights(tmp_path / "hf", want)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is True


def test_refusals(tiny: Path, tmp_path: Path) -> None:
    # A torch-backend checkpoint: its actor/ is an HF directory plus actor_meta.json without "backend".
    actor = tmp_path / "torch_ckpt" / "actor"
    actor.mkdir(parents=True)
    (actor / "config.json").write_text((tiny / "config.json").read_text())
    (actor / "actor_meta.json").write_text(json.dumps({"world_size": 1, "optimizer_steps": 4}))
    r = run_tool("to-hf", tmp_path / "torch_ckpt", tmp_path / "out")
    assert r.returncode == 2
    assert "not written by the megatron actor (backend 'torch')" in r.stderr
    assert "already an HF model directory" in r.stderr
    assert not (tmp_path / "out").exists()

    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    for args in (("to-hf", tmp_path / "torch_ckpt"), ("from-hf", tiny)):
        r = run_tool(*args, tmp_path / "busy")
        assert r.returncode == 2
        assert "already exists and is not empty" in r.stderr and "fix: choose a new OUT_DIR" in r.stderr
    assert [p.name for p in (tmp_path / "busy").iterdir()] == ["keep.txt"]
