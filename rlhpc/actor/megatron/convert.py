"""HF Llama/Qwen2/Qwen3/Qwen3-MoE <-> megatron-core GPTModel (local spec) weight conversion,
with TP and expert-parallel (EP) sharding.

Pure functions over state dicts of CPU/GPU tensors; no process groups needed. The actor's
ranks load with :func:`shard_tensor` instead: each tensor's part a rank holds, read slice by
slice from the checkpoint (``hf_reader``), equal to :func:`hf_to_megatron`'s.

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
* Qwen3 (QK-norm): ``self_attention.{q,k}_layernorm.weight`` <- ``self_attn.{q,k}_norm.weight``
  (one ``head_dim`` vector shared by every head: replicated).
* Qwen3-MoE: ``mlp.router.weight`` <- ``mlp.gate.weight`` (replicated), and for expert ``e``
  ``mlp.experts.local_experts.e.linear_fc1.weight`` <- ``mlp.experts.gate_up_proj[e]`` (HF
  keeps the experts as one 3-D tensor in memory, gate rows then up rows: megatron's fc1 order)
  and ``...linear_fc2.weight`` <- ``mlp.experts.down_proj[e]``; TP-split as fc1/fc2 above
  (megatron's expert-TP size is the TP size). Under expert parallelism EP rank ``r`` holds
  experts ``[r*E/EP, (r+1)*E/EP)`` numbered from 0 (``shard_for_ep``).

Plus ``embedding.word_embeddings.weight`` <- ``model.embed_tokens.weight`` (vocab parallel,
dim 0), ``decoder.final_layernorm.weight`` <- ``model.norm.weight`` and ``output_layer.weight``
<- ``lm_head.weight`` (column parallel, dim 0; none with ``tie_word_embeddings``: megatron's
output layer then uses the embedding, and the engines tie ``lm_head`` themselves). Both vocab
matrices are zero-padded to megatron's padded vocab (``model.padded_vocab_size``) and
un-padded on the way back.
Layernorms are replicated on every TP rank.
"""

from __future__ import annotations

from typing import Any

import torch

from rlhpc.actor.megatron.model import is_moe, num_experts, padded_vocab_size

Tensor = torch.Tensor
StateDict = dict[str, Tensor]


def _dims(hf_config: Any) -> tuple[int, int, int]:
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return heads, kv_heads, head_dim


def _check_tp(hf_config: Any, tp_size: int) -> None:
    heads, kv_heads, _ = _dims(hf_config)
    ffn = hf_config.moe_intermediate_size if is_moe(hf_config) else hf_config.intermediate_size
    if kv_heads % tp_size or heads % tp_size or ffn % tp_size:
        raise ValueError(f"TP={tp_size} must divide heads ({heads}), kv heads ({kv_heads}) and ffn size ({ffn})")


def _check_ep(hf_config: Any, ep_size: int) -> None:
    experts = num_experts(hf_config)
    if ep_size > 1 and (not experts or experts % ep_size):
        raise ValueError(f"EP={ep_size} must divide the number of experts ({experts or 'none: not a MoE model'})")


EXPERT = ".mlp.experts.local_experts."


def expert_index(name: str) -> int | None:
    """The (local) expert a megatron tensor belongs to, None for everything else."""
    if EXPERT not in name:
        return None
    return int(name.split(EXPERT, 1)[1].split(".", 1)[0])


def _renumber_expert(name: str, new: int) -> str:
    head, tail = name.split(EXPERT, 1)
    return f"{head}{EXPERT}{new}.{tail.split('.', 1)[1]}"


def shard_for_ep(mg_sd: StateDict, hf_config: Any, ep_size: int, ep_rank: int) -> StateDict:
    """EP rank ``ep_rank``'s part of a state dict numbered by global expert: its own experts,
    renumbered from 0, and every non-expert tensor."""
    if ep_size == 1:
        return dict(mg_sd)
    per_rank = num_experts(hf_config) // ep_size
    first = ep_rank * per_rank
    out: StateDict = {}
    for name, t in mg_sd.items():
        e = expert_index(name)
        if e is None:
            out[name] = t
        elif first <= e < first + per_rank:
            out[_renumber_expert(name, e - first)] = t
    return out


