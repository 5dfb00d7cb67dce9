"""A reward that can be slowed down while a job runs: while the file named by
``$RLHPC_TEST_SLOW`` exists, each call takes 10 ms more (a slow verifier: about 5 s a rollout of
512 samples), then scores like the digit_sum task. A test slows the run down while it changes
the cluster under it, so that what it waits for does not race the run's end. The job imports it
as ``data.reward: support.slow_reward:digit_sum`` with ``tests/`` on its PYTHONPATH."""

from __future__ import annotations

import os
import time
from pathlib import Path

from rlhpc.tasks import TASKS

SLOW_ENV = "RLHPC_TEST_SLOW"


def digit_sum(prompt: str, response: str, answer: str) -> float:
    slow = os.environ.get(SLOW_ENV)
    if slow and Path(slow).exists():
        time.sleep(0.01)
    return TASKS["digit_sum"].reward(prompt, response, answer)
