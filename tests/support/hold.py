"""Rewards that hold a job still where a test SIGKILLs it (``kill_when``). A small local job runs
its eight rollouts in a quarter of a second, and a checkpoint that a later one replaces lives
about 0.15 s (measured): a poll on a loaded machine can miss it, and the job then ends before it
is killed. Each reward here scores as its namesake does and, while the path named by
``$RLHPC_TEST_HOLD_AT`` exists, waits before scoring: nothing after that point is generated,
trained or saved until the kill. Without the variable (the resumed run) it is its namesake.
``GuessEnv`` holds a multi-turn job the same way, between two turns of its episodes, and the
tool ``now`` (a clock outside the job) in the middle of a turn's tool calls.

``$RLHPC_TEST_GATE`` (``support.jobs.Gate``) holds a job where a test must act on it while it
runs (stop a rank, send a signal): while the gate file exists and the condition it names holds
(a path exists, or holds a text: a metrics line), each reward waits, and ``<gate>.held`` says
that the job is held; the test removes the gate to let it go on.

A job names one as ``data.reward: support.hold:NAME``, the environment as ``rollout.env:
support.hold:GuessEnv``, the tool as ``rollout.tools: [support.hold:now]`` with ``rollout.tool_parser:
support.hold:clock_calls`` (``tests/`` is on every test job's PYTHONPATH).
"""

import json
import os
import re
import time
from pathlib import Path

from rlhpc.data.guess import GuessEnv as _GuessEnv
from rlhpc.data.tasks import TASKS
from rlhpc.rollout.tools import current_call
from rlhpc.wire.tool_calls import ParsedCall
from support.filters import length_parity as _length_parity
from support.guess_envs import EngineKillingGuess

HOLD_ENV = "RLHPC_TEST_HOLD_AT"
GATE_ENV = "RLHPC_TEST_GATE"
_DIGIT_SUM = TASKS["digit_sum"].reward


def _gate_shut(gate: str) -> str | None:
    """The gate's text while it holds, else None."""
    try:
        text = Path(gate).read_text()
        when = json.loads(text)
        path, contains = when["path"], when["contains"]
        shut = os.path.exists(path) if contains is None else contains in Path(path).read_text()
    except (OSError, ValueError):  # no gate (opened), or its condition's file not there yet
        return None
    return text if shut else None


def _hold() -> None:
    at = os.environ.get(HOLD_ENV)
    while at and os.path.exists(at):
        time.sleep(0.05)
    gate = os.environ.get(GATE_ENV)
    while gate and (shut := _gate_shut(gate)) is not None:
        Path(gate + ".held").write_text(shut)  # held by this very condition (a test may change it)
        time.sleep(0.05)


def digit_sum(prompt: str, response: str, answer: str) -> float:
    _hold()
    return _DIGIT_SUM(prompt, response, answer)


def squares(prompt: str, response: str, answer: str) -> float:
    _hold()
    return TASKS["squares"].reward(prompt, response, answer)


def length_parity(prompt: str, response: str, answer: str) -> float:
    _hold()
    return _length_parity(prompt, response, answer)


MID_EPISODE = ".mid-episode"


class GuessEnv(_GuessEnv):
    """The ``guess`` task's environment, held between two turns of its episodes: with
    ``kill_when(args, Path(f"{P}{MID_EPISODE}"))`` the first step after ``P`` exists creates the
    held path (which the kill waits for) and holds, so the kill lands in the middle of episodes."""

    held_from = 0  # the first of an episode's steps (counted from 0) that holds

    def step(self, reply: str) -> tuple[list[dict], float, bool]:
        at = os.environ.get(HOLD_ENV)
        if self.replies >= self.held_from:
            if at and at.endswith(MID_EPISODE) and os.path.exists(at.removesuffix(MID_EPISODE)):
                with open(at, "a") as f:
                    f.write(f"held after reply {self.replies + 1}\n")
            _hold()
        return super().step(reply)


class HeldThenEngineKilling(EngineKillingGuess, GuessEnv):
    """Both, each while its variable is set: a run held (and SIGKILLed) between two turns in its
    first start loses an engine between two turns in its resumed one
    (support.guess_envs.KILL_ENGINE_ENV), with the same config at both starts. Held only at an
    episode's second step or later: with tools (``now``), the turns before it, and their tool
    calls, are done, and their answers in the tool journal."""

    held_from = 1


CLOCK_ENV = "RLHPC_TEST_CLOCK"  # a directory: the clocks of ``now``, outside the job


def clock_calls(reply: str) -> list[ParsedCall]:
    """The tool parser of runs with ``now``: a reply without a digit reads the clock (the guess
    environment answers a reply with one)."""
    return [] if re.search(r"\d", reply) else [ParsedCall("now", {})]


def now() -> str:
    """Clock."""
    # The time on a clock outside the job, one per episode (its file in $RLHPC_TEST_CLOCK, named
    # by the episode's seed), that ticks at every reading: what a tool reading the world sees.
    # A call made again (a cut episode replayed without the tool journal) reads a later time, as
    # a real clock would: the episode, and the run, then go elsewhere.
    clock = Path(os.environ[CLOCK_ENV]) / str(current_call().episode_seed)
    tick = int(clock.read_text()) + 1 if clock.exists() else 1
    clock.write_text(str(tick))
    return f"t{tick}"
