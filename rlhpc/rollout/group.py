"""The rollout group: engines on the rollout GPUs, the prompt buffer, generation and rewards.

It lives in the driver process and talks to every engine over SGLang's HTTP protocol, so
the same code drives the CPU engine server here and SGLang servers on a GPU cluster.
"""

from __future__ import annotations

import logging
import random
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import ray
import torch
from rich.progress import Progress

from rlhpc.algo.grpo import ADVANTAGE_ESTIMATORS
from rlhpc.batch import RolloutBatch
from rlhpc.cluster.layout import Layout
from rlhpc.cluster.placement import Placement
from rlhpc.config import Config
from rlhpc.model import load_tokenizer
from rlhpc.rollout.buffer import DataBuffer
from rlhpc.rollout.client import EngineClient
from rlhpc.rollout.engine import EngineActor
from rlhpc.tasks import TASKS, load_split, resolve_reward

log = logging.getLogger(__name__)

# Share of a GPU an engine takes when it sits beside an actor rank (colocate).
COLOCATED_ENGINE_GPU = 0.2
# Samples per /generate request: big enough to amortise HTTP, small enough to spread over engines.
SAMPLES_PER_REQUEST = 64


class GenerationAborted(Exception):
    """Generation was cut short for a stop request (preemption or time limit)."""


def sample_seed(*parts: object) -> int:
    """A stable per-sample seed: same run seed, rollout and sample -> same tokens on rerun."""
    return random.Random(":".join(map(str, parts))).getrandbits(62)


