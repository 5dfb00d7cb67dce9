"""A reward plugin for tests: crashes once the file named by RLHPC_TEST_CRASH_FILE exists."""

import os


def reward(prompt: str, response: str, answer: str) -> float:
    if os.path.exists(os.environ["RLHPC_TEST_CRASH_FILE"]):
        raise RuntimeError("simulated crash after resume")
    return 1.0 if response.startswith(answer) else 0.0
