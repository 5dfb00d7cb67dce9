"""Which HF models the megatron actor trains, decided from config.json alone (no torch, no
megatron-core): the preflight refuses the rest at submit, the ranks check the same again.

Trained: Llama, Qwen2, Qwen3 and Qwen3-MoE with SiLU MLPs, tied or untied embeddings (tied:
on one pipeline stage; with more, megatron-core keeps a copy of the embedding on the last stage
whose gradients and checkpoints rlhpc does not handle), and RoPE of type default, ``linear``,
``llama3`` or ``yarn`` (``rope_parameters``, or the older ``rope_scaling`` + ``rope_theta``) as
megatron-core 0.16 builds them (``model.build_gpt_model``). The engines read the same config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhpc.config import Config
from rlhpc.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")  # RMSNorm over each head's queries and keys
MOE_MODEL_TYPES = ("qwen3_moe",)
TORCH = "train it with actor.backend: torch (any transformers causal LM)"
# the RoPE types the actor builds, and the parameters each needs (transformers' names)
ROPE_NEEDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",),
}
ROPE_TYPES = tuple(ROPE_NEEDS)


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding: its type, base and the type's parameters (transformers' names)."""

    type: str
    theta: float
    params: dict[str, Any] = field(default_factory=dict)

    def yarn_factor(self, max_position_embeddings: int | None) -> float:
        """YaRN's scaling factor as transformers takes it (unset: the context's growth)."""
        factor = self.params.get("factor")
        if factor is None:
            factor = max_position_embeddings / self.params["original_max_position_embeddings"]
        return float(factor)

    def yarn_mscales(self) -> tuple[float | None, float | None]:
        """(mscale, mscale_all_dim) as transformers uses them: both set and non-zero, else neither
        (its attention factor is then YaRN's 0.1 ln(factor) + 1, as megatron-core's without them)."""
        m, m_all = self.params.get("mscale"), self.params.get("mscale_all_dim")
        return (float(m), float(m_all)) if m and m_all else (None, None)

    def yarn_attention_factor(self, max_position_embeddings: int | None) -> float:
        """The factor on cos and sin that megatron-core's YaRN applies (its concentration factor)."""

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        factor, (m, m_all) = self.yarn_factor(max_position_embeddings), self.yarn_mscales()
        return mscale(factor, m) / mscale(factor, m_all) if m is not None else mscale(factor)


def rope_of(hf: dict) -> Rope:
    """The RoPE of an HF config (a config.json's dict, or ``PretrainedConfig.to_dict()``)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    theta = params.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    return Rope(str(rope_type), float(theta), params)


def problems(hf: dict, pipeline_stages: int = 1) -> list[tuple[str, str]]:
    """(problem, fix) for everything in ``hf`` the megatron actor cannot train; empty: it can."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return [
            (
                f"model_type {model_type!r}: the megatron actor builds {', '.join(SUPPORTED_MODEL_TYPES)} only",
                f"use a Llama, Qwen2, Qwen3 or Qwen3-MoE model, or {TORCH}",
            )
        ]
    out = []
    if hf.get("hidden_act", "silu") != "silu":
        out.append((f"hidden_act {hf['hidden_act']!r} (the megatron actor's MLP is SwiGLU)", TORCH))
    if hf.get("attention_bias") and model_type != "qwen2":
        # Qwen2's q/k/v biases are its own (no flag); a Llama/Qwen3 flag adds o_proj's too
        out.append(("attention_bias: true (biases on the attention projections, o_proj's too)", TORCH))
    if hf.get("mlp_bias"):
        out.append(("mlp_bias: true (biases on the MLP projections)", TORCH))
    if hf.get("use_sliding_window"):
        out.append(("use_sliding_window: true (sliding-window attention)", TORCH))
    if model_type in MOE_MODEL_TYPES and (hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1):
        out.append(("a Qwen3-MoE with dense layers (mlp_only_layers, decoder_sparse_step != 1)", TORCH))
    if hf.get("tie_word_embeddings") and pipeline_stages > 1:
        out.append(
            (
                f"tied embeddings (tie_word_embeddings: true) with actor.megatron.pipeline_model_parallel_size = "
                f"{pipeline_stages}: the output layer is the embedding, which only the first stage holds",
                "set actor.megatron.pipeline_model_parallel_size: 1 (models with tied embeddings are small: "
                f"tensor or data parallelism instead), or {TORCH}",
            )
        )
    out += _rope_problems(hf)
    return out


