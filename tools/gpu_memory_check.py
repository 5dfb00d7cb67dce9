"""The memory plan against a real shape on one GPU (issue 40): a megatron actor rank of a
Qwen3-1.7B-shaped model (random bf16 weights, the published config's sizes, its 151,936-token
vocabulary and tied embeddings), trained one step on one sequence of 2k, 4k and 8k tokens, with
full recompute off and on. For each, the rank's measured peak (``torch.cuda.max_memory_allocated``)
beside the dry run's estimate for the same job (``rlhpc.cluster.memory.actor_estimate``, the
``actor.max_tokens_per_micro_batch`` of that length) less its runtime allowance (the CUDA context
and NCCL, which the allocator's peak does not count); a peak above that is a failure: a job the
plan admits could run out of memory.

    python tools/gpu_memory_check.py [--tokens 2048 4096 8192] [--cpu]

``--cpu`` rehearses the script with a tiny Qwen3 (no peak measured). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

from rlhpc.actor.megatron.worker import MegatronTrainWorker
from rlhpc.actor.spec import ActorSpec
from rlhpc.batch import RolloutBatch
from rlhpc.cluster.memory import actor_estimate, read_shape
from rlhpc.config import Config
from rlhpc.model import TinyModelConfig, build_tiny_model

log = logging.getLogger("gpu_memory_check")
GiB = 2**30
PROMPT = 64  # tokens of the sequence's prompt; the rest is its response (what the loss covers)

# Qwen3-1.7B's published config.json, sizes only (the weights here are random).
QWEN3_1_7B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}


def build_model(work: Path, cpu: bool, longest: int) -> str:
    """A model dir: the tiny BPE tokenizer (its ids fit any vocabulary) and, on a GPU, the
    Qwen3-1.7B shape's config and random bf16 weights in place of the tiny model's."""
    path = build_tiny_model(
        work / "model", TinyModelConfig(architecture="qwen3", tokenizer="bpe", max_position_embeddings=longest)
    )
    if cpu:
        return str(path)
    from transformers import AutoConfig, AutoModelForCausalLM

    for f in path.glob("*.safetensors"):
        f.unlink()
    config = AutoConfig.for_model(**QWEN3_1_7B)
    with torch.device("cuda"):  # random init on the GPU: seconds, not minutes on the host
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(path)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return str(path)


def job_config(model_path: str, tokens: int, recompute: bool) -> Config:
    cfg = Config()
    cfg.model.path = model_path
    cfg.actor.backend = "megatron"
    cfg.actor.megatron.bf16 = True
    cfg.actor.megatron.recompute = recompute
    cfg.actor.micro_batch_size = 1
    cfg.actor.max_tokens_per_micro_batch = tokens
    cfg.data.max_prompt_tokens = PROMPT
    cfg.rollout.max_new_tokens = tokens - PROMPT
    return cfg


def one_sequence(tokens: int, vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, vocab, (tokens,), generator=g).tolist()
    response = tokens - PROMPT
    return RolloutBatch(
        [ids[:PROMPT]], [ids[PROMPT:]], [[-1.0] * response], torch.tensor([1.0]), torch.tensor([1.0]), group_size=1
    )


def measure(model_path: str, lengths: list[int], recompute: bool, cpu: bool) -> list[dict]:
    """One rank built once per recompute setting (megatron builds it into the layers), one
    training step per length; the peak is reset before each step, after the weights, grads and
    Adam states exist (the first step creates Adam's; it runs before the first measured one)."""
    cfg = job_config(model_path, max(lengths), recompute)
    actor = MegatronTrainWorker(ActorSpec.from_config(cfg), model_path, 0, 1)
    actor.init_process_group(actor.rendezvous(one_node=True))
    vocab = 320 if cpu else QWEN3_1_7B["vocab_size"]
    rows = []
    try:
        actor.train(0, one_sequence(min(lengths), vocab))  # Adam's states now exist
        for i, tokens in enumerate(lengths, start=1):
            if not cpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            actor.train(i, one_sequence(tokens, vocab))
            peak = torch.cuda.max_memory_allocated() if not cpu else None
            est = actor_estimate(job_config(model_path, tokens, recompute), read_shape(cfg))
            allocator = sum(b for name, b in est.terms if not name.startswith("runtime"))
            rows.append(
                {
                    "tokens": tokens,
                    "recompute": recompute,
                    "estimate_gib": round(est.total / GiB, 3),
                    "allocator_estimate_gib": round(allocator / GiB, 3),
                    "peak_gib": None if peak is None else round(peak / GiB, 3),
                    "terms_gib": {name: round(b / GiB, 3) for name, b in est.terms},
                }
            )
            log.info("%s", rows[-1])
    finally:
        actor.shutdown()
        del actor
        gc.collect()
        if not cpu:
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--cpu", action="store_true", help="rehearse with a tiny Qwen3 on the CPU (no peak measured)")
    p.add_argument("--work", type=Path, default=None)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    if not torch.cuda.is_available() and not args.cpu:
        sys.exit("no GPU visible: this check is for a GPU machine (--cpu rehearses it on a CPU)")
    lengths = sorted(args.tokens) if not args.cpu else [64, 128]
    work = args.work or Path(tempfile.mkdtemp(prefix="rlhpc-gpu-memory-"))
    model_path = build_model(work, args.cpu, max(lengths))
    rows = [r for recompute in (False, True) for r in measure(model_path, lengths, recompute, args.cpu)]
    device = "CPU rehearsal" if args.cpu else torch.cuda.get_device_name()
    print(f"\n== actor memory against the plan: {device}, torch {torch.__version__} ==")
    print(f"{'tokens':>7} {'recompute':>9} {'plan GiB':>9} {'less runtime':>12} {'peak GiB':>9}")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(
            f"{r['tokens']:>7} {str(r['recompute']):>9} {r['estimate_gib']:>9.2f} {r['allocator_estimate_gib']:>12.2f} {peak:>9}"
        )
    over = [r for r in rows if r["peak_gib"] is not None and r["peak_gib"] > r["allocator_estimate_gib"]]
    print(json.dumps({"device": device, "rows": rows, "over_plan": len(over)}))
    if over:
        sys.exit(f"FAIL: {len(over)} step(s) peaked above the plan's estimate: {over}")


if __name__ == "__main__":
    main()
