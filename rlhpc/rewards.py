"""Built-in rewards for a user's own data, named as ``data.reward: rlhpc.rewards:NAME``.

- ``exact``: 1.0 when the response, stripped, is the label, stripped.
- ``gsm8k``: GSM8K's own answer form, strictly: 1.0 when the response's last ``#### N`` is the
  label as a number (commas and a ``$`` ignored); a response without ``#### N`` scores 0.
- ``math``: 1.0 when the response's final answer, marked as ``\\boxed{...}`` (the last one),
  equals the label as mathematics, by the ``math-verify`` library (what verl and NeMo-RL grade
  math with): LaTeX, fractions, decimals and plain numbers. A response without ``\\boxed{}``
  scores 0: an unmarked number anywhere in the text is not an answer.
- ``math_lenient``: ``math`` without the mark: math-verify's own choice of the response's final
  answer (the last number or LaTeX expression anywhere in it). Random text often ends in a
  number, so an untrained model scores above 0 on noise; ``math`` did this before it required
  ``\\boxed{}``.

- ``code``: the response's code (its last fenced code block, else all of it) run against the
  row's tests in the sandbox (``rlhpc.sandbox``; the tests' forms: ``rlhpc.sandbox.testing``):
  1.0 when every test passes, the share passed logged as ``reward/passed``. A sample whose
  sandbox could not run (``InfrastructureFailure``) is left unscored and masked, never 0.

Each but ``code`` is ``reward(prompt, response, answer) -> float`` like any reward a user
writes; ``code`` scores the whole batch at once (every execution through the sandbox pool).
``batched`` marks a reward of a whole list of samples (``rlhpc.rollout.scoring``).
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal, InvalidOperation

from rlhpc import sandbox
from rlhpc.errors import InfrastructureFailure
from rlhpc.rollout.scoring import Sample, batched
from rlhpc.sandbox.testing import extract_code, judge_all, parse_tests

PARSE_TIMEOUT_S = 5  # math-verify's own limit a parse or comparison may take
_GSM8K_ANSWER = re.compile(r"####\s*(-?[$0-9.,]+)")


def exact(prompt: str, response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


def gsm8k(prompt: str, response: str, answer: str) -> float:
    found = _GSM8K_ANSWER.findall(response)
    if not found:
        return 0.0
    given, gold = _number(found[-1]), _number(answer)
    if given is None or gold is None:
        return 1.0 if found[-1].replace(",", "").replace("$", "") == answer.strip() else 0.0
    return 1.0 if given == gold else 0.0


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except InvalidOperation:
        return None


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced;
    None if there is none (or it is never closed)."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None


def math(prompt: str, response: str, answer: str) -> float:
    boxed = last_boxed(response)
    if boxed is None:
        return 0.0
    return _verify(answer, f"\\boxed{{{boxed}}}")


def math_lenient(prompt: str, response: str, answer: str) -> float:
    return _verify(answer, response)


def _verify(answer: str, response: str) -> float:
    from math_verify import parse, verify  # late: sympy is a second of start-up

    # math-verify times out with signal.alarm, which only the main thread may set; elsewhere
    # (a reward scored beside training) a parse runs without its limit.
    limit = PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{answer}}}", parsing_timeout=limit)
    if not gold:
        return 0.0
    given = parse(response, parsing_timeout=limit)
    return 1.0 if given and verify(gold, given, timeout_seconds=limit) else 0.0


@batched
def code(samples: list[Sample]) -> list[dict | InfrastructureFailure]:
    tests = []
    for s in samples:
        try:
            tests.append(parse_tests(s.label))
        except ValueError as e:
            raise ValueError(f"{e} (data.label_key points at the row's tests)") from None
    verdicts = judge_all(sandbox.pool(), [extract_code(s.response) for s in samples], tests)
    return [
        v if isinstance(v, InfrastructureFailure) else {"score": float(v.passed == v.total), "passed": v.fraction}
        for v in verdicts
    ]