class RolloutGroup:
    def __init__(self, cfg: Config, model_path: str, placement: Placement, layout: Layout, log_dir: Path):
        self.cfg = cfg
        self.tokenizer = load_tokenizer(model_path)
        task = TASKS[cfg.data.task]
        self.reward_fn = resolve_reward(cfg.data.reward) if cfg.data.reward else task.reward
        train_rows = load_split(task, cfg.data.train_file, cfg.data.num_train, cfg.data.seed)
        self.eval_rows = load_split(task, cfg.data.eval_file, cfg.data.num_eval, cfg.data.seed + 1)
        self.data_buffer = DataBuffer(train_rows, cfg.rollout.rollout_batch_size, cfg.seed)

        gpu = COLOCATED_ENGINE_GPU if layout.colocate else 1
        self.engine_world_sizes = [len(slots) for slots in layout.engine_slots]
        self.engines = [
            EngineActor.options(num_gpus=gpu, num_cpus=0.5, scheduling_strategy=placement.strategy(slots[0])).remote(
                model_path, str(log_dir), e, cfg.rollout.engine_startup_timeout_s, None
            )
            for e, slots in enumerate(layout.engine_slots)
        ]
        urls = ray.get([e.url.remote() for e in self.engines])
        self.clients = [EngineClient(url) for url in urls]
        log.info("rollout engines up: %s", ", ".join(urls))
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)))
        self.progress: Progress | None = None  # the driver's live display, for per-phase bars
        self.stop = None  # the job's StopRequest: generation in flight is aborted when it is set

    @property
    def engine_urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    # ------------------------------------------------------------ generation

    def _encode(self, prompt: str) -> list[int]:
        return [self.tokenizer.bos_token_id, *self.tokenizer(prompt, add_special_tokens=False).input_ids]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t != self.tokenizer.eos_token_id], skip_special_tokens=True)

    def _run(self, rows: list[dict], n: int, temperature: float, max_new_tokens: int, seed_tag: object, desc: str):
        """Sample ``n`` responses per row, in requests of a few rows spread over the engines.

        A request's rows and its engine depend only on the row index, and every sample has its
        own seed, so a rerun sends the engines exactly the same batches and gets the same tokens.
        """
        top_p = self.cfg.rollout.top_p
        per_request = max(1, SAMPLES_PER_REQUEST // n)
        chunks = [range(i, min(i + per_request, len(rows))) for i in range(0, len(rows), per_request)]
        prompts = [self._encode(row["prompt"]) for row in rows]

        def request(c: int) -> list[dict]:
            ids, params = [], []
            for i in chunks[c]:
                for j in range(n):
                    ids.append(prompts[i])
                    seed = sample_seed(self.cfg.seed, seed_tag, i, j)
                    params.append(
                        {
                            "max_new_tokens": max_new_tokens,
                            "temperature": temperature,
                            "top_p": top_p,
                            "sampling_seed": seed,
                        }
                    )
            return self.clients[c % len(self.clients)].generate(
                input_ids=ids, sampling_params=params, return_logprob=True
            )

        results: list[list[dict]] = [[] for _ in chunks]
        bar = self.progress.add_task(desc, total=len(rows)) if self.progress else None
        futures = {self._pool.submit(request, c): c for c in range(len(chunks))}
        try:
            for fut in as_completed(futures):
                if self.stop is not None and self.stop.requested:
                    self._abort(futures)
                c = futures[fut]
                results[c] = fut.result()
                if bar is not None:
                    self.progress.advance(bar, len(chunks[c]))
        finally:
            if bar is not None:
                self.progress.remove_task(bar)

        outputs = [out for chunk in results for out in chunk]  # row-major: a row's n samples adjacent
        response_ids = [list(out["output_ids"]) for out in outputs]
        logprobs = [[lp for lp, _tok, _ in out["meta_info"].get("output_token_logprobs", [])] for out in outputs]
        texts = {
            "prompt": [rows[k // n]["prompt"] for k in range(len(outputs))],
            "response": [self._decode(ids) for ids in response_ids],
            "answer": [rows[k // n]["answer"] for k in range(len(outputs))],
        }
        rewards = [
            float(self.reward_fn(p, r, a)) for p, r, a in zip(texts["prompt"], texts["response"], texts["answer"])
        ]
        prompt_ids = [prompts[k // n] for k in range(len(outputs))]
        return prompt_ids, response_ids, logprobs, torch.tensor(rewards, dtype=torch.float32), texts

    def _abort(self, futures: dict) -> None:
        """Cut generation short: the engines drop what is in flight, pending requests are dropped."""
        for fut in futures:
            fut.cancel()
        for client in self.clients:
            try:
                client.abort_request(abort_all=True)
            except Exception as e:  # an engine already gone has nothing to abort
                log.debug("abort on %s: %s", client.base_url, e)
        raise GenerationAborted()

    def generate(self, rollout_id: int) -> tuple[RolloutBatch, dict[str, float], dict[str, list[str]]]:
        """One rollout: sample, score, and turn rewards into advantages."""
        r, algo = self.cfg.rollout, self.cfg.algo
        rows = self.data_buffer.batch(rollout_id)
        prompt_ids, response_ids, logprobs, rewards, texts = self._run(
            rows, r.n_samples_per_prompt, r.temperature, r.max_new_tokens, rollout_id, f"rollout {rollout_id}"
        )
        advantages = ADVANTAGE_ESTIMATORS[algo.advantage_estimator](rewards, r.n_samples_per_prompt, algo.normalize_std)
        batch = RolloutBatch(prompt_ids, response_ids, logprobs, rewards, advantages, r.n_samples_per_prompt)
        lengths = torch.tensor([len(x) for x in response_ids], dtype=torch.float32)
        metrics = {
            "reward": rewards.mean().item(),
            "reward_std": rewards.std(unbiased=False).item(),
            "response_len": lengths.mean().item(),
            "samples": float(len(batch)),
        }
        return batch, metrics, texts

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        e = self.cfg.eval
        max_new = e.max_new_tokens or self.cfg.rollout.max_new_tokens
        _, response_ids, _, rewards, _ = self._run(
            self.eval_rows, e.n_samples_per_prompt, e.temperature, max_new, "eval", f"eval after {rollout_id}"
        )
        return {"reward": rewards.mean().item(), "response_len": sum(map(len, response_ids)) / len(response_ids)}

    # ------------------------------------------------------------ memory and lifecycle

    def offload(self) -> None:
        """Free engine weights and KV cache (for the actor's turn on shared GPUs)."""
        list(self._pool.map(lambda c: c.release_memory_occupation(), self.clients))

    def onload(self) -> None:
        list(self._pool.map(lambda c: c.resume_memory_occupation(), self.clients))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote(), timeout=30)
            except Exception as e:  # a dead engine has nothing left to stop
                log.debug("engine shutdown: %s", e)
