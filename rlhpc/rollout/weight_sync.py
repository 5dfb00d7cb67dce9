"""The one owner of the trained engines' weights: the version they hold, every push, every re-sync.

Built by the driver over the actor group and the trained engine pool; nothing else pushes. A push
goes one way: the loop (through the schedule, which only says when) -> ``WeightSync`` -> the actor
group -> rank 0's sender -> the engines. The pool knows no weights: it restarts engines and
reports those it restarted mid-generation (``EnginePool.report_restarts``), and this object gives
them the version the others hold.

Versions: v is the policy after training rollouts 0 .. v-1 (0: the model on disk). ``trained``
is the actor's (the checkpoint's, one more per ``train``); ``version`` the engines' (None until
the first push: they serve the weights on disk). Where later features land: what a rank sends
(an adapter's files, ``actor.lora.push: adapter``; FP8 or other quantized buckets) is the
actor's ``update_weights``, unchanged here; what the engines must learn besides weights
(routed-expert replay) travels with generation, not with the push.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rlhpc.errors import RlhpcError, WeightPushFailed
from rlhpc.wire.protocol import MetaInfo
from rlhpc.wire.request import EnginesDown

if TYPE_CHECKING:
    from rlhpc.actor.group import ActorGroup
    from rlhpc.batch import RolloutBatch
    from rlhpc.rollout.engines import EnginePool
    from rlhpc.wire.request import Request

log = logging.getLogger(__name__)


class WeightSync:
    """The weights of ``pool``'s engines, kept on ``actor``'s through training and restarts.

    ``version``: the checkpoint's weight version (0 on a fresh run). ``fuse``: push with the
    training call when nothing needs repair first (the synchronous loop, not offloaded: the
    engines wait idle for the push anyway, and the ranks are spared one trip). ``shared``: the
    engines are a shared fleet's (``rollout.fleet``), whose one weight version per engine is no
    run's: each sample is stamped with this run's adapter version instead (exact in the
    synchronous loop the fleet requires: no push lands during a generation)."""

    def __init__(self, actor: ActorGroup, pool: EnginePool, version: int, fuse: bool = False, shared: bool = False):
        if pool.frozen:
            raise RlhpcError(f"weights pushed to the {pool.role} engines", "the model is frozen: push nothing to it")
        self.actor, self.pool, self.fuse, self.shared = actor, pool, fuse, shared
        self.trained = version
        self.version: int | None = None
        self.connected = False
        pool.report_restarts(self.resync)

    # ------------------------------------------------------------ the channel

    def connect(self) -> None:
        """Open the channel from the actor (rank 0) to every engine not lost with its node."""
        s, h = self.pool.engine_set, self.pool.health
        live = [e for e in range(len(s.clients)) if e not in h.lost]  # a lost engine cannot join the group
        self.actor.connect_rollout(
            [s.clients[e].base_url for e in live],
            [s.engine_world_sizes[e] for e in live],
            s.cluster_cfg.colocate,
            str(s.key_file),
        )
        self.connected = True
        h.changed = False

    # ------------------------------------------------------------ pushes

    def train(self, rollout_id: int, batch: RolloutBatch) -> dict[str, float]:
        """Train one rollout (``trained`` goes one up); with ``fuse`` and every engine well, the
        ranks push the result in the same call and the metrics carry its seconds as
        ``time/update_weights``. A fused push that failed is handled as any failed push
        (restart, connect, push again) before this returns."""
        version = self.trained + 1
        if not (self.fuse and self.connected and self.pool.health.all_well()):
            metrics = self.actor.train(rollout_id, batch)
            self.trained = version
            return metrics
        metrics, error, push_s = self.actor.train_and_push(rollout_id, batch, version)
        self.trained = version
        if error is not None:
            start = time.perf_counter()
            self._push(version, WeightPushFailed(version, error))
            push_s += time.perf_counter() - start
        self.version = version
        return {**metrics, "time/update_weights": push_s}

    def push(self, version: int) -> None:
        """Every engine on the actor's weights as ``version`` (``trained``: the schedule calls this
        when the engines may take it): engines known to be down restarted first, those lost with
        a node started again where it came back, the channel opened again if they changed. None
        of it when the push was made with training."""
        if version == self.version:
            return
        h = self.pool.health
        if h.down or h.router_down:
            h.restart_dead()
        h.rejoin()  # a rollout boundary: engines lost with a node start again where it came back
        if h.changed or not self.connected:
            self.connect()
        self._push(version)
        self.version = version

    def _push(self, version: int, failed: WeightPushFailed | None = None) -> None:
        """Push ``version`` (``failed``: an attempt already failed); engines that died during it are
        restarted and the push repeated (bounded: each repeat restarts at least one engine, at
        most ``rollout.max_engine_restarts`` each)."""
        h = self.pool.health
        while True:
            if failed is None:
                try:
                    self.actor.update_weights(version)
                    return
                except WeightPushFailed as e:
                    failed = e
            lost_before = len(h.lost)
            if not h.restart_dead() and len(h.lost) == lost_before:  # (lost: with their node)
                raise failed  # every engine answers: a refusal, not a death
            log.warning("weight push %d: engine died during the push; pushing again (%s)", version, failed.problem)
            self.connect()
            failed = None

    def resync(self) -> None:
        """What the pool reports: engines it restarted (or that came back, or were lost) get the
        version the others hold; the channel is opened again over all (they share one group)."""
        if not self.connected:
            return  # never connected: every engine serves the weights on disk, as a restarted one does
        self.connect()
        if self.version is not None:
            self._push(self.version)
            log.info("engines re-synced to weight version %d", self.version)

    # ------------------------------------------------------------ generation through the pool

    def generate(
        self, requests: Sequence[Request], done: Callable[[int, list[dict]], None] | None = None
    ) -> list[list[dict]]:
        """The trained pool's ``generate`` (a ``rlhpc.wire.request.Send``); with no engine left,
        ``EnginesDown`` names the version the engines held."""
        try:
            if self.shared:
                return self._stamped(self.pool.generate(requests, self._stamp_each(done)))
            return self.pool.generate(requests, done)
        except EnginesDown as e:
            if e.version is not None:
                raise
            raise EnginesDown(e.dead, self.version) from None

    def _stamped(self, outputs: list[list[dict]]) -> list[list[dict]]:
        """Each sample's ``meta_info`` with this run's adapter version (see ``shared``)."""
        v = str(self.version if self.version is not None else 0)
        for samples in outputs:
            for out in samples:
                meta = out.setdefault("meta_info", {})
                meta[MetaInfo.WEIGHT_VERSION] = v
                meta.pop(MetaInfo.WEIGHT_VERSIONS, None)  # the engine's spans, of its own versions
        return outputs

    def _stamp_each(self, done: Callable[[int, list[dict]], None] | None) -> Callable[[int, list[dict]], None] | None:
        if done is None:
            return None
        return lambda i, samples: done(i, self._stamped([samples])[0])
