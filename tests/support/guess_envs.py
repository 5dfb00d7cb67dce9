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

from rlhpc.data.guess import GuessEnv
from rlhpc.metrics import read_metrics

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


HOLD_FOR_STOP_ENV = "RLHPC_TEST_HOLD_FOR_STOP"  # a path: once it exists, episodes hold once at <path>.held


class HeldForStop(GuessEnv):
    """In a Slurm job's first allocation, once the path ``$RLHPC_TEST_HOLD_FOR_STOP`` exists, the
    next episode's step after its first reply writes ``<path>.held`` (``rollout R``) and holds
    while that exists, once: the test sends the stop there and then removes it, so the stop
    comes between two turns of rollout R's episodes. A requeued allocation (SLURM_RESTART_COUNT
    >= 1, the same environment) replays them as the guess environment, held nowhere."""

    resets = 0
    held = False  # in this process: the steps after the release go on to the stop

    def reset(self, row: dict) -> list[dict]:
        self.rollout = HeldForStop.resets // EPISODES_PER_ROLLOUT  # the first allocation starts at 0
        HeldForStop.resets += 1
        return super().reset(row)

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        at = os.environ.get(HOLD_FOR_STOP_ENV)
        first = int(os.environ.get("SLURM_RESTART_COUNT", "0")) == 0
        if at and first and not HeldForStop.held and self.replies == 0 and os.path.exists(at):
            HeldForStop.held = True
            held = Path(f"{at}.held")
            held.write_text(f"rollout {self.rollout}\n")
            while held.exists():
                time.sleep(0.05)
        return super().step(reply)
