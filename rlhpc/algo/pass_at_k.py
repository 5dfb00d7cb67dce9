"""pass@k and maj@n of an evaluation, from each prompt's n scored samples.

pass@k is the unbiased estimator of Chen et al. (2021, the Codex paper): with c of n samples
passing, ``1 - C(n - c, k) / C(n, k)`` — the chance that k samples drawn without replacement
from the n include a pass — averaged over prompts, for k = 1, 2, 4, ... up to n. maj@n scores
the most common response of each prompt (by its stripped text; ties go to the earliest).
A sample passes when its reward is at least ``threshold`` (1.0: a right answer).
"""

from __future__ import annotations

from collections import Counter
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    out = [1 << i for i in range(n.bit_length()) if 1 << i <= n]
    return out if out[-1] == n else [*out, n]


def pass_metrics(rewards: list[float], responses: list[str], n: int, threshold: float = 1.0) -> dict[str, float]:
    """``pass@k`` for each k of ``ks(n)`` and ``maj@n`` over groups of ``n`` adjacent samples."""
    groups = [range(g, g + n) for g in range(0, len(rewards), n)]
    out = {}
    for k in ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, sum(rewards[i] >= threshold for i in g), k) for g in groups) / len(groups)
    if n > 1:
        majority = 0
        for g in groups:
            counts = Counter(responses[i].strip() for i in g)
            top = max(counts.values())
            first = next(i for i in g if counts[responses[i].strip()] == top)
            majority += rewards[first] >= threshold
        out[f"maj@{n}"] = majority / len(groups)
    return out
