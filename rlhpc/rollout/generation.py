"""One generation step, without Ray: rows -> /generate requests -> samples -> rewards -> advantages.

The requests go out through a ``Send``: the engine pool (``rlhpc.rollout.engine_pool``, which
spreads them over the engines and restarts dead ones), or ``one_batch(client)`` for a single
engine server (``tools/gpu_check.py``). A request's rows depend only on the row index and every
sample has its own seed, so a rerun, or a request sent again after an engine restart, gets the
same tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rlhpc.algo.grpo import ADVANTAGE_ESTIMATORS
from rlhpc.batch import RolloutBatch
from rlhpc.rollout.protocol import MetaInfo
from rlhpc.tasks import TASKS, RewardFn, resolve_reward

if TYPE_CHECKING:
    from rich.progress import Progress

    from rlhpc.config import AlgoConfig, DataConfig, EvalConfig, RolloutConfig

# Samples per /generate request: big enough to amortise HTTP, small enough to spread over engines.
SAMPLES_PER_REQUEST = 64


class GenerationAborted(Exception):
    """Generation was cut short for a stop request (preemption or time limit)."""


def sample_seed(*parts: object) -> int:
    """A stable per-sample seed: same run seed, rollout and sample -> same tokens on rerun."""
    return random.Random(":".join(map(str, parts))).getrandbits(62)


def weight_version(meta_info: dict) -> int:
    """The weight version an engine reports in a sample's meta_info, as the int the driver pushed
    (0 for an engine still on the weights on disk: SGLang calls that version "default")."""
    version = meta_info.get(MetaInfo.WEIGHT_VERSION)
    try:
        return int(version)
    except (TypeError, ValueError):
        return 0


def task_reward(data: DataConfig) -> RewardFn:
    """``data.reward`` if set, else the task's own reward."""
    return resolve_reward(data.reward) if data.reward else TASKS[data.task].reward


@dataclass(frozen=True)
class Request:
    """One /generate call: a batch of prompts (token ids), one sampling-params dict each."""

    input_ids: list[list[int]]
    sampling_params: list[dict]
    return_logprob: bool = True


class Send(Protocol):
    """Send every request; call ``done(c)`` (in the caller's thread) as request c's answers
    arrive; return the answers (SGLang's /generate output dicts) in request order."""

    def __call__(self, requests: Sequence[Request], done: Callable[[int], None]) -> list[list[dict]]: ...


class Generates(Protocol):
    """What ``one_batch`` sends through (``rlhpc.rollout.client.EngineClient``)."""

    def generate(self, *, input_ids: Any, sampling_params: Any, return_logprob: bool) -> Any: ...


def one_batch(client: Generates) -> Send:
    """A ``Send`` for one engine and no Ray or restarts: all requests as a single /generate call,
    so the engine samples the whole rollout as one batch."""

    def send(requests: Sequence[Request], done: Callable[[int], None]) -> list[list[dict]]:
        outputs = client.generate(
            input_ids=[ids for r in requests for ids in r.input_ids],
            sampling_params=[p for r in requests for p in r.sampling_params],
            return_logprob=any(r.return_logprob for r in requests),
        )
        answers, start = [], 0
        for c, r in enumerate(requests):
            answers.append(outputs[start : start + len(r.input_ids)])
            start += len(r.input_ids)
            done(c)
        return answers

    return send