def gather_ep_shards(shards: list[StateDict]) -> StateDict:
    """Inverse of :func:`shard_for_ep`: the EP ranks' state dicts (in rank order) -> global numbering."""
    if len(shards) == 1:
        return dict(shards[0])
    per_rank = 1 + max((e for e in map(expert_index, shards[0]) if e is not None), default=-1)
    out = {name: t for name, t in shards[0].items() if expert_index(name) is None}
    for r, shard in enumerate(shards):
        for name, t in shard.items():
            e = expert_index(name)
            if e is not None:
                out[_renumber_expert(name, r * per_rank + e)] = t
    return out


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
    }
    if not getattr(hf_config, "tie_word_embeddings", False):  # tied: the embedding is the output layer
        out["output_layer.weight"] = _pad_rows(hf_sd["lm_head.weight"], vocab)
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
        for p in "qk":
            if f"{h}self_attn.{p}_norm.weight" in hf_sd:
                out[f"{m}self_attention.{p}_layernorm.weight"] = hf_sd[f"{h}self_attn.{p}_norm.weight"]
        if is_moe(hf_config):
            out[m + "mlp.router.weight"] = hf_sd[h + "mlp.gate.weight"]
            gate_up, down = hf_sd[h + "mlp.experts.gate_up_proj"], hf_sd[h + "mlp.experts.down_proj"]
            for e in range(gate_up.shape[0]):
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"] = gate_up[e]
                out[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"] = down[e]
            continue
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf_sd[h + "mlp.gate_proj.weight"], hf_sd[h + "mlp.up_proj.weight"]], dim=0
        )
        out[m + "mlp.linear_fc2.weight"] = hf_sd[h + "mlp.down_proj.weight"]
    return out


def layer_index(name: str) -> int | None:
    """The decoder layer a megatron tensor belongs to (None for embedding, final norm, output)."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("decoder.layers.") else None


def renumber_layer(name: str, new: int) -> str:
    """``decoder.layers.<i>.rest`` -> ``decoder.layers.<new>.rest``."""
    parts = name.split(".")
    return ".".join([*parts[:2], str(new), *parts[3:]])


def shard_for_pp(mg_sd: StateDict, first_layer: int, num_layers: int, first_stage: bool, last_stage: bool) -> StateDict:
    """One pipeline stage's part of a state dict numbered by global layer: layers
    ``[first_layer, first_layer + num_layers)`` renumbered from 0 (megatron numbers a stage's
    layers locally), the embedding on the first stage, the final norm and output layer on the last."""
    out: StateDict = {}
    for name, t in mg_sd.items():
        i = layer_index(name)
        if i is None:
            keep = first_stage if name.startswith("embedding.") else last_stage
            if keep:
                out[name] = t
        elif first_layer <= i < first_layer + num_layers:
            out[renumber_layer(name, i - first_layer)] = t
    return out


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
        for p in "qk":
            if f"{m}self_attention.{p}_layernorm.weight" in mg_sd:
                out[f"{h}self_attn.{p}_norm.weight"] = mg_sd[f"{m}self_attention.{p}_layernorm.weight"]
        if is_moe(hf_config):
            out[h + "mlp.gate.weight"] = mg_sd[m + "mlp.router.weight"]
            experts = range(num_experts(hf_config))
            for kind, hf_name in (("linear_fc1", "gate_up_proj"), ("linear_fc2", "down_proj")):
                out[f"{h}mlp.experts.{hf_name}"] = torch.stack(
                    [mg_sd[f"{m}mlp.experts.local_experts.{e}.{kind}.weight"] for e in experts]
                )
            continue
        gate, up = torch.chunk(mg_sd[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[h + "mlp.gate_proj.weight"] = gate
        out[h + "mlp.up_proj.weight"] = up
        out[h + "mlp.down_proj.weight"] = mg_sd[m + "mlp.linear_fc2.weight"]
    return out


# How each megatron tensor is split over TP ranks: dim to split, or None if replicated.
# fc1 is special (gate and up split separately), see _shard / _gather.
def _tp_dim(name: str) -> int | None:
    if name.endswith(("layernorm.weight", "mlp.router.weight")):
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


def hf_to_megatron(
    hf_sd: StateDict, hf_config: Any, tp_size: int = 1, tp_rank: int = 0, ep_size: int = 1, ep_rank: int = 0
) -> StateDict:
    """HF state dict -> the megatron state dict of TP rank ``tp_rank`` and EP rank ``ep_rank``
    (load with ``load_into``)."""
    _check_tp(hf_config, tp_size)
    _check_ep(hf_config, ep_size)
    full = shard_for_ep(hf_to_megatron_full(hf_sd, hf_config, tp_size), hf_config, ep_size, ep_rank)
    return shard_for_tp(full, tp_size, tp_rank)


def to_global(name: str, first_layer: int, first_expert: int) -> str:
    """A megatron module's name (layers numbered on its pipeline chunk, experts on its EP rank)
    -> the whole model's (``first_layer``, ``first_expert``: the first global numbers it holds)."""
    i = layer_index(name)
    if i is None:
        return name
    name = renumber_layer(name, i + first_layer)
    e = expert_index(name)
    return name if e is None else _renumber_expert(name, e + first_expert)


