"""The CPU engine's sampler draws from the distribution SGLang would (temperature, top-p,
greedy), one reproducible stream per seed, whatever the batch around a row."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from rlhpc.engine_server.cpu.sampling import sample

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


# ---------------------------------------------------------------- top-k, min-p, repetition penalty (issue 31)
# The expected laws are worked out by hand from LOGITS: e^2 = 7.389056, e^1 = 2.718282,
# e^0.5 = 1.648721, e^0 = 1, e^-1 = 0.367879, e^-3 = 0.049787 (sum 13.173725).


def draw_shaped(n: int, new_tokens: int = 1, temperature: float = 1.0, top_p: float = 1.0, **knobs) -> list[list[int]]:
    out = sample(
        FixedLogits(),
        [[1, 2]] * n,
        [new_tokens] * n,
        [temperature] * n,
        [top_p] * n,
        list(range(n)),
        eos_id=-1,
        pad_id=0,
        **{k: [v] * n for k, v in knobs.items()},
    )
    return [s.output_ids for s in out]


def follows(got: torch.Tensor, expected: list[float], n: int) -> bool:
    want = torch.tensor(expected, dtype=torch.float64)
    tolerance = 4.5 * (want * (1 - want) / n).sqrt() + 1e-9  # as above: 4.5 standard errors a token
    return bool(((got - want).abs() <= tolerance).all())


def test_top_k_keeps_the_k_most_likely_and_renormalises() -> None:
    n = 20000
    # k = 2: e^2 / (e^2 + e^1) = 0.731059, e^1 / (e^2 + e^1) = 0.268941
    got = frequencies(draw_shaped(n, top_k=2))
    assert follows(got, [0.731059, 0.268941, 0, 0, 0, 0], n), got
    # k = 3 renormalises to 0.628533, 0.231224, 0.140244 before top-p = 0.8 (SGLang's order):
    # token 2 starts at 0.859757 > 0.8 and goes. Top-p over the unrenormalised probabilities
    # (0.560893, 0.206341: token 2 would start at 0.767235) would have kept it.
    got = frequencies(draw_shaped(n, top_p=0.8, top_k=3))
    assert follows(got, [0.731059, 0.268941, 0, 0, 0, 0], n), got
    # k = 1 is greedy, as in SGLang
    assert draw_shaped(3, new_tokens=2, top_k=1) == [[0, 0]] * 3


def test_min_p_drops_tokens_below_a_share_of_the_most_likely() -> None:
    n = 20000
    # probs 0.560893, 0.206341, 0.125152, 0.075909, ...; 0.2 x 0.560893 = 0.112179 keeps tokens 0-2,
    # renormalised: 7.389056 / 11.756059 = 0.628533, 2.718282 / 11.756059 = 0.231224, 0.140244
    got = frequencies(draw_shaped(n, min_p=0.2))
    assert follows(got, [0.628533, 0.231224, 0.140244, 0, 0, 0], n), got
    # temperature 0.5 (probs 0.8292, 0.1122, 0.0413, ...): 0.2 x 0.8292 = 0.1658 keeps token 0 only
    assert frequencies(draw_shaped(200, temperature=0.5, min_p=0.2))[0] == 1.0


def test_repetition_penalty_scales_the_logits_of_generated_tokens() -> None:
    from rlhpc.engine_server.cpu.sampling import penalize_repeats

    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, -3.0]])
    seen = torch.tensor([[True, True, False, True, False]])
    # seen: positive divided (2 / 2 = 1), negative multiplied (-1 x 2 = -2), 0 stays 0; unseen as they were
    got = penalize_repeats(logits, seen, torch.tensor([2.0]))
    assert got.tolist() == [[1.0, -2.0, 0.5, 0.0, -3.0]]
    # greedy with penalty 2.5 over LOGITS: 0; then token 0 at 2 / 2.5 = 0.8 < 1: token 1; then
    # token 1 at 1 / 2.5 = 0.4, token 0 (0.8) wins again, and stays (the penalty does not compound)
    assert draw_shaped(2, new_tokens=4, temperature=0.0, repetition_penalty=2.5) == [[0, 1, 0, 0]] * 2
    assert draw_shaped(2, new_tokens=4, temperature=0.0) == [[0, 0, 0, 0]] * 2
    # sampling: after a first token 0 the logits are [1, 1, 0.5, 0, -1, -3]: the second token
    # follows e^1, e^1, e^0.5, 1, e^-1, e^-3 over 8.502951: 0.319687, 0.319687, 0.1939, 0.117606, ...
    n = 20000
    rows = draw_shaped(n, new_tokens=2, repetition_penalty=2.0)
    second = [[r[1]] for r in rows if r[0] == 0]
    got = frequencies(second)
    assert follows(got, [0.319687, 0.319687, 0.1939, 0.117606, 0.043265, 0.005855], len(second)), got


def test_the_knobs_at_their_no_op_values_change_no_token() -> None:
    plain = draw_shaped(500, new_tokens=3)
    assert draw_shaped(500, new_tokens=3, top_k=-1, min_p=0.0, repetition_penalty=1.0) == plain
    assert draw_shaped(500, new_tokens=3, repetition_penalty=1.5) != plain  # the comparison can fail
