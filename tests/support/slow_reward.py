"""A reward plugin for tests: the task's own reward, after a fixed sleep per sample, so a rollout
takes at least that long on any machine (a test that needs a run longer than one allocation)."""

import time

SECONDS_PER_SAMPLE = 0.02


def reward(prompt: str, response: str, answer: str) -> float:
    time.sleep(SECONDS_PER_SAMPLE)
    return 1.0 if response.startswith(answer) else 0.0
