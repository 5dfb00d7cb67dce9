"""Reward plugins for tests: the digit_sum task's reward, made slow on purpose (a slow verifier),
so that what a test waits for in a running Slurm job does not race the job's end.

- ``reward``: 0.1 s a sample (``$RLHPC_TEST_SLOW_SECONDS`` where set) in a job's first allocation
  only (the first ``$RLHPC_TEST_SLOW_ALLOCATIONS`` where that is set). A time limit is then sure
  to cut that allocation however fast the machine is, and the requeued ones (SLURM_RESTART_COUNT >= 1) run at the machine's own pace, so a slow
  machine still finishes in few allocations.

A job imports it as ``data.reward: support.slow_reward:reward`` with ``tests/`` on its PYTHONPATH
(``slow_allocations()``: the ``--set`` and the environment for ``reward``).
"""

import os
import time
from pathlib import Path

from rlhpc.data.tasks import TASKS

SECONDS_PER_SAMPLE = 0.1
ALLOCATIONS_ENV = "RLHPC_TEST_SLOW_ALLOCATIONS"
SECONDS_ENV = "RLHPC_TEST_SLOW_SECONDS"  # a sample, instead of SECONDS_PER_SAMPLE
DIGIT_SUM = TASKS["digit_sum"].reward
TESTS = Path(__file__).resolve().parents[1]


def slow_allocations(count: int = 1, seconds: float = SECONDS_PER_SAMPLE) -> tuple[list[str], dict[str, str]]:
    """``--set`` arguments and environment for ``submit_slurm``: a job whose first ``count``
    allocations score with ``reward`` at ``seconds`` a sample (its results digit_sum's)."""
    return ["--set", "data.reward=support.slow_reward:reward"], {
        "PYTHONPATH": f"{TESTS}:{os.environ.get('PYTHONPATH', '')}",
        ALLOCATIONS_ENV: str(count),
        SECONDS_ENV: str(seconds),
    }


def reward(prompt: str, response: str, answer: str) -> float:
    if int(os.environ.get("SLURM_RESTART_COUNT", "0")) < int(os.environ.get(ALLOCATIONS_ENV, "1")):
        time.sleep(float(os.environ.get(SECONDS_ENV, SECONDS_PER_SAMPLE)))
    return DIGIT_SUM(prompt, response, answer)
