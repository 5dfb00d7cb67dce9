"""Versions of the ``guess`` task's environment that make something happen between two turns of
a job's episodes, at a point the test chose: the environment runs in the driver, between the
engine's reply and the next turn's requests, so that is exactly "in the middle of an episode".
Each is the ``guess`` environment otherwise, and does nothing without its variable."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

from rlhpc.metrics import read_metrics
from rlhpc.tasks.guess import GuessEnv

KILL_ENGINE_ENV = "RLHPC_TEST_KILL_ENGINE_LOG"  # an engine's log: its server is SIGKILLed once
WAIT_PUSH_ENV = "RLHPC_TEST_WAIT_PUSH_RUN"  # a run dir: episodes wait for the next push after turn 0
EPISODES_PER_ROLLOUT = 8 * 4  # rollout_batch_size x n_samples_per_prompt of tests' small jobs


def logged_rollouts(run: Path) -> set[int]:
    return {m["rollout_id"] for m in read_metrics(run) if m["kind"] == "rollout"}


class EngineKillingGuess(GuessEnv):
    """SIGKILLs the engine server whose log ``$RLHPC_TEST_KILL_ENGINE_LOG`` names, once: after
    the first reply of the first episode that goes on, once rollout 0 was logged (trained, the
    engines on version 1). Episodes are stepped in order, so that is one of the first (engine
    0's, the first request's): its next turn, and its neighbours', go to a dead engine.
    ``<log>.killed`` records the pid."""

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        observation, reward, done = super().step(reply)
        log = os.environ.get(KILL_ENGINE_ENV)
        if log and not done and self.replies == 1 and logged_rollouts(Path(log).parents[2]):
            try:
                marker = os.open(f"{log}.killed", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return observation, reward, done
            pid = int(re.findall(r"cpu_server\[(\d+)\]", Path(log).read_text())[-1])
            os.kill(pid, signal.SIGKILL)
            os.write(marker, f"{pid}\n".encode())
            os.close(marker)
        return observation, reward, done


class PushWaitingGuess(GuessEnv):
    """In rollout r >= 1, each episode's first step waits until the driver logged rollout r - 1,
    which it does after pushing version r: with partial rollouts (the push does not wait for the
    rollout in flight) a push lands between turn 0 and turn 1 of every episode still running.
    The rollout is counted from the resets (every rollout starts its episodes at once)."""

    resets = 0

    def reset(self, row: dict) -> list[dict]:
        self.rollout = PushWaitingGuess.resets // EPISODES_PER_ROLLOUT
        PushWaitingGuess.resets += 1
        return super().reset(row)

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        run = os.environ.get(WAIT_PUSH_ENV)
        if run and self.rollout >= 1 and self.replies == 0:
            deadline = time.monotonic() + 120
            while self.rollout - 1 not in logged_rollouts(Path(run)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rollout {self.rollout - 1} was not logged within 120 s")
                time.sleep(0.05)
        return super().step(reply)
