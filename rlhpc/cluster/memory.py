"""Will it fit? An estimate of GPU memory per actor rank and per engine, from the config alone.

Pure Python (the login node reads configs without torch). The formulas and their assumptions
are in docs/guides/scale.md, "Will it fit?"; in short, per actor rank of the megatron actor
(TP t, PP p, EP e, DP d; the torch actor: t = p = e = 1, fp32, no sharding), on the pipeline
stage that needs most (the first: the embedding and p micro-batches in flight; or the last:
the output layer and the logits), each stage holding layers / p of the layers:

- weights: 2 bytes per parameter of the rank's shard in bf16 (4 in fp32); dense tensors split
  over t (norms and routers replicated), experts over e x t; the vocab padded as megatron pads it;
- gradients: 4 bytes per parameter (fp32 grad buffer, ``grad_reduce_in_fp32``);
- Adam: fp32 master (bf16 only) + 2 fp32 moments = 12 bytes (8 in fp32), divided over d (dense)
  and d / e (experts) with ``use_distributed_optimizer``;
- the reference model's weights again when the KL penalty needs it;
- with LoRA (``actor.lora``, the torch actor): the frozen weights and the adapters' (fp32), but
  gradients and Adam state for the adapters alone, and no reference copy (the reference is the
  same model with its adapters off);
- activations of one micro-batch (bf16, no sequence parallelism, unfused attention of the
  local spec), or with ``recompute`` each layer's input plus one layer's; megatron's 1F1B
  schedule keeps p - s micro-batches' in flight on stage s, so the first stage's are those of
  all the layers, as without a pipeline; with v virtual stages (interleaved 1F1B) stage s keeps
  2 (p - s - 1) + (v - 1) p + 1 chunks' (of layers / (p v) layers each) in flight: the first
  stage 1 + (p - 1) / (p v) times the layers' activations, the last (v - 1) p + 1 chunks;
- logits (last stage): 14 bytes per token per vocab entry / t (bf16 output, fp32 copy, the
  cross entropy's copy, its softmax);
- a fixed allowance for the CUDA context, NCCL and allocator slack.

An SGLang engine takes ``rollout.sglang.mem_fraction_static`` of its GPU for weights + KV cache
(SGLang sizes its KV cache to fill that fraction), so its row is the weights / engine TP and
the KV cache it gets from what is left of that fraction. With ``rollout.quantization: fp8`` the
layers' projections count 1 byte each plus a float32 scale per 128 x 128 block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlhpc.config import Config, TinyModelConfig
from rlhpc.errors import ConfigError

GIB = 2**30
RUNTIME_GIB = 2.0  # CUDA context, NCCL buffers, allocator fragmentation: assumed, not measured
ASSUMED_PROMPT_TOKENS = 512  # data.max_prompt_tokens unset: prompts of this length are assumed
TINY_VOCAB = 320  # the tiny BPE tokenizer's vocabulary (rlhpc.model.BPE_VOCAB_SIZE); char is smaller
LOGIT_BYTES = 2 + 4 + 4 + 4  # per token and vocab entry: bf16 output, fp32 copy, CE's copy, its softmax


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model: its HF config.json's sizes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int = 0  # routed experts per layer (0: dense)
    topk: int = 0
    moe_ffn: int = 0
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3, qwen3_moe
    tied: bool = False  # tie_word_embeddings: the output layer is the embedding

    @classmethod
    def from_hf(cls, hf: dict) -> ModelShape:
        heads = hf["num_attention_heads"]
        kind = hf.get("model_type", "")
        return cls(
            hidden=hf["hidden_size"],
            layers=hf["num_hidden_layers"],
            heads=heads,
            kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            ffn=hf["intermediate_size"],
            vocab=hf["vocab_size"],
            experts=hf.get("num_experts") or 0,
            topk=hf.get("num_experts_per_tok") or 0,
            moe_ffn=hf.get("moe_intermediate_size") or 0,
            qkv_bias=kind == "qwen2",
            qk_norm=kind in ("qwen3", "qwen3_moe"),
            tied=bool(hf.get("tie_word_embeddings")),
        )

    @classmethod
    def from_tiny(cls, t: TinyModelConfig) -> ModelShape:
        moe = t.architecture == "qwen3_moe"
        return cls(
            hidden=t.hidden_size,
            layers=t.num_hidden_layers,
            heads=t.num_attention_heads,
            kv_heads=t.num_key_value_heads,
            head_dim=t.hidden_size // t.num_attention_heads,
            ffn=t.intermediate_size,
            vocab=TINY_VOCAB,
            experts=t.num_experts if moe else 0,
            topk=t.num_experts_per_tok if moe else 0,
            moe_ffn=t.moe_intermediate_size if moe else 0,
            qkv_bias=t.architecture == "qwen2",
            qk_norm=t.architecture in ("qwen3", "qwen3_moe"),
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, tp: int) -> float:
        """An engine GPU's KV cache per token at TP ``tp``: k and v of every layer in bf16, the
        kv heads split over TP (replicated where TP exceeds them)."""
        return 2 * self.layers * 2 * self.kv_dim / min(tp, self.kv_heads)

    def layer_params(self) -> tuple[int, int, int]:
        """(TP-split, replicated, expert) parameters of one decoder layer."""
        h = self.hidden
        split = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        if self.qkv_bias:
            split += self.q_dim + 2 * self.kv_dim
        replicated = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        if self.experts:
            return split, replicated + h * self.experts, self.experts * 3 * h * self.moe_ffn  # router, experts
        return split + 3 * h * self.ffn, replicated, 0

    def lora_params(self, rank: int, targets: str | list[str]) -> int:
        """The adapters' parameters at ``rank`` on ``targets`` (peft's names: "all-linear", or
        module names matched by their last part): rank x (in + out) per adapted matrix."""
        h, ffn = self.hidden, self.ffn
        per_layer = {
            "q_proj": h + self.q_dim,
            "k_proj": h + self.kv_dim,
            "v_proj": h + self.kv_dim,
            "o_proj": self.q_dim + h,
            "gate_proj": h + ffn,
            "up_proj": h + ffn,
            "down_proj": ffn + h,
        }
        whole = {"lm_head": h + self.vocab, "embed_tokens": self.vocab + h}
        names = list(per_layer) if targets == "all-linear" else [t.rsplit(".", 1)[-1] for t in targets]
        sizes = sum(self.layers * per_layer[n] for n in names if n in per_layer)
        return rank * (sizes + sum(whole[n] for n in names if n in whole))

    def projection_params(self) -> int:
        """Parameters of the layers' projections (attention, MLP, experts): what FP8 rollout
        (``rollout.quantization``) holds in FP8 on the engines."""
        h = self.hidden
        mlp = self.experts * 3 * h * self.moe_ffn if self.experts else 3 * h * self.ffn
        return self.layers * (2 * h * self.q_dim + 2 * h * self.kv_dim + mlp)

    def engine_weight_bytes(self, quantization: str | None) -> float:
        """The weights one engine holds over all its TP ranks, and what a push sends it: bf16,
        or with FP8 the projections at a byte each plus a float32 scale per 128 x 128 block."""
        if quantization != "fp8":
            return 2.0 * self.params()
        q = self.projection_params()
        return 2.0 * (self.params() - q) + FP8_BYTES_PER_PARAM * q

    def params(self) -> int:
        """All parameters (embedding and, untied, output layer; unpadded vocab), as the HF checkpoint has."""
        split, replicated, expert = self.layer_params()
        vocab_matrices = 1 if self.tied else 2
        return self.layers * (split + replicated + expert) + vocab_matrices * self.vocab * self.hidden + self.hidden


# rollout.quantization: fp8: a quantized weight's byte and its share of its block's float32 scale
FP8_BYTES_PER_PARAM = 1 + 4 / (128 * 128)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """megatron's vocab padding (rlhpc/actor/megatron/model.py's padded_vocab_size, without torch)."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def read_shape(cfg: Config) -> ModelShape | None:
    """The configured model's shape, or None where its config.json cannot be read."""
    if cfg.model.tiny is not None:
        return ModelShape.from_tiny(cfg.model.tiny)
    try:
        return ModelShape.from_hf(json.loads((Path(cfg.model.path) / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class Estimate:
    """One GPU's estimate: named terms in bytes, in the order the table shows them."""

    who: str  # "actor rank" / "engine"
    terms: tuple[tuple[str, float], ...]
    notes: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return sum(b for _, b in self.terms)

    def biggest(self) -> tuple[str, float]:
        return max(self.terms, key=lambda t: t[1])


def micro_batch_tokens(cfg: Config) -> tuple[int, int, str]:
    """(tokens of one micro-batch, its longest row, where they come from)."""
    a = cfg.actor
    prompt = cfg.data.max_prompt_tokens
    row = (prompt or ASSUMED_PROMPT_TOKENS) + cfg.rollout.max_new_tokens
    said = "" if prompt else f", prompt assumed {ASSUMED_PROMPT_TOKENS} (data.max_prompt_tokens unset)"
    if a.max_tokens_per_micro_batch is not None:
        n = a.max_tokens_per_micro_batch
        return n, min(row, n), f"actor.max_tokens_per_micro_batch = {n}"
    return a.micro_batch_size * row, row, f"actor.micro_batch_size {a.micro_batch_size} x {row} tokens{said}"


def actor_estimate(cfg: Config, shape: ModelShape) -> Estimate:
    """One actor rank's peak: the training step's (weights, grads, Adam, micro-batches in
    flight) on the pipeline stage whose total is largest (the first or the last)."""
    m = cfg.actor.megatron
    pp = m.pipeline_model_parallel_size if cfg.actor.backend == "megatron" else 1
    stages = [stage_estimate(cfg, shape, first=True, last=pp == 1)]
    if pp > 1:
        stages.append(stage_estimate(cfg, shape, first=False, last=True))
    return max(stages, key=lambda e: e.total)


def stage_estimate(cfg: Config, shape: ModelShape, first: bool, last: bool) -> Estimate:
    megatron = cfg.actor.backend == "megatron"
    m = cfg.actor.megatron
    tp, ep = (m.tensor_model_parallel_size, m.expert_model_parallel_size) if megatron else (1, 1)
    pp = m.pipeline_model_parallel_size if megatron else 1
    vp = (m.virtual_pipeline_model_parallel_size or 1) if megatron and pp > 1 else 1
    dp = (cfg.cluster.actor_num_gpus or 1) // (tp * pp)
    bf16 = megatron and m.uses_bf16(device_has_bf16=True)  # a plan for GPUs: bf16 unless turned off
    distributed = megatron and m.use_distributed_optimizer
    split, replicated, expert = shape.layer_params()
    vocab = padded_vocab(shape.vocab, tp) if megatron else shape.vocab
    layers = -(-shape.layers // pp)
    # the embedding on the first stage; the final norm and output layer on the last (tied: the
    # embedding is the output layer, on the one stage the megatron actor allows then)
    output = 0 if shape.tied else vocab * shape.hidden / tp
    ends = (vocab * shape.hidden / tp if first else 0) + (output + shape.hidden if last else 0)
    dense = layers * (split / tp + replicated) + ends
    experts = layers * expert / (ep * tp)
    params = dense + experts
    weight_bytes = 2 if bf16 else 4
    adam_bytes = 12 if bf16 else 8  # fp32 master (bf16 only) + exp_avg + exp_avg_sq
    adam = adam_bytes * (dense / dp + experts / max(1, dp // ep) if distributed else params)
    lora = None if megatron else cfg.actor.lora
    if lora is not None:  # frozen weights; gradients and Adam for the adapters only; no reference copy
        adapters = shape.lora_params(lora.rank, lora.target_modules)
        terms = [("weights", 4.0 * params), ("LoRA adapters", 4.0 * adapters)]
        terms += [("gradients", 4.0 * adapters), ("optimizer", 8.0 * adapters)]
    else:
        terms = [("weights", weight_bytes * params), ("gradients", 4.0 * params), ("optimizer", adam)]
        if cfg.algo.needs_reference:
            terms.append(("reference weights", weight_bytes * params))
    tokens, row, where = micro_batch_tokens(cfg)
    act = 2 if bf16 else 4
    layer = layer_activation_bytes(shape, tokens, row, tp, ep, act)
    recompute = megatron and m.recompute
    if vp == 1:
        in_flight = pp if first else 1  # 1F1B: stage s holds p - s micro-batches' activations
    else:  # interleaved 1F1B, in chunks of layers / (p v) layers: stage s holds 2 (p - s - 1) + (v - 1) p + 1
        in_flight = (2 * (pp - 1) + (vp - 1) * pp + 1 if first else (vp - 1) * pp + 1) / vp
    per_micro_batch = layers * act * shape.hidden * tokens if recompute else layers * layer
    kept = in_flight * per_micro_batch + (layer if recompute else 0)
    terms.append((f"activations ({'recompute' if recompute else 'no recompute'})", kept))
    if last:
        terms.append(("logits", LOGIT_BYTES * tokens * vocab / tp))
    terms.append(("runtime (CUDA, NCCL)", RUNTIME_GIB * GIB))
    stage = (
        ""
        if pp == 1
        else f", the {'first' if first else 'last'} of {pp} pipeline stages ({layers} of {shape.layers} layers)"
    )
    notes = (
        *(
            (
                f"LoRA rank {lora.rank} on {lora.target_modules}: {adapters / 1e6:.2f}M trained parameters; "
                "the reference is the model with its adapters off",
            )
            if lora is not None
            else ()
        ),  # fmt: skip
        f"{tokens} tokens per micro-batch ({where})",
        f"TP {tp} {f'PP {pp} ' if pp > 1 else ''}{f'VP {vp} ' if vp > 1 else ''}EP {ep} DP {dp}, {'bf16' if bf16 else 'fp32'}"
        f"{', distributed optimizer' if distributed else ''}, {params / 1e9:.2f}B parameters on the rank{stage}",
    )
    return Estimate("actor rank", tuple(terms), notes)


def layer_activation_bytes(shape: ModelShape, tokens: int, row: int, tp: int, ep: int, act: int) -> float:
    """Bytes one decoder layer keeps for backward over ``tokens`` tokens in rows of ``row``.

    Per token: the two norms' inputs and outputs and the residual (4 x hidden, replicated over
    TP without sequence parallelism); q, k, v and the attention output; the MLP's fc1 output
    (gate and up), the SiLU output and the product fed to fc2 (4 x ffn). Per row: the score
    matrix and its softmax (2.5 x act bytes per entry: scores, probabilities in act, a fp32
    softmax share), heads / TP of them. MoE: each token's k experts' MLP, the router logits
    (fp32) and the allgather dispatcher's copy of the EP group's tokens.
    """
    h = shape.hidden
    per_token = 4 * h + (2 * shape.q_dim + 2 * shape.kv_dim) / tp
    if shape.experts:
        per_token += shape.topk * 4 * shape.moe_ffn / tp + (4 / act) * shape.experts + ep * h
    else:
        per_token += 4 * shape.ffn / tp
    scores = 2.5 * tokens * row * shape.heads / tp
    return act * (per_token * tokens + scores)


def engine_estimate(cfg: Config, shape: ModelShape) -> Estimate:
    """One SGLang engine GPU: its weights shard (bf16, or FP8 projections with
    ``rollout.quantization``) and the KV cache the fraction leaves."""
    tp, frac = cfg.cluster.rollout_gpus_per_engine, cfg.rollout.sglang.mem_fraction_static
    weights = shape.engine_weight_bytes(cfg.rollout.quantization) / tp
    kv_per_token = shape.kv_bytes_per_token(tp)
    gpu = cfg.cluster.gpu_memory_gb
    if gpu is None:
        return Estimate(
            "engine",
            (("weights", weights),),
            (f"KV cache: the rest of {frac} of the GPU (rollout.sglang.mem_fraction_static), {kv_per_token / 2**10:.0f} KiB/token",),
        )  # fmt: skip
    kv = max(0.0, frac * gpu * GIB - weights)
    return Estimate(
        "engine",
        (("weights", weights), ("KV cache", kv)),
        (f"mem_fraction_static {frac} of {gpu:g} GiB: KV cache for ~{int(kv // kv_per_token)} tokens",),
    )


def plan(cfg: Config) -> tuple[Estimate, Estimate | None] | None:
    """(actor rank, engine) estimates; None where the model's shape is unknown."""
    shape = read_shape(cfg)
    if shape is None:
        return None
    engine = engine_estimate(cfg, shape) if cfg.rollout.backend == "sglang" else None
    return actor_estimate(cfg, shape), engine


def summarize(cfg: Config) -> str:
    """The dry run's memory table."""
    p = plan(cfg)
    if p is None:
        return f"GPU memory plan: unknown (no config.json readable at model.path = {cfg.model.path})"
    gpu = cfg.cluster.gpu_memory_gb
    of = f"of {gpu:g} GiB (cluster.gpu_memory_gb)" if gpu else "(cluster.gpu_memory_gb unset: nothing checked)"
    lines = [f"GPU memory plan, GiB per GPU {of}:"]
    for est in filter(None, p):
        total = est.total if est.who == "actor rank" or gpu else None
        lines.append(f"  {est.who}: " + (f"{total / GIB:.1f}" if total is not None else "weights + KV cache"))
        lines += [f"    {name:<28} {b / GIB:8.2f}" for name, b in est.terms]
        lines += [f"    ({n})" for n in est.notes]
    if cfg.cluster.colocate:
        lines.append("  colocated: the actor's and the engine's share the same GPU" + (
            " (cluster.offload: one at a time)" if cfg.cluster.offload else ""))  # fmt: skip
    return "\n".join(lines)


def check_fits(cfg: Config) -> None:
    """Refuse, naming the biggest term and its knobs, a layout whose estimate exceeds
    ``cluster.gpu_memory_gb``; nothing is checked while that is unset."""
    gpu = cfg.cluster.gpu_memory_gb
    p = plan(cfg) if gpu is not None else None
    if p is None:
        return
    actor, engine = p
    have = gpu * GIB
    sharing = cfg.cluster.colocate and not cfg.cluster.offload and engine is not None
    actor_room = have - (cfg.rollout.sglang.mem_fraction_static * have if sharing else 0)
    if actor.total > actor_room:
        name, b = actor.biggest()
        shared = " beside the colocated engine's mem_fraction_static" if sharing else ""
        raise ConfigError(
            f"an actor rank needs ~{actor.total / GIB:.1f} GiB{shared}, more than the {actor_room / GIB:.1f} GiB "
            f"it has (cluster.gpu_memory_gb = {gpu:g}); the biggest term is {name} ({b / GIB:.1f} GiB)",
            _actor_fix(cfg, name, bool(read_shape(cfg).experts)) + " (the dry run prints every term)",
        )
    if engine is not None and engine.terms[0][1] >= cfg.rollout.sglang.mem_fraction_static * have:
        raise ConfigError(
            f"an engine's weights (~{engine.terms[0][1] / GIB:.1f} GiB per GPU) fill its "
            f"rollout.sglang.mem_fraction_static = {cfg.rollout.sglang.mem_fraction_static} of {gpu:g} GiB: "
            "no room for a KV cache",
            "give each engine more GPUs (cluster.rollout_gpus_per_engine) or raise rollout.sglang.mem_fraction_static",
        )


def _actor_fix(cfg: Config, term: str, moe: bool) -> str:
    """The knobs that reduce ``term``, those of that term first."""
    m = cfg.actor.megatron
    tp = "raise actor.megatron.tensor_model_parallel_size (within a node)"
    ep = "raise actor.megatron.expert_model_parallel_size" if moe and cfg.actor.backend == "megatron" else ""
    # stages split the weights and their state, not the first stage's activations or the logits
    pp = "raise actor.megatron.pipeline_model_parallel_size (stages may span nodes)"
    tokens = "lower actor.max_tokens_per_micro_batch (or actor.micro_batch_size)"
    knobs = {
        "weights": [tp, pp, ep],
        "gradients": [tp, pp, ep],
        "reference weights": [tp, pp, ep, "set algo.kl_coef: 0 (no reference model)"],
        "optimizer": [
            "" if m.use_distributed_optimizer else "set actor.megatron.use_distributed_optimizer: true",
            "add data-parallel ranks (cluster.actor_num_gpus)",
            tp,
            pp,
            ep,
        ],
        "logits": [tokens, tp],
        "runtime": ["use GPUs with more memory (it is a fixed allowance)"],
    }.get(term.split(" (")[0], ["" if m.recompute else "set actor.megatron.recompute: true", tokens, tp])
    if cfg.actor.backend != "megatron":
        knobs = ["use actor.backend: megatron (bf16, TP, distributed optimizer)", tokens]
        if cfg.actor.lora is None and term.split(" (")[0] in ("gradients", "optimizer", "reference weights"):
            # LoRA keeps gradients and Adam state for the adapters alone, and no reference copy
            knobs.insert(0, "train LoRA adapters instead of every weight (actor.lora, docs/guides/lora.md)")
    if cfg.cluster.colocate and not cfg.cluster.offload:
        knobs.append("set cluster.offload: true (engine and actor take turns on the GPU)")
    return "; ".join(k for k in knobs if k)
