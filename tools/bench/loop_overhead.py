#!/usr/bin/env python3
"""Framework overhead: seconds per rollout of the full loop vs the same work in one process.

Both sides use the same model, prompts, batch size, sampler and loss. The plain side is a
single Python loop (sample -> reward -> advantages -> one optimizer step, weights shared by
reference); the framework side is the real driver: Ray placement, an engine server over
HTTP, a training rank over torch.distributed, bucketed weight sync every rollout.

    python tools/bench/loop_overhead.py --rollouts 30

The plain loop runs before and after the rlhpc one and its figures are the mean of the two.
The last line is one JSON object: ``plain_over_rlhpc`` (plain seconds per rollout / rlhpc's),
the same per part (``generate_ratio``: sampling and scoring; ``train_ratio``: the optimizer
step, for rlhpc with its batch's trip to the rank), and ``plain_drift`` (after / before).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlhpc.algo.grpo import ADVANTAGE_ESTIMATORS, policy_loss
from rlhpc.config import Config, load_config
from rlhpc.logs import setup_logging
from rlhpc.model import load_model, load_tokenizer
from rlhpc.rollout.buffer import DataBuffer
from rlhpc.rollout.generation import sample_seed
from rlhpc.rollout.sampling import sample
from rlhpc.run_dir import RunDir
from rlhpc.tasks import TASKS, load_split

CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "embedded.yaml"


def plain_loop(cfg: Config, model_path: str, rollouts: int) -> list[dict[str, float]]:
    """Per rollout: seconds of the whole step (``step``), of sampling and scoring (``generate``)
    and of the optimizer step (``train``)."""
    torch.set_num_threads(1)
    tok = load_tokenizer(model_path)
    model = load_model(model_path)
    opt = torch.optim.AdamW(
        model.parameters(), lr=cfg.actor.lr, betas=cfg.actor.adam_betas, weight_decay=cfg.actor.weight_decay
    )
    task = TASKS[cfg.data.task]
    buf = DataBuffer(
        load_split(task, None, cfg.data.num_train, cfg.data.seed), cfg.rollout.rollout_batch_size, cfg.seed
    )
    r, n = cfg.rollout, cfg.rollout.n_samples_per_prompt
    times = []
    for rollout_id in range(rollouts):
        t0 = time.perf_counter()
        rows = buf.batch(rollout_id)
        prompts = [
            [tok.bos_token_id, *tok(row["prompt"], add_special_tokens=False).input_ids]
            for row in rows
            for _ in range(n)
        ]
        seeds = [sample_seed(cfg.seed, rollout_id, i, j) for i in range(len(rows)) for j in range(n)]
        model.eval()
        outs = sample(
            model,
            prompts,
            [r.max_new_tokens] * len(prompts),
            [r.temperature] * len(prompts),
            [r.top_p] * len(prompts),
            seeds,
            tok.eos_token_id,
            tok.pad_token_id,
        )
        rewards = torch.tensor(
            [
                task.reward(
                    rows[i // n]["prompt"], tok.decode(o.output_ids, skip_special_tokens=True), rows[i // n]["answer"]
                )
                for i, o in enumerate(outs)
            ]
        )
        t1 = time.perf_counter()
        adv = ADVANTAGE_ESTIMATORS[cfg.algo.advantage_estimator](rewards, n, cfg.algo.normalize_std)
        width = max(len(p) + len(o.output_ids) for p, o in zip(prompts, outs))
        ids = torch.full((len(prompts), width), tok.pad_token_id)
        att = torch.zeros_like(ids)
        mask = torch.zeros(len(prompts), width - 1)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            seq = p + o.output_ids
            ids[i, : len(seq)], att[i, : len(seq)] = torch.tensor(seq), 1
            mask[i, len(p) - 1 : len(seq) - 1] = 1
        model.train()
        logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss, _ = policy_loss(lp, lp.detach(), adv, mask, cfg.algo.eps_clip, cfg.algo.eps_clip_high)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.grad_clip)
        opt.step()
        t2 = time.perf_counter()
        times.append({"step": t2 - t0, "generate": t1 - t0, "train": t2 - t1})
    return times


def framework_loop(cfg: Config, run: RunDir) -> list[dict]:
    from rlhpc.cluster.layout import plan_layout
    from rlhpc.driver import train
    from rlhpc.launch.job import local_ray
    from rlhpc.launch.signals import StopRequest
    from rlhpc.metrics import read_metrics

    with local_ray(cfg.cluster, plan_layout(cfg.cluster).num_slots, StopRequest()):
        train(cfg, run)
    return [r for r in read_metrics(run.path) if r["kind"] == "rollout"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3, help="rollouts left out of the means on both sides")
    args = p.parse_args()
    setup_logging("WARNING")
    overrides = [
        f"rollout.num_rollout={args.rollouts}",
        "eval.interval=null",
        "checkpoint.save_interval=null",
        "logging.wandb_mode=disabled",
        "logging.dump_rollouts=false",
        "actor.num_steps_per_rollout=1",  # the plain loop takes one optimizer step per rollout
    ]
    cfg = load_config(CONFIG, overrides)
    # ... over the whole rollout in one forward
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    cfg.actor = dataclasses.replace(cfg.actor, micro_batch_size=samples)
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp) / "run")
        run.prepare(cfg)
        # plain, rlhpc, plain: the plain figures are the mean of the runs on either side, so a
        # machine that drifts over the minute the rlhpc run takes (a VM with neighbours) moves both alike
        before = plain_loop(cfg, str(run.base_model), args.rollouts)[args.warmup :]
        records = framework_loop(cfg, run)[args.warmup :]
        after = plain_loop(cfg, str(run.base_model), args.rollouts)[args.warmup :]
    parts = ("generate", "train")
    plain = {
        k: (statistics.median(t[k] for t in before) + statistics.median(t[k] for t in after)) / 2
        for k in ("step", *parts)
    }
    ours = {k: statistics.median(r[f"time/{k}"] for r in records) for k in ("step", *parts, "update_weights")}
    f, b = ours["step"], plain["step"]
    print(
        f"rollout: {cfg.rollout.rollout_batch_size} prompts x {cfg.rollout.n_samples_per_prompt} samples, {args.rollouts} rollouts ({args.warmup} warm-up left out)"
    )
    print(f"plain single process : {b * 1000:8.1f} ms/rollout (median; mean of the runs before and after)")
    print(f"rlhpc full loop      : {f * 1000:8.1f} ms/rollout (median)")
    print(f"overhead ratio       : {f / b:8.2f}x")
    print("plain step parts     : " + ", ".join(f"{k} {plain[k] * 1000:.1f} ms" for k in parts))
    print("rlhpc step parts     : " + ", ".join(f"{k} {ours[k] * 1000:.1f} ms" for k in (*parts, "update_weights")))
    drift = statistics.median(t["step"] for t in after) / statistics.median(t["step"] for t in before)
    # one JSON line of ratios, comparable run to run
    print(
        json.dumps(
            {
                "plain_over_rlhpc": round(b / f, 4),
                "plain_ms": round(b * 1000, 2),
                "rlhpc_ms": round(f * 1000, 2),
                "generate_ratio": round(plain["generate"] / ours["generate"], 4),
                "train_ratio": round(plain["train"] / ours["train"], 4),
                "plain_drift": round(drift, 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    logging.getLogger().setLevel(logging.WARNING)
    sys.exit(main())
