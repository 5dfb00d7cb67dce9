"""actor.lora at submit: what preflight refuses (with the fix), the module names it checks against
the model's weights, and what the memory plan counts (issue 45). The trainer side runs in
tests/integration/test_actor.py."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from rlhpc.cluster.memory import actor_estimate, read_shape
from rlhpc.errors import ConfigError
from rlhpc.preflight import load_config

EMBEDDED = "jobs/configs/embedded.yaml"


def cfg(*more: str):
    return load_config(EMBEDDED, list(more))


def test_lora_is_off_by_default_and_takes_peft_names():
    assert cfg().actor.lora is None
    on = cfg("actor.lora.rank=8", "actor.lora.target_modules=[q_proj, v_proj]").actor.lora
    assert on.peft_kwargs() == {"r": 8, "lora_alpha": 32.0, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    assert cfg("actor.lora.rank=4").actor.lora.target_modules == "all-linear"


@pytest.mark.parametrize(
    ("overrides", "problem", "fix"),
    [
        (["actor.lora.rank=0"], r"actor.lora.rank = 0 must be >= 1", "positive rank"),
        (["actor.lora.dropout=1.0"], r"actor.lora.dropout = 1.0 must be in \[0, 1\)", "dropout"),
        (["actor.lora.target_modules=q_proj"], 'neither "all-linear" nor a list', r"\[q_proj\]"),
        (["actor.backend=megatron", "actor.lora.rank=8"], "the megatron actor has no LoRA yet", "actor.backend: torch"),
        (
            ["actor.lora.target_modules=[q_proj, wq]"],
            "names wq, which model.tiny.architecture = llama does not",
            "q_proj",
        ),
        (["model.tiny.architecture=qwen3_moe", "actor.lora.rank=8"], "mixture-of-experts", "dense text model"),
        (["algo.kl_coef=0.1", "algo.ref_update_interval=2", "actor.lora.rank=8"], "cannot be reset", "interval: 0"),
        (
            [
                "rollout.partial_rollout=true",
                "rollout.max_staleness=1",
                "cluster.actor_num_gpus=1",
                "actor.lora.rank=8",
            ],
            "requests retracted across it",
            "actor.lora.push: merged",
        ),
    ],
)
def test_combinations_that_cannot_work_are_refused_with_the_fix(overrides, problem, fix):
    with pytest.raises(ConfigError, match=problem) as e:
        cfg(*overrides)
    assert re.search(fix, e.value.fix), e.value.fix


def write_safetensors_header(path: Path, names: dict[str, list[int]]) -> None:
    header = {n: {"dtype": "F32", "shape": s, "data_offsets": [0, 0]} for n, s in names.items()}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text)


def test_target_modules_are_checked_against_an_hf_models_weights(tmp_path: Path):
    """A model directory: its names come from the safetensors header (no torch at submit); a
    sharded model's from its index."""
    model = tmp_path / "m"
    model.mkdir()
    hf = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
          "intermediate_size": 16, "vocab_size": 32}  # fmt: skip
    (model / "config.json").write_text(json.dumps(hf))
    write_safetensors_header(
        model / "model.safetensors",
        {"model.layers.0.attn.wqkv.weight": [24, 8], "model.layers.0.norm.weight": [8], "lm_head.weight": [32, 8]},
    )
    base = ["model.tiny=null", f"model.path={model}", "actor.lora.push=merged"]
    assert cfg(*base, "actor.lora.target_modules=[wqkv]").actor.lora.target_modules == ["wqkv"]
    # pushed as an adapter, the engines serve it: SGLang adapts none of such a model's modules
    with pytest.raises(ConfigError, match="names wqkv, which SGLang does not serve adapters on") as e:
        cfg(*base[:-1], "actor.lora.target_modules=[wqkv]")
    assert "actor.lora.push: merged" in e.value.fix
    assert cfg(*base, "actor.lora.target_modules=[attn.wqkv]").actor.lora is not None  # a longer suffix
    with pytest.raises(ConfigError, match=r"names q_proj, which model.path .* does not have") as e:
        cfg(*base, "actor.lora.target_modules=[q_proj, wqkv]")
    assert "wqkv" in e.value.fix  # the model's own layer names
    with pytest.raises(ConfigError, match="names norm"):  # a vector is no linear layer
        cfg(*base, "actor.lora.target_modules=[norm]")
    (model / "model.safetensors").unlink()
    index = {"weight_map": {"model.layers.0.attn.wqkv.weight": "a.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="names q_proj"):
        cfg(*base, "actor.lora.target_modules=[q_proj]")


def test_the_memory_plan_counts_what_lora_keeps_and_drops():
    """The tiny llama (hidden 64, ffn 256, 2 layers, 4 heads of 16, 2 kv heads): LoRA keeps the
    weights and adds the adapters; gradients and Adam state are the adapters' alone; the KL
    penalty's reference costs nothing (the same model, adapters off)."""
    full = cfg("algo.kl_coef=0.1")
    shape = read_shape(full)
    full_terms = dict(actor_estimate(full, shape).terms)
    lora = cfg("algo.kl_coef=0.1", "actor.lora.rank=4", "actor.lora.target_modules=[q_proj, v_proj]")
    est = actor_estimate(lora, shape)
    terms = dict(est.terms)
    # q: 64 -> 64, v: 64 -> 32; rank 4 x (in + out) each, 2 layers
    adapters = 2 * 4 * ((64 + 64) + (64 + 32))
    assert terms["LoRA adapters"] == 4 * adapters
    assert terms["gradients"] == 4 * adapters and terms["optimizer"] == 8 * adapters
    assert terms["weights"] == full_terms["weights"]
    assert "reference weights" in full_terms and "reference weights" not in terms
    assert any("LoRA rank 4" in n for n in est.notes)
    every = dict(actor_estimate(cfg("actor.lora.rank=1"), shape).terms)["LoRA adapters"] / 4
    assert every == 2 * (2 * (64 + 64) + 2 * (64 + 32) + 3 * (64 + 256))  # all-linear: q, k, v, o, gate, up, down


def test_a_layout_that_fits_only_with_lora_is_planned_so():
    # AdamW state and gradients in fp32 for 0.36B parameters (4.3 GB) do not fit 6 GiB; the refusal says LoRA
    tiny = ["model.tiny.hidden_size=1024", "model.tiny.intermediate_size=4096", "model.tiny.num_hidden_layers=24",
            "model.tiny.num_attention_heads=16", "model.tiny.num_key_value_heads=4", "cluster.gpu_memory_gb=6",
            "actor.micro_batch_size=1", "data.max_prompt_tokens=64", "rollout.max_new_tokens=64"]  # fmt: skip
    with pytest.raises(ConfigError, match="biggest term is optimizer") as e:
        cfg(*tiny)
    assert "actor.lora" in e.value.fix
    assert cfg(*tiny, "actor.lora.rank=16").actor.lora.rank == 16
