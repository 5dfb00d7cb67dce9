"""How long will a step take? An estimate of one rollout's generation, training and weight push,
from the config, the model's shape and the GPU kind alone, and the layout that minimises it.

Pure Python, beside the memory plan (``memory.py``) and read by the same dry run. A roofline
model with its assumptions printed, not a measurement (not yet compared with a measured GPU
step); the formulas are in docs/guides/scale.md, "How long will a step take?":

- generation: per engine, its share of the rollout's samples in waves of as many as its KV
  cache holds; a wave is its prefill (compute-bound) and ``max_new_tokens`` decode steps, each
  reading the engine's active weights shard and the running sequences' KV cache (memory-bound)
  or, at large batches, limited by compute; every reply is taken to run to ``max_new_tokens``;
- training: ``2 x active parameters x tokens`` FLOPs per forward pass, a backward twice that;
  the old logprobs' forward, the reference's where the KL needs it, at a model FLOP utilisation;
- the push: the bf16 weights once to every engine, over the GPU's own memory (colocated: CUDA
  IPC), NVLink (one node) or the network (the slowest link of a broadcast across nodes).

With ``rollout.quantization: fp8`` the engines hold (and each decode step reads, and each push
sends) the layers' projections at a byte each plus their block scales; FP8 GEMMs are counted at
bf16's speed (an upper bound on the time), the quantization on the trainer as free.

Synchronous (``rollout.max_staleness: 0``) the step is their sum; asynchronous, generation
overlaps training and the step is the longer of the two plus the push.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rlhpc.cluster.memory import ASSUMED_PROMPT_TOKENS, FP8_BYTES_PER_PARAM, GIB, ModelShape, check_fits, read_shape
from rlhpc.config import Config, check_parallelism, check_run
from rlhpc.errors import ConfigError


@dataclass(frozen=True)
class GPU:
    """One GPU kind's datasheet figures (dense, no sparsity): what the estimate divides by."""

    bf16_flops: float  # tensor-core bf16, FLOP/s
    memory_bytes_s: float  # HBM bandwidth
    nvlink_bytes_s: float  # one direction, per GPU, within a node
    network_bytes_s: float  # per GPU, between nodes (one 400 Gb/s NIC per GPU: 50 GB/s)
    memory_gib: float  # nvidia-smi's memory.total / 1024


# The kinds ``cluster.gpu_kind`` names (config.py lists the same names; test_timing keeps them in step)
GPUS = {
    "A100": GPU(312e12, 2.04e12, 300e9, 25e9, 79.2),
    "H100": GPU(989e12, 3.35e12, 450e9, 50e9, 79.6),
    "H200": GPU(989e12, 4.8e12, 450e9, 50e9, 139.8),
    "B200": GPU(2250e12, 8.0e12, 900e9, 50e9, 178.4),
}


@dataclass(frozen=True)
class Assumptions:
    """The efficiencies the estimate assumes (printed with it): the field's usual figures, not
    measured here."""

    train_mfu: float = 0.35  # dense training's model FLOP utilisation (MoE: half of it)
    prefill_mfu: float = 0.5
    decode_memory_efficiency: float = 0.7  # of the HBM bandwidth a decode step reaches
    max_running: int = 512  # sequences an engine decodes at once at most (graph-captured batch sizes)
    decode_step_overhead_s: float = 0.003  # scheduling and launch per decode step (CUDA graphs)
    push_overhead_s: float = 0.5  # pause, flush, the update calls' round trips, per push
    link_efficiency: float = 0.8  # of NVLink / network bandwidth a broadcast reaches
    offload_s: float = 1.0  # colocated with cluster.offload: the engines' release and resume, per step
    allreduce_latency_s: float = 10e-6  # an engine's TP all-reduce (two per layer and decode step)


@dataclass(frozen=True)
class StepTime:
    """One step's estimate in seconds, with how each phase was reached."""

    generate: float
    train: float
    push: float
    overlapped: bool  # asynchronous: generation runs beside training
    notes: tuple[str, ...]

    @property
    def step(self) -> float:
        return max(self.generate, self.train) + self.push if self.overlapped else self.generate + self.train + self.push


def active_params(shape: ModelShape) -> float:
    """Parameters one token's forward uses: every expert-free one and ``topk`` of the experts."""
    split, replicated, expert = shape.layer_params()
    per_layer = split + replicated + (expert * shape.topk / shape.experts if shape.experts else 0)
    return shape.layers * per_layer + (1 if shape.tied else 2) * shape.vocab * shape.hidden


