"""Actor groups for tests: a batch of uneven lengths, a group on its own placement, engine weights."""

from __future__ import annotations

import dataclasses
import logging
import random
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import ray
import torch

from rlhpc.actor.group import ActorGroup, ActorSpec
from rlhpc.batch import RolloutBatch
from rlhpc.cluster.placement import Placement, create_placement
from rlhpc.config import Config

log = logging.getLogger(__name__)


def make_batch(n: int, seed: int) -> RolloutBatch:
    """Uneven prompt/response lengths (so ranks and micro-batches hold unequal token counts)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 40) for _ in range(rng.randint(2, 6))] for _ in range(n)]
    responses = [[rng.randrange(3, 40) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    logprobs = [[-rng.random() * 3 for _ in r] for r in responses]
    rewards = torch.tensor([float(rng.random() > 0.5) for _ in range(n)])
    advantages = torch.tensor([rng.uniform(-1.5, 1.5) for _ in range(n)])
    return RolloutBatch(prompts, responses, logprobs, rewards, advantages, group_size=2)


class Group:
    """An ActorGroup on its own placement group, both released on exit."""

    def __init__(self, cfg: Config, model_path: str, ranks: int, pooled: bool = False):
        if not pooled:
            Pool.make_room_for(ranks)  # a group of a test's own may need the GPUs idle pooled groups hold
        self.placement: Placement = create_placement(ranks)
        self.group = ActorGroup(
            ActorSpec.from_config(cfg), model_path, self.placement, tuple(range(ranks)), cfg.cluster.colocate
        )

    def __enter__(self) -> ActorGroup:
        return self.group

    def __exit__(self, *exc: object) -> None:
        self.group.shutdown()
        self.placement.remove()


def engine_weights(client: Any, names: list[str]) -> dict[str, torch.Tensor]:
    # floats come back as JSON doubles, which hold float32 values exactly
    return {n: torch.tensor(client.get_weights_by_name(n, truncate_size=10**9), dtype=torch.float32) for n in names}


def sequence_k1_by_transformers(model_path: str, weights: dict[str, torch.Tensor], batch: RolloutBatch) -> list[float]:
    """sum over each sample's response tokens of log pi(token) - log ref(token), the policy
    ``weights`` in transformers' own model, the reference the initial model: plain per-sample
    forwards, no padding, no packing."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_path).eval()
    policy = AutoModelForCausalLM.from_pretrained(model_path).eval()
    policy.load_state_dict(weights, strict=False)
    out = []
    with torch.no_grad():
        for prompt, response in zip(batch.prompt_ids, batch.response_ids):
            ids = torch.tensor([prompt + response])
            positions = range(len(prompt) - 1, len(prompt) + len(response) - 1)  # those predicting the response

            def logprobs(model, ids=ids, positions=positions, response=response):
                lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
                return torch.tensor([lp[t, tok] for t, tok in zip(positions, response)])

            out.append(float((logprobs(policy) - logprobs(ref)).sum()))
    return out


# What a rank reads from its spec only while it trains (RankBase.train and its hooks); every other
# field (the optimizer's settings, LoRA, the reference model, the seed) shapes the rank at start.
TRAIN_TIME_ACTOR = (
    "micro_batch_size",
    "max_tokens_per_micro_batch",
    "sequence_packing",
    "num_steps_per_rollout",
    "grad_clip",
)


def _start_key(spec: ActorSpec, model_path: str, ranks: int) -> str:
    """What a started group is fixed to: its spec but for what is read only while training."""
    actor = {
        f.name: getattr(spec.actor, f.name) for f in dataclasses.fields(spec.actor) if f.name not in TRAIN_TIME_ACTOR
    }
    rest = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in ("actor", "algo")}
    return repr((model_path, ranks, spec.needs_reference, actor, rest))


class Pool:
    """Rank groups kept across a module's tests (a rank start costs more CPU than its training):
    ``with pool.group(cfg, model_path, ranks) as g`` gives a group in the state a fresh one with
    ``cfg`` starts in: its ranks take ``cfg``'s spec and load the checkpoint written right after
    their start (weights, an empty optimizer, each rank's RNG, step counts). Only groups whose
    start ``cfg`` does not change are reused; idle ones are let go when the GPUs are needed."""

    _idle: list[Pool] = []  # the open pools (one module's, at a time)
    GPUS = 4  # the ray_cluster fixture's

    def __init__(self) -> None:
        # start key -> (group, its start checkpoint, its reference model's fingerprints there)
        self.held: dict[str, tuple[Group, str, list[str | None]]] = {}
        self.starts = self.uses = 0  # groups started, and given out (what the pool saves: the difference)
        self._dir = tempfile.TemporaryDirectory(prefix="rlhpc-pool-")
        Pool._idle.append(self)

    @contextmanager
    def group(self, cfg: Config, model_path: str, ranks: int) -> Iterator[ActorGroup]:
        """Not nested: a group started meanwhile may let the one in use go."""
        spec = ActorSpec.from_config(cfg)
        key = _start_key(spec, model_path, ranks)
        held = self.held.pop(key, None)
        if held is not None:
            g, start, reference = held
            ray.get([w.__ray_call__.remote(_set_spec, spec) for w in g.group.workers])
            g.group.load(start)
            if g.group.reference_fingerprints() != reference:  # reset to the policy in its last use: a load keeps that
                g.__exit__()
                held = None
        if held is None:
            self._make_room(ranks)
            g, start = Group(cfg, model_path, ranks, pooled=True), f"{self._dir.name}/{self.starts}"
            self.starts += 1
            g.group.save(start)
            held = g, start, g.group.reference_fingerprints()
        self.uses += 1
        self.held[key] = held  # the last used last: the first let go
        try:
            yield held[0].group
        except BaseException:  # a failed test's group may be mid-collective: not given out again
            self.held.pop(key, None)
            held[0].__exit__()
            raise

    def _make_room(self, ranks: int) -> None:
        while self.held and sum(len(g.group.workers) for g, _, _ in self.held.values()) + ranks > self.GPUS:
            key = next(iter(self.held))
            self.held.pop(key)[0].__exit__()

    def release(self) -> None:
        while self.held:
            self.held.popitem()[1][0].__exit__()

    @classmethod
    def make_room_for(cls, ranks: int) -> None:
        for pool in cls._idle:
            pool._make_room(ranks)

    def close(self) -> None:
        log.info("rank group pool: %d groups started for %d uses", self.starts, self.uses)
        self.release()
        Pool._idle.remove(self)
        self._dir.cleanup()


def _set_spec(worker: Any, spec: ActorSpec) -> None:  # runs in the rank
    worker.spec = spec
