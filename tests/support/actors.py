"""Actor groups for tests: a batch of uneven lengths, a group on its own placement, engine weights."""

from __future__ import annotations

import random
from typing import Any

import torch

from rlhpc.actor.group import ActorGroup, ActorSpec
from rlhpc.batch import RolloutBatch
from rlhpc.cluster.placement import Placement, create_placement
from rlhpc.config import Config


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

    def __init__(self, cfg: Config, model_path: str, ranks: int):
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
