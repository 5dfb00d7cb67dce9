"""Build a megatron-core ``GPTModel`` (local spec, no Transformer Engine) from an HF Llama/Qwen2 config.

Needs ``megatron.core.parallel_state.initialize_model_parallel`` to have run in this process
(the tensor-parallel size comes from there). On a CPU-only process, call
``rlhpc.actor.megatron.cpu_shim.apply_cpu_shim()`` first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def rope_theta(hf_config: Any) -> float:
    """RoPE base from either the old (``rope_theta``) or new (``rope_parameters``) HF config layout."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    theta = params.get("rope_theta") if isinstance(params, dict) else None
    if theta is None:
        theta = getattr(hf_config, "rope_theta", 10000.0)
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    rope_type = (params if isinstance(params, dict) else {}).get("rope_type") or scaling.get("rope_type", "default")
    if rope_type not in ("default", None):
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported yet")
    return float(theta)


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: a multiple of ``divisible_by * tp_size`` (every TP shard equal)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(hf_config: Any, tp_size: int = 1, dtype: torch.dtype = torch.float32, **overrides: Any):
    """The ``TransformerConfig`` matching an HF Llama/Qwen2 config (dropout off, no fusions)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise NotImplementedError(f"model_type {hf_config.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise NotImplementedError(f"hidden_act {hf_config.hidden_act!r}")
    heads = hf_config.num_attention_heads
    kwargs: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=hf_config.model_type == "qwen2",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=tp_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt_model(hf_config: Any, tp_size: int = 1, parallel_output: bool = True, **config_overrides: Any):
    """An untied-embedding megatron ``GPTModel`` for ``hf_config`` (vocab padded, see ``padded_vocab_size``).

    ``parallel_output=False`` gathers the logits over tensor-parallel ranks (full vocab on
    every rank); the default keeps them vocab-sharded as training wants.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    if getattr(hf_config, "tie_word_embeddings", False):
        raise NotImplementedError("tied embeddings")
    config = transformer_config(hf_config, tp_size=tp_size, **config_overrides)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp_size),
        max_sequence_length=hf_config.max_position_embeddings,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
