"""Dynamic sampling: which prompt groups a rollout trains on, and which are dropped for more.

A group is one prompt's ``n_samples_per_prompt`` samples. A filter (``rollout.dynamic_sampling.filter``)
says whether a group is kept: the built-in ``nonzero_std`` drops groups whose rewards all agree,
since their advantages are all zero and they give no gradient. ``rlhpc.rollout.generation``
generates rounds of prompts until a batch of kept groups is full; the extra prompts come from
``DataBuffer.extra_rows``, a pure function of (seed, rollout id, round).

This module imports no torch: the config check resolves filters on the login node.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rlhpc.util.imports import import_function


@dataclass(frozen=True)
class Group:
    """One prompt's samples, scored: what a filter sees."""

    prompt: str
    answer: str
    responses: list[str]
    rewards: list[float]


GroupFilter = Callable[[Group], bool]  # True: train on the group


def nonzero_std(group: Group) -> bool:
    """Keep groups whose rewards are not all equal (equal rewards: zero advantage, no gradient)."""
    return max(group.rewards) != min(group.rewards)


BUILTIN_FILTERS: dict[str, GroupFilter] = {"nonzero_std": nonzero_std}


def resolve_filter(spec: str) -> GroupFilter:
    """A built-in filter's name or ``"package.module:function"``; errors name the spec and the fix."""
    if spec in BUILTIN_FILTERS:
        return BUILTIN_FILTERS[spec]
    key = "rollout.dynamic_sampling.filter"
    return import_function(
        key,
        spec,
        "keep(group: rlhpc.data.dynamic_sampling.Group) -> bool",
        not_a_spec=f"{key} = {spec!r} is neither a built-in filter ({', '.join(BUILTIN_FILTERS)}) nor 'module:function'",
    )
