"""A reward as a user moving from verl writes it: one ``Sample``, the row's own column read, a
dict returned (``data.reward: support.rewards:graded``)."""

import json
import os
from pathlib import Path

from rlhpc.rewards import exact

SCORED_ENV = "RLHPC_TEST_SCORED"  # a file: each sample these rewards score, one JSON line, appended


def record(sample, score: float) -> None:
    """Note what was scored where ``SCORED_ENV`` says (a test works metrics out from it)."""
    if path := os.environ.get(SCORED_ENV):
        line = {"prompt": sample.prompt, "response": sample.response, "score": score, "metadata": sample.metadata}
        with open(path, "a") as f:  # one short write: lines of concurrent scorers do not mix
            f.write(json.dumps(line, default=str) + "\n")


def scored(path: Path, **metadata: str) -> list[dict]:
    """The samples ``record`` noted in ``path`` whose metadata has these values, in scoring order."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in rows if all(r["metadata"].get(k) == v for k, v in metadata.items())]


def graded(sample) -> dict:
    record(sample, exact(sample.prompt, sample.response, sample.label))
    return {
        "score": exact(sample.prompt, sample.response, sample.label),
        "from_metadata": float(sample.row.get("data_source") == "toy"),  # the row's own column
        "chat": float(sample.messages is not None and sample.messages[0]["role"] == "user"),
        "stopped": float(sample.finish_reason in ("stop", "length")),
    }


def odd_or_even(sample) -> float:
    """1.0 for a response whose characters' codes sum to an even number: about half of the
    samples of an untrained model pass, so pass@k has something to count (recorded)."""
    score = float(sum(map(ord, sample.response)) % 2 == 0)
    record(sample, score)
    return score


def spread(prompt: str, response: str, answer: str) -> float:
    """A reward that differs between almost any two responses, so every group has advantages:
    for checks of the loss itself, which a group of equal rewards leaves at zero."""
    return sum(map(ord, response)) % 11 / 10


def pass_at_k_by_hand(samples: list[dict], n: int) -> tuple[dict[str, float], tuple[float, float]]:
    """One evaluation's pass@k from its scored samples (``record``'s, ``n`` per prompt), each the
    share of the k-subsets of a prompt's samples that hold a pass, averaged over prompts; and the
    range maj@n must lie in (where a prompt's top answers tie, which sample came first decides,
    and the order of scoring is not the order of the samples)."""
    from collections import Counter, defaultdict
    from itertools import combinations

    by_prompt: dict[str, list[dict]] = defaultdict(list)
    for s in samples:
        by_prompt[s["prompt"]].append(s)
    assert all(len(g) == n for g in by_prompt.values()), {p: len(g) for p, g in by_prompt.items()}
    out = {}
    for k in sorted({1 << i for i in range(n.bit_length()) if 1 << i <= n} | {n}):
        shares = []
        for group in by_prompt.values():
            subsets = list(combinations([s["score"] >= 1.0 for s in group], k))
            shares.append(sum(any(c) for c in subsets) / len(subsets))
        out[f"pass@{k}"] = sum(shares) / len(shares)
    low = high = 0
    for group in by_prompt.values():
        counts = Counter(s["response"].strip() for s in group)
        top = max(counts.values())
        outcomes = {s["score"] >= 1.0 for s in group if counts[s["response"].strip()] == top}
        low, high = low + min(outcomes), high + max(outcomes)
    return out, (low / len(by_prompt), high / len(by_prompt))


_scored = 0  # samples ``parity_then_raise`` scored in this process


def parity(prompt: str, response: str, answer: str) -> float:
    """1.0 for a response whose characters' codes sum to an even number: about half of an
    untrained model's samples pass, so a rollout's advantages are not all zero and it trains."""
    return float(sum(map(ord, response)) % 2 == 0)


def parity_then_raise(prompt: str, response: str, answer: str) -> float:
    """``parity`` for the first 32 samples (rollout 0 of a job with 8 prompts x 4 samples), then
    a user's bug: every later call raises."""
    global _scored
    _scored += 1
    if _scored > 32:
        raise RuntimeError("a user's reward failing after rollout 0")
    return parity(prompt, response, answer)
