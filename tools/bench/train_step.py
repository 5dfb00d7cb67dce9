#!/usr/bin/env python3
"""Train-step throughput: packed micro-batches against padded ones, on long-tailed lengths.

One PyTorch actor rank (a real ``TrainWorker``, a world of one over gloo, no Ray) takes the
rollout's train step (``RankBase.train``: forward, loss, backward, optimizer step) three ways
on the same batch:

* ``padded``: today's default, ``actor.micro_batch_size`` samples a micro-batch, padded to its
  longest sample;
* ``padded_budget``: micro-batches of at most ``--max-tokens`` padded tokens (rows x longest,
  first-fit, longest first: what the megatron actor does with a token budget);
* ``packed``: micro-batches of at most ``--max-tokens`` real tokens, each one packed row.

The default budget, 512, is about the longest sample: on CPU, sdpa's attention over a packed
row with its block-diagonal mask costs the row's length squared, so longer rows lose.

    python tools/bench/train_step.py --turns 8

Lengths are drawn as real rollouts' are, most short and a few near the maximum: a prompt of
16-48 tokens and a response of exp(N(ln 48, 0.9)) tokens, at most ``--max-new-tokens`` (median
~80 tokens in all, ~2 in 100 samples at the cap). The learning rate is 0, so every step does the
same work. The three sides take turns, one step each per turn, in a rotating order, so a machine
whose speed drifts moves all alike. Tokens per second counts real tokens (prompt + response).
The last line is one JSON object: ``packed_over_padded`` (the median over the turns of packed
tokens/s over padded tokens/s within the turn) and ``packed_over_padded_budget``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from rlhpc.actor.spec import ActorSpec
from rlhpc.actor.worker import TrainWorker
from rlhpc.batch import RolloutBatch
from rlhpc.config import Config
from rlhpc.model import TinyModelConfig, build_tiny_model

SIDES = ("padded", "padded_budget", "packed")


def long_tailed_batch(n: int, max_new_tokens: int, vocab: int, seed: int) -> RolloutBatch:
    """``n`` samples with log-normal response lengths (see the module docstring)."""
    rng = random.Random(seed)
    prompts, responses = [], []
    for _ in range(n):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))])
        length = min(max_new_tokens, max(1, round(math.exp(rng.gauss(math.log(48), 0.9)))))
        responses.append([rng.randrange(3, vocab) for _ in range(length)])
    logprobs = [[-rng.random() for _ in r] for r in responses]
    advantages = torch.tensor([rng.uniform(-1.0, 1.0) for _ in range(n)])
    return RolloutBatch(prompts, responses, logprobs, torch.zeros(n), advantages, group_size=1)


def forward_tokens(batch: RolloutBatch, worker: TrainWorker) -> int:
    """Tokens the side's forwards run on (real + padding)."""
    steps = worker._micro_batches(batch)
    total = 0
    for mbs in steps:
        for mb in mbs:
            lengths = [len(p) + len(r) for p, r in zip(mb.prompt_ids, mb.response_ids)]
            total += sum(lengths) if worker.packs else len(lengths) * max(lengths)
    return total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=8, help="turns (one step of each side per turn)")
    p.add_argument("--warmup", type=int, default=1, help="turns left out of the medians")
    p.add_argument("--samples", type=int, default=64, help="samples per rollout (one optimizer step)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="the padded side's samples per micro-batch")
    p.add_argument("--max-tokens", type=int, default=512, help="the token budget of the other two sides")
    p.add_argument("--max-new-tokens", type=int, default=448)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()

    cfg = Config(deterministic=True)
    cfg.actor.lr = 0.0  # the same weights every step: every turn does the same work
    cfg.actor.micro_batch_size = args.micro_batch_size
    cfg.rollout.max_new_tokens = args.max_new_tokens
    spec = ActorSpec.from_config(cfg)
    specs = {
        "padded": spec,
        "padded_budget": replace(
            spec, actor=replace(cfg.actor, max_tokens_per_micro_batch=args.max_tokens, sequence_packing=False)
        ),
        "packed": replace(spec, actor=replace(cfg.actor, max_tokens_per_micro_batch=args.max_tokens)),
    }
    tiny = TinyModelConfig(
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.max_new_tokens + 64,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_path = str(build_tiny_model(Path(tmp) / "model", tiny))
        worker = TrainWorker(spec, model_path, 0, 1)
        worker.init_process_group(worker.rendezvous(one_node=True))
        vocab = worker.module.config.vocab_size
        rates: dict[str, list[float]] = {s: [] for s in SIDES}
        forward: dict[str, int] = dict.fromkeys(SIDES, 0)
        real = 0
        for turn in range(args.turns):
            batch = long_tailed_batch(args.samples, args.max_new_tokens, vocab, seed=turn)
            tokens = sum(len(a) + len(b) for a, b in zip(batch.prompt_ids, batch.response_ids))
            order = SIDES[turn % 3 :] + SIDES[: turn % 3]  # rotate who goes first
            for side in order:
                worker.spec = specs[side]
                if turn >= args.warmup:
                    forward[side] += forward_tokens(batch, worker)
                t0 = time.perf_counter()
                worker.train(turn, batch)
                rates[side].append(tokens / (time.perf_counter() - t0))
            if turn >= args.warmup:
                real += tokens
            print(f"turn {turn}: " + ", ".join(f"{s} {rates[s][-1]:8.0f} tok/s" for s in SIDES), flush=True)
        worker.shutdown()

    kept = {s: rates[s][args.warmup :] for s in SIDES}

    def ratio(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(kept[a], kept[b]))

    lengths = [len(a) + len(b) for a, b in zip(batch.prompt_ids, batch.response_ids)]
    print(
        f"{args.samples} samples a step, lengths prompt 16-48 + response lognormal(ln 48, 0.9) <= "
        f"{args.max_new_tokens} (last batch: median {statistics.median(lengths):.0f}, max {max(lengths)}); "
        f"model hidden {args.hidden} x {args.layers} layers; {args.turns} turns ({args.warmup} warm-up left out)"
    )
    for s in SIDES:
        print(
            f"{s:14s}: {statistics.median(kept[s]):8.0f} tokens/s (median), "
            f"forward tokens / real tokens {forward[s] / max(real, 1):.2f}"
        )
    print(
        json.dumps(
            {
                "packed_over_padded": round(ratio("packed", "padded"), 4),
                "packed_over_padded_budget": round(ratio("packed", "padded_budget"), 4),
                "padded_budget_over_padded": round(ratio("padded_budget", "padded"), 4),
                **{f"{s}_tokens_per_s": round(statistics.median(kept[s]), 1) for s in SIDES},
                **{f"{s}_padding_factor": round(forward[s] / max(real, 1), 3) for s in SIDES},
            }
        )
    )
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
