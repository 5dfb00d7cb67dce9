"""A weight push names Qwen3-MoE's experts as the checkpoint does, which is what SGLang loads.

transformers keeps the experts fused in memory (``mlp.experts.gate_up_proj``); its checkpoint,
and SGLang's loader, name each expert's gate/up/down projection. Pinned against both: the
checkpoint ``save_pretrained`` writes, and the expert mapping in the SGLang wheel's sources.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import sglang_wheel as sgl

from rlhpc.engine_server.cpu.runner import Engine
from rlhpc.model import TinyModelConfig, build_tiny_model
from rlhpc.weights.expert_names import checkpoint_named
from rlhpc.wire.protocol import EngineError

EXPERTS = 3


def tiny_qwen3_moe() -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # hidden != moe_intermediate, so a transposed or swapped projection changes the shape
    config = Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # experts start uninitialised otherwise
    return model


def test_pushed_names_and_tensors_are_the_checkpoints(tmp_path: Path) -> None:
    model = tiny_qwen3_moe()
    model.save_pretrained(tmp_path, safe_serialization=True)
    on_disk = {k: v for f in sorted(tmp_path.glob("*.safetensors")) for k, v in load_file(f).items()}
    pushed = dict(checkpoint_named((n, p.detach()) for n, p in model.named_parameters()))
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters())  # fused in memory
    assert set(pushed) == set(on_disk)
    for name, t in pushed.items():
        assert torch.equal(t, on_disk[name]), name
    # each view is contiguous, and gate/up of consecutive experts lie back to back (one bucket copy)
    gate_up = model.model.layers[0].mlp.experts.gate_up_proj
    views = [t for n, t in pushed.items() if ".gate_proj." in n or ".up_proj." in n]
    assert all(v.is_contiguous() and v.untyped_storage().data_ptr() == gate_up.data_ptr() for v in views)
    assert [v.data_ptr() for v in views] == sorted(v.data_ptr() for v in views)


def test_sglang_loads_every_pushed_expert_name() -> None:
    """Replays how ``Qwen3MoeForCausalLM.load_weights`` routes a name: experts skip the stacked
    mapping, then the first expert mapping whose ``weight_name`` is in the name takes it. Every
    pushed expert tensor lands on its expert and shard (w1 gate, w3 up, w2 down); the fused
    in-memory names match nothing (SGLang would skip them silently)."""
    mapping = sgl.qwen3_moe_expert_mapping(EXPERTS)
    assert sgl.qwen3_moe_skips_stacked_experts()

    def route(name: str) -> tuple[str, int, str] | None:
        for param_name, weight_name, expert, shard in mapping:
            if weight_name in name:
                return name.replace(weight_name, param_name), expert, shard
        return None

    model = tiny_qwen3_moe()
    shard_of = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    seen = set()
    for name, _ in checkpoint_named(model.named_parameters()):
        if ".mlp.experts." not in name:
            assert route(name) is None, name
            continue
        expert, proj = name.split(".mlp.experts.")[1].split(".")[:2]
        param, got_expert, shard = route(name)
        assert (got_expert, shard) == (int(expert), shard_of[proj]), name
        assert param == f"model.layers.0.mlp.experts.{'w2' if proj == 'down_proj' else 'w13'}_weight"
        seen.add((got_expert, shard))
    assert seen == {(e, s) for e in range(EXPERTS) for s in ("w1", "w2", "w3")}
    for fused in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        assert route(fused) is None


def test_cpu_engine_takes_the_per_expert_names_into_its_fused_experts(tmp_path: Path) -> None:
    """The CPU engine (transformers' fused experts) speaks the same wire format: per-expert names
    land in their rows of ``gate_up_proj``/``down_proj``, a fused name is refused as unknown, and
    after a resume the experts await new weights under the per-expert names."""
    path = build_tiny_model(tmp_path / "moe", TinyModelConfig(architecture="qwen3_moe", seed=3))
    engine = Engine(str(path), "0")
    torch.manual_seed(1)
    new = {n: torch.randn_like(p) for n, p in engine.model.named_parameters()}
    pushed = list(checkpoint_named(new.items()))
    assert len(pushed) > len(new)  # the experts went out one by one
    engine.release(["weights"])
    engine.resume(["weights"])
    assert engine.stale == {n for n, _ in pushed}
    engine.load_weights(pushed)
    assert not engine.stale
    for name, p in engine.model.named_parameters():
        assert torch.equal(p, new[name]), name
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    with pytest.raises(EngineError, match="unknown parameter"):
        engine.load_weights([(fused, new[fused])])