def shard_tensor(reader: Any, hf_config: Any, name: str, tp_size: int = 1, tp_rank: int = 0) -> Tensor:
    """TP rank ``tp_rank``'s part of megatron tensor ``name`` (global layer and expert numbers,
    see :func:`to_global`), read from the HF checkpoint slice by slice: ``reader.read(hf_name,
    index)`` returns ``hf_tensor[index]``, ``hf_name in reader`` says whether it holds one
    (``rlhpc.actor.megatron.hf_reader.HFReader``). Reads only the rows or columns this rank
    holds, in the checkpoint's dtype; equal to the same tensor of :func:`hf_to_megatron` on the
    whole state dict."""
    heads, kv_heads, head_dim = _dims(hf_config)
    read = reader.read

    def block(n: int) -> slice:  # rank tp_rank's part of n rows (or columns)
        return slice(tp_rank * n // tp_size, (tp_rank + 1) * n // tp_size)

    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        hf = "model.embed_tokens.weight"
        if name == "output_layer.weight" and not getattr(hf_config, "tie_word_embeddings", False):
            hf = "lm_head.weight"
        vocab, rows = hf_config.vocab_size, padded_vocab_size(hf_config.vocab_size, tp_size) // tp_size
        first = tp_rank * rows
        # the padding rows are zeros, not read
        real = read(hf, (slice(min(first, vocab), min(first + rows, vocab)),))
        return _pad_rows(real, rows)
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight")
    i = layer_index(name)
    if i is None:
        raise KeyError(f"no HF source for {name}")
    h, rest = f"model.layers.{i}.", name.split(".", 3)[3]
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
        "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
        "mlp.router.weight": "mlp.gate.weight",
    }
    if rest in simple:
        return read(h + simple[rest])
    if rest.startswith("self_attention.linear_qkv."):
        kind = rest.rsplit(".", 1)[1]
        groups, per_group = kv_heads // tp_size, heads // kv_heads
        q = read(f"{h}self_attn.q_proj.{kind}", (block(heads * head_dim),))
        k, v = (read(f"{h}self_attn.{p}_proj.{kind}", (block(kv_heads * head_dim),)) for p in "kv")
        return fuse_qkv(q, k, v, groups * per_group, groups, head_dim)
    if rest == "self_attention.linear_proj.weight":
        return read(h + "self_attn.o_proj.weight", (slice(None), block(heads * head_dim)))
    e = expert_index(name)
    if e is not None:
        return _expert_shard(reader, h, e, rest.rsplit(".", 2)[1], hf_config.moe_intermediate_size, block)
    if rest == "mlp.linear_fc1.weight":
        ffn = hf_config.intermediate_size
        return torch.cat([read(f"{h}mlp.{p}_proj.weight", (block(ffn),)) for p in ("gate", "up")], dim=0)
    if rest == "mlp.linear_fc2.weight":
        return read(h + "mlp.down_proj.weight", (slice(None), block(hf_config.intermediate_size)))
    raise KeyError(f"no HF source for {name}")


def _expert_shard(reader: Any, h: str, e: int, kind: str, ffn: int, block: Any) -> Tensor:
    """Expert ``e``'s fc1 (``[gate; up]``, this rank's rows of each) or fc2 (its columns of down),
    from the checkpoint's per-expert tensors, or from fused 3-D ones where a checkpoint holds those."""
    gate_up, down = f"{h}mlp.experts.gate_up_proj", f"{h}mlp.experts.down_proj"
    if kind == "linear_fc1":
        if gate_up in reader:  # [E, 2 x ffn, hidden]: gate rows, then up rows
            rows = block(ffn)
            up = slice(ffn + rows.start, ffn + rows.stop)
            return torch.cat([reader.read(gate_up, (e, rows)), reader.read(gate_up, (e, up))], dim=0)
        parts = [reader.read(f"{h}mlp.experts.{e}.{p}_proj.weight", (block(ffn),)) for p in ("gate", "up")]
        return torch.cat(parts, dim=0)
    if down in reader:  # [E, hidden, ffn]
        return reader.read(down, (e, slice(None), block(ffn)))
    return reader.read(f"{h}mlp.experts.{e}.down_proj.weight", (slice(None), block(ffn)))


def megatron_to_hf(shards: list[StateDict], hf_config: Any, ep_size: int = 1) -> StateDict:
    """All ranks' megatron state dicts -> the HF state dict. ``shards`` in megatron's rank order
    for TP x EP: EP rank ``e``'s TP shards are ``shards[e*TP:(e+1)*TP]``.

    Only the tests call it: it is :func:`hf_to_megatron`'s whole-model inverse, which the
    conversion and TP/EP training tests compare against. The worker gathers one layer at a
    time instead (``_hf_named``), from the same pieces; the checkpoint tool reads a resharded
    full state dict (``megatron_full_to_hf``)."""
    tp_size = len(shards) // ep_size
    per_ep = [gather_tp_shards(shards[e * tp_size : (e + 1) * tp_size]) for e in range(ep_size)]
    return megatron_full_to_hf(gather_ep_shards(per_ep), hf_config)


def load_into(model: torch.nn.Module, mg_sd: StateDict) -> None:
    """Copy a converted state dict into a megatron module; every parameter must be covered."""
    missing, unexpected = model.load_state_dict(mg_sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise KeyError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")


def model_state_dict(model: torch.nn.Module) -> StateDict:
    """A megatron module's tensors, without the ``_extra_state`` placeholders, detached."""
    return {k: v.detach() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
