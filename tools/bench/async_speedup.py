"""The asynchronous pipeline's speed-up: the same job run synchronously, with K = 1 and K = 2.

Each mode is a whole local job (jobs/submit.py --cluster local: one CPU engine server, one CPU
training rank), run one after the other on this machine: sync, K = 1, sync, K = 2, sync. Each
async run's speed-up is against the mean of the two sync runs beside it: this machine (a VM
with neighbours) drifts by up to 30 % over minutes, and a sync run on each side of every async
run keeps that drift out of the ratio. Per mode it prints rollouts per second (over the
rollouts after the first ``--warmup``, from the per-rollout step times the driver logs), the
mean idle fraction of each group (``time/actor_idle``, ``time/rollout_idle``), the mean
generation / training / weight-push seconds, and the final greedy eval reward.

The configuration is the embedded job (single-digit addition, its tiny Llama of width 64) with
``rollout_batch_size`` raised to 128 prompts x 8 samples and answers of up to
``--max-new-tokens 8`` (the reward reads the first digit and ignores the rest), so that one
rollout's generation (prompts x samples through the engine) and its training (two optimizer
steps on them) take about the same time, under half a second each: where overlapping them pays
most. (With the embedded job's one-token answers, generation takes half as long as training,
which bounds the K = 1 speed-up near 1.5x whatever the overlap; a wider model makes training
grow faster than generation, whose cost per token is mostly fixed.)
The weight push after each rollout runs in neither group's shadow (the engines must not
generate while their weights change, and the actor must not train while its weights are
read), so the ideal K = 1 speed-up is (G + T + P) / (max(G, T) + P).

    python tools/bench/async_speedup.py [--num-rollout 30] [--hidden 64] [--max-new-tokens 8] [--set KEY=VALUE] [--keep DIR]

The last line is one JSON object (speedup_k1, speedup_k2, eval_reward_sync, eval_reward_k1,
eval_reward_k2, train_reward_sync/_k1/_k2, ideal_speedup_k1, sync_max_over_min, and the
per-mode figures).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rlhpc.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
log = logging.getLogger("async_speedup")


def job(run: Path, args: argparse.Namespace, staleness: int) -> dict:
    overrides = [
        f"rollout.max_staleness={staleness}",
        f"rollout.num_rollout={args.num_rollout}",
        f"rollout.rollout_batch_size={args.rollout_batch_size}",
        f"data.num_train={args.rollout_batch_size * args.num_rollout}",
        f"eval.interval={args.num_rollout}",
        "checkpoint.save_interval=null",
        "logging.wandb_mode=disabled",
        "logging.dump_rollouts=false",
        f"seed={args.seed}",
        f"model.tiny.hidden_size={args.hidden}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        *args.set,
    ]
    cmd = [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "local", "--run-dir", str(run)]
    cmd += ["--config", str(REPO / "jobs" / "configs" / "embedded.yaml")]
    for o in overrides:
        cmd += ["--set", o]
    start = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"K={staleness} job failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    wall = time.perf_counter() - start
    records = read_metrics(run)
    steps = [r for r in records if r["kind"] == "rollout"][args.warmup :]
    evals = [r for r in records if r["kind"] == "eval"]

    def mean(key: str) -> float:
        values = [r[key] for r in steps if key in r]
        return sum(values) / len(values) if values else float("nan")

    loop_s = sum(r["time/step"] for r in steps)
    return {
        "max_staleness": staleness,
        "rollouts_per_s": len(steps) / loop_s,
        "actor_idle": mean("time/actor_idle"),
        "rollout_idle": mean("time/rollout_idle"),
        "generate_s": mean("time/generate"),
        "train_s": mean("time/train"),
        "update_weights_s": mean("time/update_weights"),
        "staleness_mean": mean("staleness/mean"),
        "eval_reward": evals[-1]["eval/reward"] if evals else float("nan"),
        # the sampled answers' reward over the last 5 rollouts: a finer sign of learning than
        # the greedy eval of 100 prompts, which moves in steps of 0.01 and stays near 0.1 here
        "train_reward_end": sum(r["reward"] for r in steps[-5:]) / len(steps[-5:]),
        "eval_reward_start": evals[0]["eval/reward"] if evals else float("nan"),
        "job_wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-rollout", type=int, default=30)
    ap.add_argument("--rollout-batch-size", type=int, default=128, help="prompts per rollout (x 8 samples)")
    ap.add_argument("--hidden", type=int, default=64, help="the tiny model's width (the embedded job's: 64)")
    ap.add_argument("--max-new-tokens", type=int, default=8, help="answer length (the embedded job's: 1)")
    ap.add_argument("--warmup", type=int, default=3, help="first rollouts left out of the rate")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--keep", type=Path, help="keep the five run dirs here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides, for all")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    root = args.keep or Path(tempfile.mkdtemp(prefix="async-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    try:
        for name, k in (("sync", 0), ("K=1", 1), ("sync 2", 0), ("K=2", 2), ("sync 3", 0)):
            log.info("running %s (%d rollouts of %d prompts x 8) ...", name, args.num_rollout, args.rollout_batch_size)
            runs[name] = job(root / name.replace(" ", "_").replace("=", ""), args, k)
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)

    # each async run against the sync runs on either side of it
    beside = {"K=1": ("sync", "sync 2"), "K=2": ("sync 2", "sync 3")}
    syncs = ("sync", "sync 2", "sync 3")

    def speedup(name: str) -> float:
        sync_rate = sum(runs[s]["rollouts_per_s"] for s in beside[name]) / len(beside[name])
        return runs[name]["rollouts_per_s"] / sync_rate

    log.info(
        "%-10s %10s %8s %11s %12s %7s %7s %7s %12s %13s",
        "mode", "rollouts/s", "speedup", "actor idle", "rollout idle", "gen s", "train s", "push s", "eval reward", "train reward",
    )  # fmt: skip
    for name, r in runs.items():
        log.info(
            "%-10s %10.3f %7.2fx %11.2f %12.2f %7.3f %7.3f %7.3f %12.3f %13.3f",
            name, r["rollouts_per_s"], speedup(name) if name in beside else 1.0,
            r["actor_idle"], r["rollout_idle"], r["generate_s"], r["train_s"], r["update_weights_s"], r["eval_reward"],
            r["train_reward_end"],
        )  # fmt: skip
    g, t, p = (sum(runs[s][key] for s in syncs) / len(syncs) for key in ("generate_s", "train_s", "update_weights_s"))
    ideal = (g + t + p) / (max(g, t) + p)
    log.info("ideal K=1 speed-up from the sync steps' parts (G+T+P)/(max(G,T)+P) = %.2fx", ideal)
    rates = [runs[s]["rollouts_per_s"] for s in syncs]
    summary = {
        "speedup_k1": speedup("K=1"),
        "speedup_k2": speedup("K=2"),
        "eval_reward_sync": runs["sync"]["eval_reward"],
        "eval_reward_k1": runs["K=1"]["eval_reward"],
        "eval_reward_k2": runs["K=2"]["eval_reward"],
        "train_reward_sync": runs["sync"]["train_reward_end"],
        "train_reward_k1": runs["K=1"]["train_reward_end"],
        "train_reward_k2": runs["K=2"]["train_reward_end"],
        "ideal_speedup_k1": ideal,
        "sync_max_over_min": max(rates) / min(rates),
        "modes": runs,
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