@dataclass
class Samples:
    """``n`` samples per row, row-major (a row's samples adjacent), scored."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    logprobs: list[list[float]]
    rewards: torch.Tensor
    texts: dict[str, list[str]]  # "prompt", "response", "answer" per sample
    weight_versions: list[int]  # the weights each sample was generated with


class Generation:
    """Sample, score and turn rewards into advantages for a rollout (or an evaluation).

    ``progress``, when given, shows one bar per phase (rows done).
    """

    def __init__(
        self,
        tokenizer: Any,
        reward_fn: RewardFn,
        rollout: RolloutConfig,
        eval: EvalConfig,
        algo: AlgoConfig,
        seed: int,
        send: Send,
        progress: Progress | None = None,
    ):
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.rollout_cfg, self.eval_cfg, self.algo_cfg = rollout, eval, algo
        self.seed = seed
        self.send = send
        self.progress = progress

    def _encode(self, prompt: str) -> list[int]:
        return [self.tokenizer.bos_token_id, *self.tokenizer(prompt, add_special_tokens=False).input_ids]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t != self.tokenizer.eos_token_id], skip_special_tokens=True)

    def sample(
        self, rows: list[dict], n: int, temperature: float, max_new_tokens: int, seed_tag: object, desc: str
    ) -> Samples:
        """Sample ``n`` responses per row, in requests of a few rows each, and score them.

        A request's rows depend only on the row index, and every sample has its own seed, so a
        rerun sends exactly the same batches and gets the same tokens.
        """
        top_p = self.rollout_cfg.top_p
        per_request = max(1, SAMPLES_PER_REQUEST // n)
        chunks = [range(i, min(i + per_request, len(rows))) for i in range(0, len(rows), per_request)]
        prompts = [self._encode(row["prompt"]) for row in rows]
        requests = [
            Request(
                input_ids=[prompts[i] for i in chunk for _ in range(n)],
                sampling_params=[
                    {
                        "max_new_tokens": max_new_tokens,
                        "temperature": temperature,
                        "top_p": top_p,
                        "sampling_seed": sample_seed(self.seed, seed_tag, i, j),
                    }
                    for i in chunk
                    for j in range(n)
                ],
            )
            for chunk in chunks
        ]

        progress = self.progress
        bar = progress.add_task(desc, total=len(rows)) if progress is not None else None

        def done(c: int) -> None:
            if bar is not None:
                progress.advance(bar, len(chunks[c]))

        try:
            answers = self.send(requests, done)
        finally:
            if bar is not None:
                progress.remove_task(bar)

        outputs = [out for answer in answers for out in answer]  # row-major: a row's n samples adjacent
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
        versions = [weight_version(out["meta_info"]) for out in outputs]
        return Samples(prompt_ids, response_ids, logprobs, torch.tensor(rewards, dtype=torch.float32), texts, versions)

    def rollout(self, rollout_id: int, rows: list[dict]) -> tuple[RolloutBatch, dict[str, float], dict[str, list[str]]]:
        """One rollout of ``rows``: the training batch, its metrics and its texts."""
        r, algo = self.rollout_cfg, self.algo_cfg
        n = r.n_samples_per_prompt
        s = self.sample(rows, n, r.temperature, r.max_new_tokens, rollout_id, f"rollout {rollout_id}")
        advantages = ADVANTAGE_ESTIMATORS[algo.advantage_estimator](s.rewards, n, algo.normalize_std)
        batch = RolloutBatch(s.prompt_ids, s.response_ids, s.logprobs, s.rewards, advantages, n, s.weight_versions)
        lengths = torch.tensor([len(x) for x in s.response_ids], dtype=torch.float32)
        staleness = [rollout_id - v for v in s.weight_versions]
        metrics = {
            "reward": s.rewards.mean().item(),
            "reward_std": s.rewards.std(unbiased=False).item(),
            "response_len": lengths.mean().item(),
            "samples": float(len(batch)),
            "staleness/mean": sum(staleness) / max(len(staleness), 1),
            "staleness/max": float(max(staleness, default=0)),
        }
        return batch, metrics, s.texts

    def evaluate(self, rollout_id: int, rows: list[dict]) -> dict[str, float]:
        """Mean reward and response length on ``rows`` (the eval split) after ``rollout_id``."""
        e = self.eval_cfg
        max_new = e.max_new_tokens or self.rollout_cfg.max_new_tokens
        s = self.sample(rows, e.n_samples_per_prompt, e.temperature, max_new, "eval", f"eval after {rollout_id}")
        return {"reward": s.rewards.mean().item(), "response_len": sum(map(len, s.response_ids)) / len(s.response_ids)}
