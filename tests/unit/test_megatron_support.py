"""Which models the megatron actor trains is decided at submit (the preflight), from config.json
alone: tied embeddings and Llama 3 / YaRN / linear RoPE pass (the models people try first),
what it cannot build is refused there with the fix, not on the allocation. And a tied model's
push sends ``embed_tokens`` only: pinned against SGLang's loaders, which tie ``lm_head`` themselves."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support import sglang_wheel as sgl

from rlhpc.actor.megatron.support import problems, rope_of
from rlhpc.errors import ConfigError
from rlhpc.preflight import load_config

MODELS = Path(__file__).resolve().parents[1] / "support" / "models"
LLAMA_32_1B = MODELS / "llama-3.2-1b-instruct"  # tied, llama3 RoPE: the published config.json


def megatron(model: Path, *sets: str) -> list[str]:
    return [f"model.path={model}", "actor.backend=megatron", "cluster.gpus_per_node=4", *sets]


def variant(tmp_path: Path, **changes: object) -> Path:
    """Llama-3.2-1B's config.json with ``changes`` (None: the key removed)."""
    hf = json.loads((LLAMA_32_1B / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            hf.pop(k, None)
        else:
            hf[k] = v
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf))
    return d


def test_a_tied_llama3_model_passes_the_preflight_on_one_pipeline_stage():
    cfg = load_config(None, megatron(LLAMA_32_1B, "actor.megatron.tensor_model_parallel_size=2"))
    assert cfg.actor.backend == "megatron"
    rope = rope_of(json.loads((LLAMA_32_1B / "config.json").read_text()))
    assert (rope.type, rope.theta, rope.params["factor"]) == ("llama3", 500000.0, 32.0)


def test_tied_embeddings_over_pipeline_stages_are_refused_at_submit_with_the_fix():
    sets = megatron(LLAMA_32_1B, "actor.megatron.pipeline_model_parallel_size=2", "cluster.actor_num_gpus=2")
    with pytest.raises(ConfigError, match=r"tied embeddings .* actor.megatron.pipeline_model_parallel_size = 2") as e:
        load_config(None, sets)
    assert "pipeline_model_parallel_size: 1" in e.value.fix and "actor.backend: torch" in e.value.fix
    # the torch actor trains it
    load_config(None, [s for s in sets if not s.startswith("actor.")])


@pytest.mark.parametrize(
    ("changes", "refusal"),
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE type 'dynamic'"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "'longrope'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "without low_freq_factor, high_freq_factor"),
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 8192,
                    "attention_factor": 2.0,
                }
            },
            "YaRN with attention_factor 2.0",
        ),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type 'gemma'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"use_sliding_window": True}, "sliding-window"),
    ],
    ids=[
        "dynamic",
        "longrope",
        "llama3-incomplete",
        "yarn-attention-factor",
        "partial",
        "gemma",
        "gelu",
        "bias",
        "swa",
    ],
)
def test_what_the_megatron_actor_cannot_build_is_refused_at_submit(tmp_path, changes, refusal):
    with pytest.raises(ConfigError, match=re.escape(refusal)) as e:
        load_config(None, megatron(variant(tmp_path, **changes)))
    assert "actor.backend megatron cannot train" in str(e.value) and e.value.fix


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"type": "linear", "factor": 2.0},  # the older spelling
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen's long context
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
            "attention_factor": 1.1386294361,
        },
        None,
    ],
    ids=["linear", "linear-old-spelling", "yarn", "yarn-its-own-attention-factor", "default"],
)
def test_the_rope_types_the_actor_builds_pass(tmp_path, rope):
    model = variant(tmp_path, rope_scaling=rope, tie_word_embeddings=False)
    assert problems(json.loads((model / "config.json").read_text()), pipeline_stages=2) == []
    load_config(None, megatron(model, "actor.megatron.pipeline_model_parallel_size=2", "cluster.actor_num_gpus=2"))


def test_sglang_ties_lm_head_itself_so_a_push_sends_embed_tokens_once():
    """SGLang 0.5.23's Llama skips ``lm_head.weight`` of a tied model and points lm_head at
    embed_tokens; Qwen2/Qwen3 copy a pushed ``embed_tokens`` into lm_head where it is a separate
    tensor. So the megatron actor's tied model (no output layer of its own) pushes
    ``model.embed_tokens.weight`` and no ``lm_head.weight``, as the torch actor's does."""
    llama = sgl.source("sglang/srt/models/llama.py")
    assert 'if self.config.tie_word_embeddings and "lm_head.weight" in name:\n                continue' in llama
    assert "self.lm_head = self.model.embed_tokens" in llama
    for model in ("qwen2", "qwen3"):
        src = sgl.source(f"sglang/srt/models/{model}.py")
        assert re.search(
            r'if name == "model\.embed_tokens\.weight":\n.*?tie_word_embeddings:\n\s+if "lm_head\.weight" in params_dict:',
            src,
            re.S,
        ), model
        assert "self.lm_head = self.model.embed_tokens" in src, model


@pytest.mark.parametrize(
    ("sets", "refusal"),
    [
        (["model.tiny.architecture=llama", "actor.megatron.expert_model_parallel_size=2"], "a llama model: no experts"),
        (
            ["model.tiny.architecture=qwen3_moe", "model.tiny.num_experts=6", "actor.megatron.expert_model_parallel_size=4"],
            "= 4 does not divide the 6 experts",
        ),
        (
            ["model.tiny.architecture=qwen3_moe", "model.tiny.num_hidden_layers=4", "cluster.actor_num_gpus=2",
             "actor.megatron.pipeline_model_parallel_size=2", "actor.megatron.virtual_pipeline_model_parallel_size=2"],
            "a MoE model: virtual stages",
        ),
    ],
    ids=["ep-without-experts", "ep-not-dividing-experts", "moe-virtual-stages"],
)  # fmt: skip
def test_a_layout_the_experts_do_not_split_into_is_refused_at_submit(sets, refusal):
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        load_config("jobs/configs/embedded.yaml", ["actor.backend=megatron", "cluster.gpus_per_node=8", *sets])
