"""Graders for the process-pool tests (``data.reward_workers``), imported in each worker by spec."""

import os
import time


def slow_on_seven(sample) -> float:
    """Hangs on the sample whose label is 7 (a grader stuck on one input); exact otherwise."""
    if sample.label == "7":
        time.sleep(60)
    return float(sample.response == sample.label)


def pid(prompt: str, response: str, answer: str) -> dict:
    """The older form, saying which process scored it."""
    return {"score": float(response == answer), "pid": float(os.getpid())}


def raises(sample) -> float:
    """A grader with a bug: it raises on every sample."""
    return {"7": 1.0}[sample.label]  # KeyError on any other label
