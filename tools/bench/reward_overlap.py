"""Reward scoring overlapped with generation against scoring after the rollout (issue 30).

One rollout's generation and reward-model scoring, as the driver runs them: ``Generation.sample``
with its requests sent through an ``EnginePool`` of real CPU engine servers (under Ray, as a run
starts them) and the reward model's components scored by frozen reward engines (real CPU engine
servers answering /classify). The two modes send the same requests and the same /classify batches
(one per request); only when the batches go differs:

- after: every request's samples are scored once the whole rollout's generation is done
  (``reward_model.overlap: false``);
- overlapped: each request's samples go to the reward engines as soon as that request is
  answered, while the others are still generating (the default).

The modes run in turns (after, overlapped, after, ...) on the same engines, so a machine whose
speed drifts (a VM with neighbours) moves both alike; each turn's ratio is after / overlapped, and
the figure is the median of the turns' ratios. Every turn also checks that both modes gave the same
rewards, bit for bit. Besides the ratio it prints, per mode, the rollout's wall time and the reward
group's idle share of it, and the parts measured alone (generation only, scoring only), from which
the ideal speed-up (G + S) / max(G, S) follows: on a machine with fewer cores than engines the
generation and reward engines share the CPUs, so the measured figure stays below it.

The default distribution: the tiny policy of the tests (Llama, width 64) answering 64 prompts x 4
samples with up to 24 new tokens at temperature 1, in 8 requests to one generation engine (each
request a batch, so they are answered one after the other), scored by one reward engine serving a
tiny Qwen2 classifier of width ``--rm-hidden`` (default 128, 2 layers) with its byte-level BPE chat
template: scoring about as long as generation, where overlapping them pays most.

    python tools/bench/reward_overlap.py [--repeats 5] [--prompts 64] [--samples 4] [--max-new-tokens 24]
        [--requests 8] [--gen-engines 1] [--reward-engines 1] [--rm-hidden 128] [--rm-layers 2]

The last line is one JSON object: overlap_speedup (the median ratio), ideal_speedup, and the
per-mode figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path

log = logging.getLogger("reward_overlap")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="turns of (after, overlapped)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--requests", type=int, default=8, help="/generate requests the rollout is sent in")
    ap.add_argument("--gen-engines", type=int, default=1)
    ap.add_argument("--reward-engines", type=int, default=1)
    ap.add_argument("--rm-hidden", type=int, default=128, help="the tiny classifier's width")
    ap.add_argument("--rm-layers", type=int, default=2, help="the tiny classifier's layers")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("rlhpc").setLevel(logging.WARNING)

    import ray
    import torch

    from rlhpc.cluster.layout import plan_layout
    from rlhpc.cluster.placement import create_placement
    from rlhpc.config import (
        AlgoConfig,
        ClusterConfig,
        Config,
        EvalConfig,
        RewardModelConfig,
        RolloutConfig,
        TinyModelConfig,
    )
    from rlhpc.model import build_tiny_model, load_tokenizer
    from rlhpc.rollout.build import build_generation
    from rlhpc.rollout.engines import EnginePool
    from rlhpc.rollout.generation import Generation
    from rlhpc.rollout.reward_model import RewardModel, start_reward_engines
    from rlhpc.rollout.scoring import MixedScorer, Scorer

    root = Path(tempfile.mkdtemp(prefix="reward-overlap-bench-"))
    policy = build_tiny_model(root / "policy", TinyModelConfig())
    rm_tiny = TinyModelConfig(
        architecture="qwen2", tokenizer="bpe", hidden_size=args.rm_hidden, intermediate_size=4 * args.rm_hidden,
        num_hidden_layers=args.rm_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        seed=3,
    )  # fmt: skip
    rm_path = build_tiny_model(root / "rm", rm_tiny, classifier=True)
    g, r = args.gen_engines, args.reward_engines
    cluster = ClusterConfig(gpus_per_node=1 + g + r, actor_num_gpus=1, rollout_num_gpus=g)
    rm_cfg = RewardModelConfig(path=str(rm_path), num_gpus=r)
    rollout = RolloutConfig(n_samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens)
    rows = [{"prompt": f"{i % 50}+{i // 50}=", "answer": str(i % 50 + i // 50)} for i in range(args.prompts)]
    log.info(
        "distribution: %d prompts x %d samples, up to %d new tokens (temperature 1), in %d requests to %d "
        "generation engine(s); scored by %d reward engine(s), a classifier of width %d x %d layers",
        args.prompts, args.samples, args.max_new_tokens, args.requests, g, r, args.rm_hidden, args.rm_layers,
    )  # fmt: skip

    ray.init(num_cpus=2 + g + r, num_gpus=1 + g + r, include_dashboard=False, log_to_driver=False)
    try:
        layout = plan_layout(cluster, rm_cfg)
        placement = create_placement(layout.num_slots)
        gen_engines = EnginePool.start(rollout, cluster, 0, str(policy), placement, layout, root / "logs")
        rm_engines = start_reward_engines(rm_cfg, rollout, cluster, 0, str(rm_path), placement, layout, root / "rm")
        try:
            rm = RewardModel(rm_engines, load_tokenizer(str(rm_path)), batch_size=1024)
            tok = load_tokenizer(str(policy))

            def generation(overlap: bool | None) -> Generation:
                """None: no reward model (generation alone)."""
                rule = Scorer(lambda p, resp, a: 0.0, "rule")
                if overlap is None:
                    scorer = rule
                else:
                    scorer = MixedScorer(
                        rule, 0.0, {"reward_model": (1.0, rm.score)},
                        groups={"reward_model": rm.score_groups}, overlap=overlap,
                    )  # fmt: skip
                return build_generation(
                    Config(rollout=rollout, eval=EvalConfig(), algo=AlgoConfig(), seed=7),
                    tok,
                    gen_engines.generate,
                    args.requests,
                    reward=scorer,
                )

            def timed(gen: Generation, turn: int):
                rm.clock.intervals.clear()
                start = time.perf_counter()
                s = gen.sample(rows, args.samples, 1.0, args.max_new_tokens, ("bench", turn), "rollout")
                stop = time.perf_counter()
                return stop - start, rm.clock.idle_fraction(start, stop), s

            after_gen, overlap_gen, alone_gen = generation(False), generation(True), generation(None)
            timed(after_gen, -1)  # warm-up: first requests of each engine
            figures: dict[str, list[float]] = {k: [] for k in ("after", "overlapped", "gen", "score", "ratio")}
            idle: dict[str, list[float]] = {"after": [], "overlapped": []}
            for turn in range(args.repeats):
                a_s, a_idle, a = timed(after_gen, turn)
                o_s, o_idle, o = timed(overlap_gen, turn)
                if not torch.equal(a.rewards, o.rewards):
                    raise SystemExit(f"turn {turn}: the overlapped rewards differ from those scored after the rollout")
                g_s, _, plain = timed(alone_gen, turn)
                start = time.perf_counter()
                rm.score_groups(_groups(plain, rows, args))
                s_s = time.perf_counter() - start
                for key, value in (("after", a_s), ("overlapped", o_s), ("gen", g_s), ("score", s_s)):
                    figures[key].append(value)
                figures["ratio"].append(a_s / o_s)
                idle["after"].append(a_idle)
                idle["overlapped"].append(o_idle)
                log.info(
                    "turn %d: after %.2f s, overlapped %.2f s (x%.2f); generation alone %.2f s, scoring alone %.2f s",
                    turn, a_s, o_s, a_s / o_s, g_s, s_s,
                )  # fmt: skip
        finally:
            rm_engines.shutdown()
            gen_engines.shutdown()
            placement.remove()
    finally:
        ray.shutdown()
        shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in figures.items()}
    ideal = (med["gen"] + med["score"]) / max(med["gen"], med["score"])
    log.info("%-11s %9s %12s", "mode", "rollout s", "reward idle")
    for mode in ("after", "overlapped"):
        log.info("%-11s %9.2f %12.2f", mode, med[mode], statistics.median(idle[mode]))
    log.info(
        "medians over %d turns: overlapped speed-up x%.2f (ideal (G+S)/max(G,S) = x%.2f: G %.2f s, S %.2f s); "
        "rewards equal in every turn",
        args.repeats, med["ratio"], ideal, med["gen"], med["score"],
    )  # fmt: skip
    summary = {
        "overlap_speedup": med["ratio"],
        "ideal_speedup": ideal,
        "after_s": med["after"],
        "overlapped_s": med["overlapped"],
        "generate_alone_s": med["gen"],
        "score_alone_s": med["score"],
        "reward_idle_after": statistics.median(idle["after"]),
        "reward_idle_overlapped": statistics.median(idle["overlapped"]),
        "ratio_min": min(figures["ratio"]),
        "ratio_max": max(figures["ratio"]),
        "repeats": args.repeats,
    }
    print(json.dumps(summary))
    return summary


def _groups(samples, rows: list[dict], args: argparse.Namespace) -> list[list]:
    """The rollout's samples grouped as its requests were (what both modes send), for scoring alone."""
    from rlhpc.rollout.sampler import rows_per_request
    from rlhpc.rollout.scoring import Sample

    per = rows_per_request(len(rows), args.samples, args.requests) * args.samples
    flat = [
        Sample(prompt=p, response=resp, label=a)
        for p, resp, a in zip(samples.texts["prompt"], samples.texts["response"], samples.texts["answer"])
    ]
    return [flat[i : i + per] for i in range(0, len(flat), per)]


if __name__ == "__main__":
    main()
