"""Built-in rewards for a user's own data, named as ``data.reward: rlhpc.rewards:NAME``.

- ``exact``: 1.0 when the response, stripped, is the label, stripped.
- ``math``: 1.0 when the response's final answer equals the label as mathematics, by the
  ``math-verify`` library (what verl and NeMo-RL grade math with): ``\\boxed{}`` answers, LaTeX,
  fractions, decimals and plain numbers. The label is parsed as a boxed answer.

Each is ``reward(prompt, response, answer) -> float`` like any reward a user writes.
``batched`` marks a reward of a whole list of samples (``rlhpc.rollout.scoring``).
"""

from __future__ import annotations

import threading

from rlhpc.rollout.scoring import batched  # noqa: F401 (re-exported: @rlhpc.rewards.batched)

PARSE_TIMEOUT_S = 5  # math-verify's own limit a parse or comparison may take


def exact(prompt: str, response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


def math(prompt: str, response: str, answer: str) -> float:
    from math_verify import parse, verify  # late: sympy is a second of start-up

    # math-verify times out with signal.alarm, which only the main thread may set; elsewhere
    # (a reward scored beside training) a parse runs without its limit.
    limit = PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=limit)
    if not gold:
        return 0.0
    given = parse(response, parsing_timeout=limit)
    return 1.0 if given and verify(gold, given, timeout_seconds=limit) else 0.0
