"""What the driver sends to the engine pool, and how a send ends early: the request and abort types
shared by the pool and everything that generates through it, the ``Send`` they go out by, and the
per-sample seed and sampling knobs a request carries."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

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
    # A vision-language model's images, a list per prompt (data URIs; an empty list: a prompt
    # without images); None: no prompt has any.
    image_data: list[list[str]] | None = None
    # A MoE model's routing of every token (R3, algo.routing_replay): meta_info["routed_experts"]
    return_routed_experts: bool = False


class GenerationAborted(Exception):
    """Generation was cut short for a stop request (preemption or time limit)."""


class Send(Protocol):
    """Send every request; call ``done(c, answer)`` (in the caller's thread) once, as request c's
    answer arrives; return the answers (SGLang's /generate output dicts) in request order."""

    def __call__(self, requests: Sequence[Request], done: Callable[[int, list[dict]], None]) -> list[list[dict]]: ...


def sample_seed(*parts: object) -> int:
    """A stable per-sample seed: same run seed, rollout and sample -> same tokens on rerun."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits, as SGLang's sampling_seed takes


def knob_params(top_k: int, min_p: float, repetition_penalty: float, stop: Sequence[str]) -> dict[str, Any]:
    """SGLang's sampling params for the knobs set away from their no-op defaults (SGLang's own):
    with the defaults a request is exactly what it was before these knobs existed."""
    out: dict[str, Any] = {}
    if top_k != -1:
        out["top_k"] = top_k
    if min_p != 0:
        out["min_p"] = min_p
    if repetition_penalty != 1:
        out["repetition_penalty"] = repetition_penalty
    if stop:
        out["stop"] = list(stop)
    return out


class StopCheck(Protocol):
    """When a send drops the generation in flight (``GenerationAborted``), polled as answers come
    in: the job's stop request, or the async schedule's ``abort`` (what a stop may drop)."""

    @property
    def requested(self) -> bool: ...


class EnginesDown(RlhpcError):
    """No engine can serve generation until the dead ones are restarted, which only the thread
    that pushes weights may do (between rollouts, when the actor holds the engines' version)."""

    transient = True  # if it ends the job, a resume from the last checkpoint loses nothing

    def __init__(self, dead: list[int], version: int | None = None):
        with_version = f" with weight version {version}" if version is not None else ""
        super().__init__(
            f"rollout engine(s) {dead} died while a rollout was generated{with_version}, "
            "and no engine is left to finish it",
            "nothing to do: they are restarted between rollouts (rollout.max_engine_restarts bounds it)",
        )
        self.dead, self.version = dead, version
