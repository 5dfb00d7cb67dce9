"""What the engine pool calls to put trained weights on its engines: the actor group implements it."""

from __future__ import annotations

from typing import Protocol


class WeightSource(Protocol):
    """What pushes trained weights to the engines (``rlhpc.actor.group.ActorGroup``)."""

    def connect_rollout(
        self, engine_urls: list[str], engine_world_sizes: list[int], colocate: bool, key_file: str | None = None
    ) -> None: ...

    def update_weights(self, version: int) -> None: ...
