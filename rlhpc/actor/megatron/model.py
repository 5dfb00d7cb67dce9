"""Build a megatron-core ``GPTModel`` (local spec, no Transformer Engine) from an HF Llama, Qwen2,
Qwen3 (QK-norm) or Qwen3-MoE (QK-norm, routed experts) config.

Needs ``megatron.core.parallel_state.initialize_model_parallel`` to have run in this process
(the tensor-parallel size comes from there). On a CPU-only process, call
``rlhpc.actor.megatron.cpu_shim.apply_cpu_shim()`` first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlhpc.actor.megatron.support import MOE_MODEL_TYPES, QK_NORM_MODEL_TYPES, Rope, check_supported, rope_of


def is_moe(hf_config: Any) -> bool:
    return hf_config.model_type in MOE_MODEL_TYPES


def num_experts(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_experts", 0) or 0) if is_moe(hf_config) else 0


def _define_missing_te_names() -> None:
    """megatron-core 0.16's router gating reads ``te_general_gemm``, which its ``moe_utils`` only
    defines when Transformer Engine imports: without TE a MoE forward raises NameError. None is
    what its own code checks for to take the torch path."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int = 128) -> int:
    """Megatron's vocab padding: a multiple of ``divisible_by * tp_size`` (every TP shard equal)."""
    multiple = divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def transformer_config(
    hf_config: Any, tp_size: int = 1, dtype: torch.dtype = torch.float32, pp_size: int = 1, **overrides: Any
):
    """The ``TransformerConfig`` matching an HF Llama/Qwen2/Qwen3/Qwen3-MoE config (dropout off, no fusions).

    ``pp_size`` > 1: the layers split evenly over that many pipeline stages, activations sent
    between them in ``dtype`` with their shapes (micro-batches differ in rows and length).

    For MoE, ``overrides`` take ``expert_model_parallel_size``, ``moe_aux_loss_coeff`` and
    ``moe_router_load_balancing_type``.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    # what the preflight refused at submit, checked again for a model that got here another way
    check_supported(hf_config.to_dict(), pp_size, getattr(hf_config, "name_or_path", "") or "this model")
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
        qk_layernorm=hf_config.model_type in QK_NORM_MODEL_TYPES,
        pipeline_model_parallel_size=pp_size,
    )
    if pp_size > 1:
        kwargs["pipeline_dtype"] = dtype
        interleaved = bool(overrides.get("virtual_pipeline_model_parallel_size"))
        if interleaved:
            # The interleaved schedule sends activations to the next stage and gradients to the
            # previous one in one exchange; at PP=2 both are the same rank, and batched
            # (batch_isend_irecv on one group) the receiver pairs each message with the other's
            # buffer. Unbatched, megatron sends them in matching orders (even/odd ranks).
            kwargs["batch_p2p_comm"] = False
        if not is_moe(hf_config) and not interleaved:
            # megatron-core 0.16 refuses variable lengths with the default "allgather" dispatcher
            # even in a dense model, which builds no dispatcher: name another, unused here. (A MoE
            # pipeline pads every micro-batch of a step to one shape instead: the worker's
            # _pipeline; so does one with virtual stages: megatron exchanges the shapes batched,
            # always, which pairs them wrongly at PP=2 as above.)
            kwargs.update(variable_seq_lengths=True, moe_token_dispatcher_type="alltoall")
    if is_moe(hf_config):
        kwargs.update(
            num_moe_experts=hf_config.num_experts,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size,
            moe_router_topk=hf_config.num_experts_per_tok,
            # HF: softmax over all experts, top-k, renormalised if norm_topk_prob. megatron's
            # default (top-k of the logits, then softmax over those k) is the renormalised case;
            # pre-softmax is the other.
            moe_router_pre_softmax=not hf_config.norm_topk_prob,
            moe_router_dtype="fp32",  # HF's router softmax is in float32
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=getattr(hf_config, "router_aux_loss_coef", 0.0),
            # grouped GEMM needs TE or CUDA kernels; the all-to-all dispatcher creates CUDA
            # streams: the allgather dispatcher and one MLP per expert run anywhere.
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="allgather",
        )
    kwargs.update(overrides)
    config = TransformerConfig(**kwargs)
    rope = rope_of(hf_config.to_dict())
    if rope.type == "yarn":
        # GPTModel builds its YaRN embedding from these (no TransformerConfig fields: megatron's
        # MLA config has them), and its attention scales q and k by the attention factor they give
        m, m_all = rope.yarn_mscales()
        config.yarn_rotary_scaling_factor = rope.yarn_factor(hf_config.max_position_embeddings)
        config.yarn_original_max_position_embeddings = rope.params["original_max_position_embeddings"]
        config.yarn_beta_fast = rope.params.get("beta_fast") or 32.0
        config.yarn_beta_slow = rope.params.get("beta_slow") or 1.0
        config.yarn_mscale, config.yarn_mscale_all_dim = m, m_all
        config.yarn_correction_range_round_to_int = rope.params.get("truncate", True)
    return config


def build_gpt_model(
    hf_config: Any,
    tp_size: int = 1,
    parallel_output: bool = True,
    pp_size: int = 1,
    vp_stage: int | None = None,
    **config_overrides: Any,
):
    """A megatron ``GPTModel`` for ``hf_config`` (vocab padded, see ``padded_vocab_size``; tied
    embeddings and RoPE scaling as the HF config says: ``_rope``).

    ``parallel_output=False`` gathers the logits over tensor-parallel ranks (full vocab on
    every rank); the default keeps them vocab-sharded as training wants. ``pp_size`` > 1: this
    process's pipeline stage only (from megatron's parallel state): its layers, the embedding
    on the first stage, the final norm and output layer on the last. With virtual pipeline
    stages (megatron's parallel state set up with them), model chunk ``vp_stage`` of this
    stage: the embedding in chunk 0 of the first stage, the output in the last chunk of the last.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    vp = mpu.get_virtual_pipeline_model_parallel_world_size() if pp_size > 1 else None
    if vp is not None:
        config_overrides["virtual_pipeline_model_parallel_size"] = vp
    config = transformer_config(hf_config, tp_size=tp_size, pp_size=pp_size, **config_overrides)
    if is_moe(hf_config):
        _define_missing_te_names()
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=config.qk_layernorm,
        normalization="RMSNorm",
    )
    rope = rope_of(hf_config.to_dict())
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp_size),
        max_sequence_length=hf_config.max_position_embeddings,
        parallel_output=parallel_output,
        # tied: the output layer multiplies by the embedding (one pipeline stage: support.py)
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="yarn" if rope.type == "yarn" else "rope",
        rotary_base=rope.theta,
        # linear: positions divided by the factor (transformers divides the frequencies: the same angles)
        seq_len_interpolation_factor=rope.params["factor"] if rope.type == "linear" else None,
        pre_process=pp_size == 1 or mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=pp_size == 1 or mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        vp_stage=vp_stage,
    )
    _rope(gpt, rope)
    return gpt


def _rope(gpt: Any, rope: Rope) -> None:
    """Llama 3's frequency scaling with the model's own parameters. megatron-core 0.16's
    ``rope_scaling`` flag fixes three of them (low/high frequency factors 1 and 4, original
    context 8192, Llama 3.1's); its ``RotaryEmbedding._apply_scaling`` takes all four, and the
    frequencies are read at each forward, so they are set once here, before any."""
    if rope.type != "llama3":
        return
    p, emb = rope.params, gpt.rotary_pos_emb
    emb.inv_freq = emb._apply_scaling(
        emb.inv_freq,
        factor=p["factor"],
        low_freq_factor=p["low_freq_factor"],
        high_freq_factor=p["high_freq_factor"],
        original_max_position_embeddings=p["original_max_position_embeddings"],
    )
