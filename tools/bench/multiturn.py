#!/usr/bin/env python3
"""Multi-turn episodes: episodes per second through rlhpc against a plain loop, same engine, same requests.

One CPU engine server process (``rlhpc.engine_server.cpu``, the tiny model with its BPE
tokenizer and ChatML template, one torch thread, as the loop starts it) serves both sides, which
run the built-in ``guess`` task's episodes (``rlhpc.data.guess``) turn by turn in lockstep:

- plain: the loop anyone would write against the engine: one /generate per turn with every
  running episode's tokens so far, the environment stepped with the engine's text, the
  observation's tokens from a hand-written ChatML string appended to the engine's own;
- rlhpc: ``Generation.rollout`` with the run's episode settings (``make_episodes``): the chat
  template rendered per turn with its prefix checks, per-token masks, versions and turns, the
  rewards, advantages and the training batch. It sends through ``one_batch`` (one /generate per
  turn with a single engine, as the pool sends it); the pool's own dispatch is in
  ``tools/bench/loop_overhead.py``'s figure.

Both sides send the same requests (same token ids, same per-sample seeds), which is checked:
every episode's tokens must come out equal (``same_tokens``). The sides take turns (plain,
rlhpc, plain, ...) on the same rollouts, so a machine whose speed drifts moves both alike; a
ratio is the median over the turns of plain seconds / rlhpc seconds for the same rollout. The
engine's busy fraction is the share of a side's wall time with a /generate in flight. Scaling:
the same at each count of concurrent episodes (``--episodes``).

    python tools/bench/multiturn.py
    python tools/bench/multiturn.py --episodes 8 32 128 --repeats 5 --max-turns 4

The last line is one JSON object: ``episodes_vs_plain`` (rlhpc's episodes per second / plain's,
at the largest count: the goal is >= 0.9), the same per count (``episodes_vs_plain_<count>``),
episodes per second of each side (``rlhpc_eps_<count>``, ``plain_eps_<count>``), the engine's
busy fraction on each side (``engine_busy_rlhpc``, ``engine_busy_plain``, largest count), the
driver's CPU milliseconds per rollout on each side (``driver_ms_rlhpc``, ``driver_ms_plain``,
largest count: the engine runs in its own process, so this is the driver's own work, which a
machine's load moves less than wall time), and ``same_tokens``. Timings are never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlhpc.config import Config
from rlhpc.data.guess import GuessEnv
from rlhpc.data.rows import as_row
from rlhpc.data.tasks import TASKS, load_split
from rlhpc.logs import setup_logging
from rlhpc.model import build_tiny_model, load_tokenizer
from rlhpc.preflight import load_config
from rlhpc.rollout.build import build_generation
from rlhpc.rollout.generation import Generation, one_batch
from rlhpc.wire.client import EngineClient
from rlhpc.wire.request import sample_seed

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "jobs" / "configs" / "embedded.yaml"  # the embedded default: the tiny model


class BusyClient:
    """An ``EngineClient`` that records when each /generate was in flight."""

    def __init__(self, client: EngineClient):
        self.client, self.busy_s = client, 0.0

    def generate(self, **kw) -> list[dict]:
        t0 = time.perf_counter()
        try:
            return self.client.generate(**kw)
        finally:
            self.busy_s += time.perf_counter() - t0


def start_engine(model_path: Path, work: Path) -> tuple[subprocess.Popen, str]:
    ready = work / "engine.ready.json"
    logf = open(work / "engine.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhpc.engine_server.cpu", "--model-path", str(model_path), "--port", "0"]
        + ["--ready-file", str(ready), "--parent-pid", str(os.getpid()), "--log-level", "WARNING"],
        stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the engine did not start:\n{(work / 'engine.log').read_text()[-3000:]}")
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, f"http://{info['host']}:{info['port']}"


def plain_episodes(
    client: BusyClient, tok, cfg: Config, rows: list[dict], rollout_id: int
) -> list[tuple[list[int], float]]:
    """The guess episodes of ``rows`` (n each) as a plain loop runs them: (response ids, reward) each."""
    r, n = cfg.rollout, cfg.rollout.n_samples_per_prompt
    total = len(rows) * n
    envs = [GuessEnv() for _ in range(total)]
    first = [env.reset(as_row(rows[k // n])) for k, env in enumerate(envs)]
    texts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in first]
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    responses: list[list[int]] = [[] for _ in range(total)]
    rewards, done = [0.0] * total, [False] * total
    end = tok.convert_tokens_to_ids("<|im_end|>")
    for turn in range(r.max_turns):
        active = [k for k in range(total) if not done[k]]
        if not active:
            break
        outs = client.generate(
            input_ids=[prompts[k] + responses[k] for k in active],
            sampling_params=[
                {
                    "max_new_tokens": min(r.max_new_tokens, r.max_episode_tokens - len(responses[k])),
                    "temperature": r.temperature, "top_p": r.top_p,
                    "sampling_seed": sample_seed(cfg.seed, rollout_id, k // n, k % n, *((turn,) if turn else ())),
                }
                for k in active
            ],
            return_logprob=True,
        )  # fmt: skip
        for k, out in zip(active, outs):
            ids = list(out["output_ids"])
            responses[k] += ids
            observation, reward, finished = envs[k].step(out["text"])
            rewards[k] += reward
            if finished:
                done[k] = True
                continue
            closed = "\n" if ids and ids[-1] == end else "<|im_end|>\n"
            text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in observation)
            extra = tok.encode(closed + text + "<|im_start|>assistant\n", add_special_tokens=False)
            if turn + 1 == r.max_turns or len(responses[k]) + len(extra) >= r.max_episode_tokens:
                done[k] = True
            else:
                responses[k] += extra
    return list(zip(responses, rewards))


def timed(client: BusyClient, fn: Callable[..., Any], *args: Any) -> tuple[float, float, float, Any]:
    """(wall seconds, seconds with a /generate in flight, the driver's CPU seconds, result) of ``fn(*args)``."""
    busy0, cpu0, t0 = client.busy_s, time.process_time(), time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, client.busy_s - busy0, time.process_time() - cpu0, out


def bench_count(
    count: int, repeats: int, client: BusyClient, tok, cfg: Config, rows_all: list[dict], gen: Generation
) -> dict:
    n = cfg.rollout.n_samples_per_prompt
    num_rows = max(1, count // n)
    plain_s, ours_s, plain_busy, ours_busy, plain_cpu, ours_cpu, same = [], [], [], [], [], [], True
    for rep in range(repeats + 1):  # the first pair warms both up and is left out
        rollout_id = 1000 * count + rep
        start = (rep * num_rows) % max(1, len(rows_all) - num_rows)
        rows = rows_all[start : start + num_rows]
        wall_p, busy_p, cpu_p, plain = timed(client, plain_episodes, client, tok, cfg, rows, rollout_id)
        wall_r, busy_r, cpu_r, ours = timed(client, gen.rollout, rollout_id, rows)
        batch = ours[0]
        same = same and [ids for ids, _ in plain] == [list(x) for x in batch.response_ids]
        plain_rewards = torch.tensor([rw for _, rw in plain], dtype=batch.rewards.dtype)
        same = same and torch.equal(plain_rewards, batch.rewards)
        if rep:
            plain_s.append(wall_p)
            ours_s.append(wall_r)
            plain_busy.append(busy_p / wall_p)
            ours_busy.append(busy_r / wall_r)
            plain_cpu.append(cpu_p)
            ours_cpu.append(cpu_r)
    episodes = num_rows * n
    return {
        "episodes": episodes,
        "plain_eps": episodes / statistics.median(plain_s),
        "rlhpc_eps": episodes / statistics.median(ours_s),
        "ratio": statistics.median(p / o for p, o in zip(plain_s, ours_s)),
        "engine_busy_plain": statistics.median(plain_busy),
        "engine_busy_rlhpc": statistics.median(ours_busy),
        "driver_ms_plain": 1e3 * statistics.median(plain_cpu),
        "driver_ms_rlhpc": 1e3 * statistics.median(ours_cpu),
        "same_tokens": same,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, nargs="+", default=[8, 32, 128], help="concurrent episodes per rollout")
    p.add_argument("--repeats", type=int, default=5, help="timed turns of each side per count")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--max-episode-tokens", type=int, default=96)
    args = p.parse_args(argv)
    setup_logging("WARNING")
    torch.set_num_threads(1)
    cfg = load_config(
        CONFIG,
        [
            "data.task=guess", "model.tiny.tokenizer=bpe", f"rollout.max_turns={args.max_turns}",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.max_episode_tokens={args.max_episode_tokens}",
        ],
    )  # fmt: skip
    r, n = cfg.rollout, cfg.rollout.n_samples_per_prompt
    rows_all = load_split(TASKS["guess"], None, max(args.episodes) // n * (args.repeats + 2), cfg.data.seed)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_path = build_tiny_model(work / "model", cfg.model.tiny)
        tok = load_tokenizer(str(model_path))
        proc, url = start_engine(model_path, work)
        try:
            client = BusyClient(EngineClient(url, 600.0))
            gen = build_generation(cfg, tok, one_batch(client))
            print(
                f"setup: tiny model (BPE, ChatML), one CPU engine server (1 torch thread), guess task, "
                f"{n} episodes per prompt, max_turns {r.max_turns}, max_new_tokens {r.max_new_tokens}, "
                f"max_episode_tokens {r.max_episode_tokens}; counts {args.episodes}, {args.repeats} turns each "
                "side per count (plus one warm-up pair)"
            )
            results = {c: bench_count(c, args.repeats, client, tok, cfg, rows_all, gen) for c in args.episodes}
        finally:
            proc.terminate()
            proc.wait(15)
    print(
        f"{'episodes':>9} {'plain ep/s':>11} {'rlhpc ep/s':>11} {'ratio':>6} {'busy plain':>11} {'busy rlhpc':>11} "
        f"{'cpu ms plain':>13} {'cpu ms rlhpc':>13}"
    )
    for x in results.values():
        print(
            f"{x['episodes']:>9} {x['plain_eps']:>11.1f} {x['rlhpc_eps']:>11.1f} {x['ratio']:>6.2f} "
            f"{x['engine_busy_plain']:>11.2f} {x['engine_busy_rlhpc']:>11.2f} "
            f"{x['driver_ms_plain']:>13.1f} {x['driver_ms_rlhpc']:>13.1f}"
        )
    largest = results[max(results)]
    out = {
        "episodes_vs_plain": round(largest["ratio"], 3),
        **{f"episodes_vs_plain_{c}": round(x["ratio"], 3) for c, x in results.items()},
        **{f"rlhpc_eps_{c}": round(x["rlhpc_eps"], 2) for c, x in results.items()},
        **{f"plain_eps_{c}": round(x["plain_eps"], 2) for c, x in results.items()},
        "engine_busy_rlhpc": round(largest["engine_busy_rlhpc"], 3),
        "engine_busy_plain": round(largest["engine_busy_plain"], 3),
        "driver_ms_rlhpc": round(largest["driver_ms_rlhpc"], 1),
        "driver_ms_plain": round(largest["driver_ms_plain"], 1),
        "same_tokens": all(x["same_tokens"] for x in results.values()),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
