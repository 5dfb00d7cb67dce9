#!/usr/bin/env python3
"""Framework overhead: seconds per rollout of the full loop vs the same work in one process.

Both sides use the same model, prompts, batch size, sampler and loss. The plain side is a
single Python loop (sample -> reward -> advantages -> one optimizer step, weights shared by
reference); the framework side is the real driver (``TrainLoop``): Ray placement, an engine
server over HTTP, a training rank over torch.distributed, bucketed weight sync every rollout,
each record logged and each rollout dumped (HDF5) as a run does.

    python tools/bench/loop_overhead.py --rollouts 40

The two sides take turns in blocks of ``--block`` rollouts in one process (plain, rlhpc, plain,
...), so a machine whose speed drifts (a VM with neighbours: 0.7x to 1.5x over a minute here)
moves both alike; each rollout is timed whole, wall clock, the framework's logging included.
The last line is one JSON object: ``plain_over_rlhpc`` (median plain seconds per rollout /
rlhpc's), the same per part (``generate_ratio``: sampling and scoring; ``train_ratio``: the
optimizer step, for rlhpc with its batch's trip to the rank), and the spread of the ratio over
the block pairs (``pair_ratio_min``, ``pair_ratio_max``).
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
from rlhpc.config import Config
from rlhpc.data.buffer import DataBuffer
from rlhpc.data.tasks import TASKS, load_split
from rlhpc.engine_server.cpu.sampling import sample
from rlhpc.logs import setup_logging
from rlhpc.model import load_model, load_tokenizer
from rlhpc.preflight import load_config
from rlhpc.run_dir import RunDir
from rlhpc.wire.request import sample_seed

CONFIG = Path(__file__).resolve().parents[2] / "jobs" / "configs" / "embedded.yaml"


class PlainLoop:
    """The same work as one rlhpc rollout, in this process: ``step`` returns its seconds whole
    (``step``), of sampling and scoring (``generate``) and of the optimizer step (``train``)."""

    def __init__(self, cfg: Config, model_path: str):
        self.cfg = cfg
        self.tok = load_tokenizer(model_path)
        self.model = load_model(model_path)
        a = cfg.actor
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=a.lr, betas=a.adam_betas, weight_decay=a.weight_decay)
        self.task = TASKS[cfg.data.task]
        self.buf = DataBuffer(
            load_split(self.task, None, cfg.data.num_train, cfg.data.seed), cfg.rollout.rollout_batch_size, cfg.seed
        )

    def step(self, rollout_id: int) -> dict[str, float]:
        cfg, tok, model, task = self.cfg, self.tok, self.model, self.task
        r, n = cfg.rollout, cfg.rollout.n_samples_per_prompt
        t0 = time.perf_counter()
        rows = self.buf.batch(rollout_id)
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
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.actor.grad_clip)
        self.opt.step()
        t2 = time.perf_counter()
        return {"step": t2 - t0, "generate": t1 - t0, "train": t2 - t1}


def blocks(rollouts: int, block: int) -> list[range]:
    """The rollout ids of each turn."""
    return [range(first, min(first + block, rollouts)) for first in range(0, rollouts, block)]


def interleaved(cfg: Config, run: RunDir, rollouts: int, block: int) -> tuple[list[dict], list[dict]]:
    """Per rollout, both sides: plain's ``step`` parts; rlhpc's wall seconds of one turn of the
    real loop (``step``) with its record's parts. Blocks of ``block`` rollouts, plain first."""
    from rlhpc.cluster.layout import plan_layout
    from rlhpc.launch.local_ray import local_ray
    from rlhpc.runtime.signals import StopRequest
    from rlhpc.runtime.staging import NOT_STAGED
    from rlhpc.runtime.startup import StartupClock

    torch.set_num_threads(1)  # the plain side's one thread, as each rlhpc process has
    plain_loop = PlainLoop(cfg, str(run.base_model))
    plain: list[dict] = []
    ours: list[dict] = []
    with local_ray(cfg.cluster, plan_layout(cfg.cluster, cfg.reward_model).num_slots, StopRequest()):
        from rlhpc.driver import TrainLoop  # imports ray: after local_ray set its token (read at import)

        loop = TrainLoop(cfg, run, None, None, StartupClock(run), NOT_STAGED)
        try:
            loop.begin()
            for ids in blocks(rollouts, block):
                plain += [plain_loop.step(r) for r in ids]
                for r in ids:
                    t0 = time.perf_counter()
                    loop.rollout(r)
                    ours.append({"step": time.perf_counter() - t0, **{k: loop.record[f"time/{k}"] for k in PARTS}})
        finally:
            loop.close()
        loop.shutdown()
    return plain, ours


