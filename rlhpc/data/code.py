"""The built-in coding task ``code``: complete a Python expression in ``x`` so that it passes the
row's asserts, run in the sandbox (``rlhpc.sandbox``), small enough for the tiny model on CPU.

A prompt shows a function's values at 0 and 1 and begins its expression: ``0:5;1:6;x:x`` for
``f(x) = x + 5``. The model writes the rest (``+5``: two tokens, ``rollout.max_new_tokens: 2``),
which becomes ``f = lambda x: (x +5)``, and the row's label holds the tests, as a code dataset's
unit tests would: ``f`` is positive at 0, and its values at 0, 1, 2, 3 (a JSON list of five
asserts, a form of ``rlhpc.sandbox.testing``). The reward is the share that pass: ``x`` alone
earns nothing, ``x+d`` with the wrong digit 1/5, the right one all of it, anything that does not
run nothing.
Every answer runs in the sandbox, as a code RL job's do; a sandbox that could not run leaves
its sample unscored.
"""

from __future__ import annotations

import json
import random

from rlhpc import sandbox
from rlhpc.errors import InfrastructureFailure
from rlhpc.sandbox.testing import judge_all, parse_tests

XS = (0, 1, 2, 3)


def make(count: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(count):
        c = rng.randint(1, 9)
        tests = ["assert f(0) > 0", *(f"assert f({x}) == {x + c}" for x in XS)]
        rows.append({"prompt": f"0:{c};1:{1 + c};x:x", "answer": json.dumps(tests), "solution": f"+{c}"})
    return rows


def program(response: str) -> str:
    """The answer as the function the asserts call: the prompt's ``x``, then the answer."""
    return f"f = lambda x: (x {response.strip()})\n"


def reward(samples: list) -> list[float | InfrastructureFailure]:
    """The share of the row's asserts the answer passes; all of the rollout's answers run through
    the sandbox pool at once."""
    verdicts = judge_all(
        sandbox.pool(), [program(s.response) for s in samples], [parse_tests(s.label) for s in samples]
    )
    return [v if isinstance(v, InfrastructureFailure) else v.fraction for v in verdicts]


# Scores a whole rollout in one call (rlhpc.rollout.scoring.batched, which this floor cannot import).
reward.rlhpc_batched = True  # type: ignore[attr-defined]