def _rope_problems(hf: dict) -> list[tuple[str, str]]:
    rope = rope_of(hf)
    fix = f"use a model whose RoPE is one of {', '.join(ROPE_TYPES)}, or {TORCH}"
    if rope.type not in ROPE_NEEDS:
        return [(f"RoPE type {rope.type!r} (the megatron actor builds {', '.join(ROPE_TYPES)})", fix)]
    if rope.params.get("partial_rotary_factor", 1.0) != 1.0 or hf.get("partial_rotary_factor", 1.0) != 1.0:
        return [("RoPE over part of each head (partial_rotary_factor < 1)", fix)]
    missing = [k for k in ROPE_NEEDS[rope.type] if rope.params.get(k) is None]
    if rope.type == "yarn" and rope.params.get("factor") is None and not hf.get("max_position_embeddings"):
        missing.append("factor")  # nor the context it would be derived from
    if missing:
        return [(f"RoPE type {rope.type!r} without {', '.join(missing)}", "complete rope_parameters in config.json")]
    explicit = rope.params.get("attention_factor")
    if rope.type == "yarn" and explicit is not None:
        derived = rope.yarn_attention_factor(hf.get("max_position_embeddings"))
        if not math.isclose(explicit, derived):  # megatron-core only derives it
            return [(f"YaRN with attention_factor {explicit} (megatron-core's YaRN applies {derived:.6g})", fix)]
    return []


def check_supported(hf: dict, pipeline_stages: int, model: str) -> None:
    """Raise, naming the first problem and its fix, unless the megatron actor trains ``hf``."""
    found = problems(hf, pipeline_stages)
    if found:
        problem, fix = found[0]
        raise ConfigError(f"actor.backend megatron cannot train {model}: {problem}", fix)


def check_model(cfg: Config) -> None:
    """At submit (``rlhpc.preflight``): refuse a model the megatron actor cannot train, or a
    layout its experts do not split into, naming the fix, rather than on the allocation once
    its ranks build the model."""
    if cfg.actor.backend != "megatron":
        return
    m = cfg.actor.megatron
    if cfg.model.tiny is not None:  # the built architectures, untied, default RoPE
        t = cfg.model.tiny
        hf, model = {"model_type": t.architecture, "num_experts": t.num_experts}, "model.tiny"
    else:
        try:
            hf, model = json.loads((Path(cfg.model.path) / "config.json").read_text()), cfg.model.path
        except (OSError, ValueError):
            return  # config.check_model names a missing config.json
        check_supported(hf, m.pipeline_model_parallel_size, model)
    experts = int(hf.get("num_experts") or 0) if hf.get("model_type") in MOE_MODEL_TYPES else 0
    ep = m.expert_model_parallel_size
    if ep > 1 and not experts:
        raise ConfigError(
            f"actor.megatron.expert_model_parallel_size = {ep} for {model}, a {hf.get('model_type')} model: no experts",
            "set actor.megatron.expert_model_parallel_size: 1, or train a MoE model (qwen3_moe)",
        )
    if experts % ep:
        raise ConfigError(
            f"actor.megatron.expert_model_parallel_size = {ep} does not divide the {experts} experts of {model}",
            f"choose an expert-parallel size that divides {experts}",
        )
    if experts and m.virtual_pipeline_model_parallel_size is not None:
        raise ConfigError(
            f"actor.megatron.virtual_pipeline_model_parallel_size = {m.virtual_pipeline_model_parallel_size} for "
            f"{model}, a MoE model: virtual stages are built for dense models only (the empty micro-batches "
            "they add would count in the router's load-balancing loss)",
            "set actor.megatron.virtual_pipeline_model_parallel_size: null for MoE models",
        )
