"""What the driver sends to the engine pool, and how a send ends early: the request and abort types
shared by the pool and everything that generates through it."""

from __future__ import annotations

from dataclasses import dataclass


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
