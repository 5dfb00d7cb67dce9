"""Rewards that hold a job still where a test SIGKILLs it (``kill_when``). A small local job runs
its eight rollouts in a quarter of a second, and a checkpoint that a later one replaces lives
about 0.15 s (measured): a poll on a loaded machine can miss it, and the job then ends before it
is killed. Each reward here scores as its namesake does and, while the path named by
``$RLHPC_TEST_HOLD_AT`` exists, waits before scoring: nothing after that point is generated,
trained or saved until the kill. Without the variable (the resumed run) it is its namesake.

A job names one as ``data.reward: support.hold:NAME`` (``tests/`` is on every test job's PYTHONPATH).
"""

import os
import time

from rlhpc.tasks import TASKS
from support.filters import length_parity as _length_parity

HOLD_ENV = "RLHPC_TEST_HOLD_AT"
_DIGIT_SUM = TASKS["digit_sum"].reward


def _hold() -> None:
    at = os.environ.get(HOLD_ENV)
    while at and os.path.exists(at):
        time.sleep(0.05)


def digit_sum(prompt: str, response: str, answer: str) -> float:
    _hold()
    return _DIGIT_SUM(prompt, response, answer)


def length_parity(prompt: str, response: str, answer: str) -> float:
    _hold()
    return _length_parity(prompt, response, answer)
