"""What the driver sends to the engine pool, and how a send ends early: the request and abort types
shared by the pool and everything that generates through it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from rlhpc.errors import RlhpcError


@dataclass(frozen=True)
class Request:
    """One /generate call: a batch of prompts (token ids), one sampling-params dict each."""

    input_ids: list[list[int]]
    sampling_params: list[dict]
    return_logprob: bool = True
    # The engine slot it goes to (engine ``affinity`` mod the engine count) instead of its index
    # in the send: an episode's turns keep to one engine, which holds their prefix in its cache.
    affinity: int | None = None


class GenerationAborted(Exception):
    """Generation was cut short for a stop request (preemption or time limit)."""


class StopCheck(Protocol):
    """When a send drops the generation in flight (``GenerationAborted``), polled as answers come
    in: the job's stop request, or the async schedule's ``abort`` (what a stop may drop)."""

    @property
    def requested(self) -> bool: ...


class EnginesDown(RlhpcError):
    """No engine can serve generation until the dead ones are restarted, which only the thread
    that pushes weights may do (between rollouts, when the actor holds the engines' version)."""

    transient = True  # if it ends the job, a resume from the last checkpoint loses nothing

    def __init__(self, dead: list[int], version: int | None):
        super().__init__(
            f"rollout engine(s) {dead} died while a rollout was generated with weight version {version}, "
            "and no engine is left to finish it",
            "nothing to do: they are restarted between rollouts (rollout.max_engine_restarts bounds it)",
        )
        self.dead, self.version = dead, version