def estimate(cfg: Config, gpu: GPU, shape: ModelShape, a: Assumptions = Assumptions()) -> StepTime:
    """The step time of ``cfg``'s own layout (homogeneous or not) on ``gpu``."""
    c, r = cfg.cluster, cfg.rollout
    actor_gpus, rollout_gpus = c.split()
    tp = c.rollout_gpus_per_engine
    engines = max(1, rollout_gpus // tp)
    prompt = cfg.data.max_prompt_tokens or ASSUMED_PROMPT_TOKENS
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    new = r.max_new_tokens
    active = active_params(shape)

    # generation: each engine's share, in waves of what its KV cache holds
    memory = (c.gpu_memory_gb or gpu.memory_gib) * GIB
    kv_per_token = shape.kv_bytes_per_token(tp)
    held = shape.engine_weight_bytes(r.quantization)  # an engine's weights, and what a push sends it
    kv_tokens = max(0.0, r.sglang.mem_fraction_static * memory - held / tp) / kv_per_token
    share = math.ceil(samples / engines)
    running = max(1, min(share, a.max_running, int(kv_tokens // (prompt + new))))
    waves = share / running  # continuous batching: a finished sequence's slot is refilled at once
    weights_read = _weights_read(shape, running, r.quantization) / tp  # bytes a decode step reads of the weights
    kv_read = running * (prompt + new / 2) * kv_per_token  # the running sequences' cache, on average
    memory_s = (weights_read + kv_read) / (gpu.memory_bytes_s * a.decode_memory_efficiency)
    compute_s = 2 * active * running / tp / (gpu.bf16_flops * a.prefill_mfu)
    # TP > 1: two all-reduces of the running sequences' hidden states per layer, over NVLink
    allreduce_s = (
        0.0
        if tp == 1
        else 2
        * shape.layers
        * (a.allreduce_latency_s + 2 * running * shape.hidden / (gpu.nvlink_bytes_s * a.link_efficiency))
    )
    decode_step = max(memory_s, compute_s) + allreduce_s + a.decode_step_overhead_s
    prefill = 2 * active * running * prompt / tp / (gpu.bf16_flops * a.prefill_mfu)
    generate = waves * (prefill + new * decode_step)

    # training: the old logprobs' forward, the reference's, forward + backward
    tokens = samples * (prompt + new)
    passes = 1 + (1 if cfg.algo.needs_reference else 0) + 3
    megatron = cfg.actor.backend == "megatron" and cfg.actor.megatron.uses_bf16(device_has_bf16=True)
    flops = gpu.bf16_flops if megatron else gpu.bf16_flops / 2  # the torch actor: fp32 (TF32)
    mfu = a.train_mfu / (2 if shape.experts else 1)
    train = 2 * active * tokens * passes / (max(1, actor_gpus) * flops * mfu)

    # the push: the engines' weights (bf16, or FP8 projections and their scales) to every engine
    push_bytes = held
    if c.colocate:
        link, over = gpu.memory_bytes_s / 2, "the GPU's own memory (CUDA IPC: a read and a write)"
    elif c.total_nodes == 1:
        link, over = gpu.nvlink_bytes_s, "NVLink (one node)"
    else:
        link, over = gpu.network_bytes_s, "the network (a broadcast across nodes)"
    push = (
        push_bytes / (link * a.link_efficiency) + a.push_overhead_s + (a.offload_s if c.colocate and c.offload else 0)
    )

    overlapped = r.max_staleness >= 1 and not c.colocate
    notes = (
        f"generate: {samples} samples on {engines} engine(s) of TP {tp}: {running} at once per engine "
        f"(KV cache for ~{int(kv_tokens)} tokens), {waves:.1f} wave(s) of {new} decode steps of {decode_step * 1e3:.1f} ms",
        f"train: {tokens} tokens x {passes} passes ({'old logprobs, reference, ' if passes == 5 else 'old logprobs, '}"
        f"forward + backward) on {actor_gpus} GPU(s) at {mfu:.0%} of {'bf16' if megatron else 'TF32 (fp32 actor)'}",
        f"push: {push_bytes / 1e9:.2f} GB of {'FP8 (projections) and bf16' if r.quantization else 'bf16'} weights "
        f"over {over}",
        "step: " + ("generation beside training (max_staleness >= 1), then the push" if overlapped else
                    "generate + train + push (synchronous)")
        + (f", {a.offload_s:g} s of offload (engines release and take back their memory)" if c.colocate and c.offload else ""),
    )  # fmt: skip
    return StepTime(generate, train, push, overlapped, notes)


def _weights_read(shape: ModelShape, running: int, quantization: str | None = None) -> float:
    """Bytes of weights a decode step over ``running`` sequences reads: every dense one and
    the experts its tokens route to (all of them once the batch is large); bf16, or with FP8
    the projections at a byte and their scales."""
    split, replicated, expert = shape.layer_params()
    touched = min(1.0, running * shape.topk / shape.experts) if shape.experts else 0.0
    vocab = (1 if shape.tied else 2) * shape.vocab * shape.hidden
    per_param = FP8_BYTES_PER_PARAM if quantization == "fp8" else 2.0
    return per_param * shape.layers * (split + expert * touched) + 2.0 * (shape.layers * replicated + vocab)


def candidates(cfg: Config) -> list[Config]:
    """The homogeneous layouts of the same allocation to compare: colocated over every GPU and
    disaggregated splits, each at every engine TP that divides a node, within memory when
    ``cluster.gpu_memory_gb`` is set (the memory plan decides)."""
    c = cfg.cluster
    total, per_node = c.total_gpus, c.gpus_per_node
    tps = [t for t in (1, 2, 4, 8) if per_node % t == 0]
    layouts: list[dict] = []
    if cfg.rollout.max_staleness == 0:
        layouts += [dict(colocate=True, offload=offload, actor_num_gpus=total, rollout_num_gpus=total,
                         rollout_gpus_per_engine=t) for t in tps for offload in (False, True)]  # fmt: skip
    for t in tps:
        for rollout in range(t, total, t):
            layouts.append(dict(colocate=False, actor_num_gpus=total - rollout, rollout_num_gpus=rollout,
                                rollout_gpus_per_engine=t))  # fmt: skip
    memory = c.gpu_memory_gb if c.gpu_memory_gb is not None else GPUS[c.gpu_kind].memory_gib if c.gpu_kind else None
    fitting = []
    for change in layouts:
        try:
            candidate = dataclasses.replace(cfg, cluster=dataclasses.replace(c, gpu_memory_gb=memory, **change))
            check_run(candidate)
            check_parallelism(candidate)  # the megatron actor's TP, PP and EP divide its GPUs
            check_fits(candidate)
            fitting.append(candidate)
        except ConfigError:  # a layout the config's rules or the memory plan refuse (as a submission would)
            continue
    return fitting


def describe(c: Config) -> str:
    k = c.cluster
    if k.colocate:
        where = f"colocated on {k.actor_num_gpus} GPUs{', offload' if k.offload else ''}, engines of TP {k.rollout_gpus_per_engine}"
    else:
        where = (f"actor {k.actor_num_gpus} GPUs, engines {k.rollout_num_gpus} GPUs of TP "
                 f"{k.rollout_gpus_per_engine}")  # fmt: skip
    keys = (f"cluster.colocate={str(k.colocate).lower()} cluster.offload={str(k.offload).lower()} "
            f"cluster.actor_num_gpus={k.actor_num_gpus} "
            f"cluster.rollout_num_gpus={k.rollout_num_gpus} cluster.rollout_gpus_per_engine={k.rollout_gpus_per_engine}")  # fmt: skip
    return f"{where} (--set {keys})"


def summarize(cfg: Config) -> str:
    """The dry run's step-time estimate, and the fastest layout within memory."""
    kind = cfg.cluster.gpu_kind
    if kind is None:
        return "Step time estimate: set cluster.gpu_kind (one of " + ", ".join(GPUS) + ") for one"
    shape = read_shape(cfg)
    if shape is None or cfg.rollout.backend != "sglang":
        why = "the model's shape is unknown" if shape is None else "rollout.backend is not sglang"
        return f"Step time estimate: none ({why})"
    gpu, a = GPUS[kind], Assumptions()
    own = estimate(cfg, gpu, shape, a)
    lines = [
        f"Step time estimate on {kind} (cluster.gpu_kind), seconds: an estimate, not a promise",
        f"  generate {own.generate:9.1f}",
        f"  train    {own.train:9.1f}",
        f"  push     {own.push:9.1f}",
        f"  step     {own.step:9.1f}",
        *(f"    ({n})" for n in own.notes),
        f"    (assumed: replies run to max_new_tokens; {a.train_mfu:.0%} MFU training, {a.prefill_mfu:.0%} prefill, "
        f"decode at {a.decode_memory_efficiency:.0%} of HBM bandwidth + {a.decode_step_overhead_s * 1e3:g} ms a step, "
        f"links at {a.link_efficiency:.0%}, {a.allreduce_latency_s * 1e6:g} us an engine TP all-reduce, "
        f"{a.push_overhead_s:g} s per push; docs/guides/scale.md)",
    ]
    if cfg.cluster.heterogeneous:
        lines.append("  (a heterogeneous job: no other layout compared)")
        return "\n".join(lines)
    ranked = sorted((estimate(c, gpu, shape, a).step, describe(c)) for c in candidates(cfg))
    gpus = cfg.cluster.total_gpus
    if ranked:
        best, how = ranked[0]
        lines.append(f"  fastest layout of these {gpus} GPUs within memory: {best:.1f} s a step, {how}")
    else:
        memory = cfg.cluster.gpu_memory_gb or gpu.memory_gib
        lines.append(f"  no layout of these {gpus} GPUs fits {memory:g} GiB a GPU by the memory plan (set "
                     "cluster.gpu_memory_gb to see this layout's terms checked)")  # fmt: skip
    return "\n".join(lines)
