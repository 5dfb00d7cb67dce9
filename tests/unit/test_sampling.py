"""The CPU engine's sampler draws from the distribution SGLang would (temperature, top-p,
greedy), one reproducible stream per seed, whatever the batch around a row."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from rlhpc.rollout.sampling import sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])  # next-token logits, whatever the prefix


class FixedLogits(torch.nn.Module):
    """A "model" whose next-token distribution is known exactly; its cache counts the steps."""

    def __init__(self) -> None:
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # sample() reads the device from a parameter

    def forward(self, input_ids, attention_mask, position_ids, use_cache, past_key_values=None):
        steps = (past_key_values or 0) + 1
        logits = LOGITS.expand(input_ids.shape[0], input_ids.shape[1], -1)
        return CausalLMOutputWithPast(logits=logits, past_key_values=steps)


def draw(n: int, temperature: float, top_p: float, seed0: int = 0, new_tokens: int = 1) -> list[list[int]]:
    out = sample(
        FixedLogits(),
        [[1, 2]] * n,
        [new_tokens] * n,
        [temperature] * n,
        [top_p] * n,
        list(range(seed0, seed0 + n)),
        eos_id=-1,
        pad_id=0,
    )
    return [s.output_ids for s in out]


def frequencies(tokens: list[list[int]]) -> torch.Tensor:
    flat = torch.tensor([t for row in tokens for t in row])
    return torch.bincount(flat, minlength=len(LOGITS)).double() / len(flat)


def test_temperature_sampling_follows_the_softmax() -> None:
    n = 20000
    for temperature in (1.0, 0.5):
        expected = torch.softmax(LOGITS.double() / temperature, -1)
        got = frequencies(draw(n, temperature, 1.0))
        # 4.5 standard errors per token: a wrong law fails, a right one passes ~always
        tolerance = 4.5 * (expected * (1 - expected) / n).sqrt() + 1e-9
        assert ((got - expected).abs() <= tolerance).all(), (temperature, got, expected)


def test_top_p_keeps_the_smallest_head_and_renormalises() -> None:
    probs = torch.softmax(LOGITS.double(), -1)  # 0.57, 0.21, 0.13, 0.08, ...
    got = frequencies(draw(20000, 1.0, 0.7))
    # tokens 0 and 1 reach 0.78 >= 0.7; token 2 starts past 0.7 and is dropped
    head = probs[:2] / probs[:2].sum()
    assert (got[2:] == 0).all(), got
    assert ((got[:2] - head).abs() < 0.02).all(), (got, head)


def test_greedy_and_seeds() -> None:
    assert draw(50, 0.0, 1.0) == [[0]] * 50
    a = draw(8, 1.0, 1.0, seed0=100, new_tokens=5)
    b = draw(8, 1.0, 1.0, seed0=100, new_tokens=5)
    assert a == b  # a seed is a stream
    # a row's tokens depend on its own seed only: the same seed alone gives the same row
    assert draw(1, 1.0, 1.0, seed0=103, new_tokens=5)[0] == a[3]
    assert len({tuple(r) for r in a}) > 1
