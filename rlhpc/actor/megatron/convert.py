"""HF Llama/Qwen2 <-> megatron-core GPTModel (local spec) weight conversion, with TP sharding.

Pure functions over state dicts of CPU/GPU tensors; no process groups needed.

Layout, per decoder layer ``i`` (megatron name <- HF name):

* ``decoder.layers.i.input_layernorm.weight`` <- ``model.layers.i.input_layernorm.weight``
* ``decoder.layers.i.self_attention.linear_qkv.{weight,bias}`` <- ``self_attn.{q,k,v}_proj``,
  fused per query group: for each of the ``num_kv_heads`` groups, its ``heads/kv_heads`` query
  heads, then its key head, then its value head (rows of ``head_dim``). Column parallel: each
  TP rank holds ``kv_heads/tp`` whole groups, i.e. a contiguous block of rows.
* ``decoder.layers.i.self_attention.linear_proj.weight`` <- ``self_attn.o_proj.weight``; row
  parallel: split along the input dim (1).
* ``decoder.layers.i.pre_mlp_layernorm.weight`` <- ``post_attention_layernorm.weight``
* ``decoder.layers.i.mlp.linear_fc1.weight`` <- ``[gate_proj; up_proj]`` (SwiGLU: megatron
  chunks fc1's output in two, ``silu(first) * second``). Column parallel: each rank holds
  ``[gate shard; up shard]``, so gate and up are split separately, then concatenated.
* ``decoder.layers.i.mlp.linear_fc2.weight`` <- ``mlp.down_proj.weight``; row parallel (dim 1).

Plus ``embedding.word_embeddings.weight`` <- ``model.embed_tokens.weight`` (vocab parallel,
dim 0), ``decoder.final_layernorm.weight`` <- ``model.norm.weight`` and ``output_layer.weight``
<- ``lm_head.weight`` (column parallel, dim 0). Both vocab matrices are zero-padded to
megatron's padded vocab (``model.padded_vocab_size``) and un-padded on the way back.
Layernorms are replicated on every TP rank.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhpc.actor.megatron.model import padded_vocab_size

Tensor = torch.Tensor
StateDict = dict[str, Tensor]


def _dims(hf_config: Any) -> tuple[int, int, int]:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim


def _check_tp(hf_config: Any, tp_size: int) -> None:
    heads, kv_heads, _ = _dims(hf_config)
    if kv_heads % tp_size or heads % tp_size or hf_config.intermediate_size % tp_size:
        raise ValueError(
            f"TP={tp_size} must divide heads ({heads}), kv heads ({kv_heads}) and ffn size "
            f"({hf_config.intermediate_size})"
        )


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, heads: int, kv_heads: int, head_dim: int) -> Tensor:
    """HF q/k/v (weights ``[out, in]`` or biases ``[out]``) -> megatron's per-group interleaved qkv."""
    rest = q.shape[1:]
    per_group = heads // kv_heads
    q = q.reshape(kv_heads, per_group * head_dim, *rest)
    k = k.reshape(kv_heads, head_dim, *rest)
    v = v.reshape(kv_heads, head_dim, *rest)
    return torch.cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, heads: int, kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of :func:`fuse_qkv` (works on a TP shard too, given that shard's head counts)."""
    rest = qkv.shape[1:]
    per_group = heads // kv_heads
    g = qkv.reshape(kv_heads, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(g, [per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(w: Tensor, rows: int) -> Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], dim=0)


def hf_to_megatron_full(hf_sd: StateDict, hf_config: Any, tp_size: int = 1) -> StateDict:
    """HF state dict -> the *unsharded* megatron state dict (vocab padded for ``tp_size``).

    For column-parallel fused tensors (qkv, fc1) the unsharded layout is the TP=1 one; use
    :func:`shard_for_tp` to get one rank's slice.
    """
    heads, kv_heads, head_dim = _dims(hf_config)
    vocab = padded_vocab_size(hf_config.vocab_size, tp_size)
    out: StateDict = {
        "embedding.word_embeddings.weight": _pad_rows(hf_sd["model.embed_tokens.weight"], vocab),
        "decoder.final_layernorm.weight": hf_sd["model.norm.weight"],
        "output_layer.weight": _pad_rows(hf_sd["lm_head.weight"], vocab),
    }
    for i in range(hf_config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + "input_layernorm.weight"] = hf_sd[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf_sd[h + "post_attention_layernorm.weight"]
        for kind in ("weight", "bias"):
            names = [f"{h}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if kind == "bias" and names[0] not in hf_sd:
                continue
            q, k, v = (hf_sd[n] for n in names)
            out[f"{m}self_attention.linear_qkv.{kind}"] = fuse_qkv(q, k, v, heads, kv_heads, head_dim)
        if h + "self_attn.o_proj.bias" in hf_sd:
            raise NotImplementedError("o_proj bias")
        out[m + "self_attention.linear_proj.weight"] = hf_sd[h + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_sd[h + "mlp.gate_proj.weight"], hf_sd[h + "mlp.up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = hf_sd[h + "mlp.down_proj.weight"]
    return out


def layer_index(name: str) -> int | None:
    """The decoder layer a megatron tensor belongs to (None for embedding, final norm, output)."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("decoder.layers.") else None


def megatron_full_to_hf(mg_sd: StateDict, hf_config: Any) -> StateDict:
    """Inverse of :func:`hf_to_megatron_full` (drops vocab padding).

    ``mg_sd`` may also be a part of the model made of whole layers and/or the non-layer
    tensors (embedding, final norm, output layer): weight sync converts one layer at a time.
    """
    heads, kv_heads, head_dim = _dims(hf_config)
    vocab = hf_config.vocab_size
    globals_ = {
        "embedding.word_embeddings.weight": ("model.embed_tokens.weight", lambda t: t[:vocab]),
        "decoder.final_layernorm.weight": ("model.norm.weight", lambda t: t),
        "output_layer.weight": ("lm_head.weight", lambda t: t[:vocab]),
    }
    out: StateDict = {hf: fn(mg_sd[mg]) for mg, (hf, fn) in globals_.items() if mg in mg_sd}
    for i in sorted({i for i in map(layer_index, mg_sd) if i is not None}):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[h + "input_layernorm.weight"] = mg_sd[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = mg_sd[m + "pre_mlp_layernorm.weight"]
        for kind in ("weight", "bias"):
            key = f"{m}self_attention.linear_qkv.{kind}"
            if key not in mg_sd:
                continue
            for p, t in zip("qkv", split_qkv(mg_sd[key], heads, kv_heads, head_dim)):
                out[f"{h}self_attn.{p}_proj.{kind}"] = t
        out[h + "self_attn.o_proj.weight"] = mg_sd[m + "self_attention.linear_proj.weight"]
        gate, up = torch.chunk(mg_sd[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = mg_sd[m + "mlp.linear_fc2.weight"]
    return out


# How each megatron tensor is split over TP ranks: dim to split, or None if replicated.
# fc1 is special (gate and up split separately), see _shard / _gather.
def _tp_dim(name: str) -> int | None:
    if name.endswith("layernorm.weight"):
        return None
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1  # row parallel
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight")):
        return 0  # column parallel
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0  # vocab parallel
    raise KeyError(f"no TP rule for {name}")


def shard_for_tp(mg_full: StateDict, tp_size: int, tp_rank: int) -> StateDict:
    """One TP rank's slice of an unsharded megatron state dict.

    qkv needs no special case: its rows are ordered by query group, and each rank owns a
    contiguous block of ``kv_heads / tp_size`` groups.
    """
    out: StateDict = {}
    for name, t in mg_full.items():
        dim = _tp_dim(name)
        if dim is None:
            out[name] = t
        elif name.endswith("linear_fc1.weight"):
            gate, up = torch.chunk(t, 2, dim=0)
            out[name] = torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
        else:
            if t.shape[dim] % tp_size:
                raise ValueError(f"{name}: dim {dim} of {tuple(t.shape)} not divisible by TP={tp_size}")
            out[name] = t.chunk(tp_size, dim)[tp_rank]
    return {k: v.contiguous() for k, v in out.items()}


def gather_tp_shards(shards: list[StateDict]) -> StateDict:
    """Inverse of :func:`shard_for_tp`: the TP ranks' state dicts (in rank order) -> unsharded."""
    out: StateDict = {}
    for name, t in shards[0].items():
        if name.endswith("_extra_state"):
            continue
        dim = _tp_dim(name)
        if dim is None:
            out[name] = t
        elif name.endswith("linear_fc1.weight"):
            halves = [s[name].chunk(2, dim=0) for s in shards]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        else:
            out[name] = torch.cat([s[name] for s in shards], dim=dim)
    return out


def hf_to_megatron(hf_sd: StateDict, hf_config: Any, tp_size: int = 1, tp_rank: int = 0) -> StateDict:
    """HF state dict -> the megatron state dict of TP rank ``tp_rank`` (load with ``load_into``)."""
    _check_tp(hf_config, tp_size)
    return shard_for_tp(hf_to_megatron_full(hf_sd, hf_config, tp_size), tp_size, tp_rank)


def megatron_to_hf(shards: list[StateDict], hf_config: Any) -> StateDict:
    """All TP ranks' megatron state dicts (rank order) -> the HF state dict."""
    return megatron_full_to_hf(gather_tp_shards(shards), hf_config)


def load_into(model: torch.nn.Module, mg_sd: StateDict) -> None:
    """Copy a converted state dict into a megatron module; every parameter must be covered."""
    missing, unexpected = model.load_state_dict(mg_sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")


def model_state_dict(model: torch.nn.Module) -> StateDict:
    """A megatron module's tensors, without the ``_extra_state`` placeholders, detached."""
    return {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