PARTS = ("generate", "train", "update_weights")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=40, help="rollouts on each side")
    p.add_argument("--block", type=int, default=5, help="rollouts per turn of each side")
    p.add_argument("--warmup", type=int, default=3, help="rollouts left out of the medians on both sides")
    args = p.parse_args()
    setup_logging("WARNING")
    overrides = [
        f"rollout.num_rollout={args.rollouts}",
        "eval.interval=null",
        "checkpoint.save_interval=null",
        "logging.wandb_mode=disabled",
        "actor.num_steps_per_rollout=1",  # the plain loop takes one optimizer step per rollout
    ]
    cfg = load_config(CONFIG, overrides)
    # ... over the whole rollout in one forward
    samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    cfg.actor = dataclasses.replace(cfg.actor, micro_batch_size=samples)
    with tempfile.TemporaryDirectory() as tmp:
        run = RunDir(Path(tmp) / "run")
        run.prepare(cfg)
        plain, ours = interleaved(cfg, run, args.rollouts, args.block)

    def med(rows: list[dict], key: str, ids: range | None = None) -> float:
        """Median over ``ids`` (default: all rollouts), warm-up left out."""
        ids = range(len(rows)) if ids is None else ids
        return statistics.median(rows[i][key] for i in ids if i >= args.warmup)

    b, f = med(plain, "step"), med(ours, "step")
    pair_ratios = [
        med(plain, "step", ids) / med(ours, "step", ids)
        for ids in blocks(args.rollouts, args.block)
        if ids.stop > args.warmup
    ]
    print(
        f"rollout: {cfg.rollout.rollout_batch_size} prompts x {cfg.rollout.n_samples_per_prompt} samples, "
        f"{args.rollouts} rollouts each side in turns of {args.block} ({args.warmup} warm-up left out)"
    )
    print(f"plain single process : {b * 1000:8.1f} ms/rollout (median)")
    print(f"rlhpc full loop      : {f * 1000:8.1f} ms/rollout (median, wall clock of one turn of the loop)")
    print(f"overhead ratio       : {f / b:8.2f}x")
    print(
        f"plain step parts     : generate {med(plain, 'generate') * 1e3:.1f} ms, train {med(plain, 'train') * 1e3:.1f} ms"
    )
    print("rlhpc step parts     : " + ", ".join(f"{k} {med(ours, k) * 1e3:.1f} ms" for k in PARTS))
    print(f"plain/rlhpc per turn : {' '.join(f'{x:.2f}' for x in pair_ratios)}")
    # one JSON line of ratios, comparable run to run
    print(
        json.dumps(
            {
                "plain_over_rlhpc": round(b / f, 4),
                "plain_ms": round(b * 1000, 2),
                "rlhpc_ms": round(f * 1000, 2),
                "generate_ratio": round(med(plain, "generate") / med(ours, "generate"), 4),
                "train_ratio": round(med(plain, "train") / med(ours, "train"), 4),
                "pair_ratio_min": round(min(pair_ratios), 4),
                "pair_ratio_max": round(max(pair_ratios), 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    logging.getLogger().setLevel(logging.WARNING)
    sys.exit(main())
