"""The trained engines' weight channel: opened from the weight source (the actor) to every
engine, pushed through, and opened again (with the current version pushed) when an engine came
back or was lost. Frozen engines (reward model, teacher) have none."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from rlhpc.errors import RlhpcError, WeightPushFailed

if TYPE_CHECKING:
    from rlhpc.rollout.engines.engine_set import EngineSet
    from rlhpc.rollout.engines.health import Health
    from rlhpc.weights.source import WeightSource

log = logging.getLogger(__name__)


class WeightChannel:
    """The weights of ``engines``, kept on the source's current version through ``health``'s restarts."""

    def __init__(self, engines: EngineSet, health: Health):
        self.engines, self.health = engines, health
        self.source: WeightSource | None = None

    def connect(self, source: WeightSource) -> None:
        """Open the weight-sync channel from ``source`` (the actor) to every engine; ``source`` is
        also how a restarted engine gets the current weights back."""
        s, lost = self.engines, self.health.lost
        self.source = source
        live = [e for e in range(len(s.clients)) if e not in lost]  # a lost engine cannot join the group
        source.connect_rollout(
            [s.clients[e].base_url for e in live],
            [s.engine_world_sizes[e] for e in live],
            s.cluster_cfg.colocate,
            str(s.key_file),
        )
        self.health.changed = False

    def push_ready(self) -> bool:
        """Whether ``sync`` would go straight to the push (no engine to restart or start again, no
        channel to reopen): then the source may push ahead of it, with training."""
        return self.source is not None and self.health.all_well()

    def sync(self, version: int) -> None:
        """Push the source's current weights to every engine as ``version`` (restarting those known to
        be down first; one that died unnoticed fails the push, which restarts it and pushes again)."""
        if self.source is None:
            raise RlhpcError(
                "sync_weights before connect_weights", "call connect_weights(actor) once the engines are up"
            )
        h = self.health
        if h.down or h.router_down:
            h.restart_dead()
        h.rejoin()  # a rollout boundary: engines lost with a node start again where it came back
        if h.changed:
            self.connect(self.source)
        self.push(version)
        self.engines.weight_version = version

    def push(self, version: int) -> None:
        """Push ``version``; engines that died during the push are restarted and the push repeated
        (bounded: each repeat restarts at least one engine, at most max_engine_restarts each)."""
        while True:
            try:
                self.source.update_weights(version)
                return
            except WeightPushFailed as e:
                lost_before = len(self.health.lost)
                if not self.health.restart_dead() and len(self.health.lost) == lost_before:  # (lost: with their node)
                    raise  # every engine answers: a refusal, not a death
                log.warning("weight push %d: engine died during the push; pushing again (%s)", version, e.problem)
                self.connect(self.source)

    def resync(self) -> None:
        """Open the channel again (all engines share one group) and push the current version."""
        if self.source is None:
            return  # never connected: every engine serves the weights on disk, as the restarted one does
        self.connect(self.source)
        if self.engines.weight_version is not None:
            self.push(self.engines.weight_version)
            log.info("engines re-synced to weight version %d", self.engines.weight_version)
