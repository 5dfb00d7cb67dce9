"""A reward plugin for tests: the task's own reward, after a sleep per sample in a Slurm job's
first allocation only. A time limit is then sure to cut that allocation however fast the machine
is, and the requeued ones (SLURM_RESTART_COUNT >= 1) run at the machine's own pace, so a slow
machine still finishes in few allocations."""

import os
import time

SECONDS_PER_SAMPLE = 0.1


def reward(prompt: str, response: str, answer: str) -> float:
    if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        time.sleep(SECONDS_PER_SAMPLE)
    return 1.0 if response.startswith(answer) else 0.0
