"""The engine pool: one group of engines with its parts put together (see the package doc)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhpc.errors import RlhpcError
from rlhpc.rollout.engines.engine_set import EngineSet
from rlhpc.rollout.engines.fanout import Call, FanOut
from rlhpc.rollout.engines.health import Health
from rlhpc.wire.client import EngineClient, EngineUnavailable
from rlhpc.wire.lora import POLICY_ADAPTER, LoraServing
from rlhpc.wire.request import EnginesDown, Request, StopCheck

if TYPE_CHECKING:
    from rlhpc.cluster.layout import Layout
    from rlhpc.cluster.placement import Placement
    from rlhpc.config import ClusterConfig, RolloutConfig


class EnginePool:
    """Start, watch, restart, feed and stop a group of engines: its lifecycle (``engine_set``),
    health (``health``) and request fan-out (``fanout``). No weights: the trained pool's are kept
    by ``rlhpc.rollout.weight_sync``, which it tells of the engines it restarts
    (``report_restarts``). ``start`` starts one; ``__init__`` only puts parts together."""

    def __init__(self, engine_set: EngineSet, health: Health, fanout: FanOut):
        self.engine_set, self.health, self.fanout = engine_set, health, fanout

    @classmethod
    def start(
        cls,
        rollout: RolloutConfig,
        cluster: ClusterConfig,
        seed: int,
        model_path: str,
        placement: Placement,
        layout: Layout,
        log_dir: Path,
        stop: StopCheck | None = None,
        key_file: Path | None = None,
        frozen: bool = False,
        role: str = "reward",
        deterministic: bool = False,
        lora: LoraServing | None = None,
        routed_experts: bool = False,
        fleet: str | None = None,
        adapter_name: str = POLICY_ADAPTER,
    ) -> EnginePool:
        """Start the engines (``EngineSet``'s arguments) and watch them; ``stop``: generation in
        flight is aborted when it is set (the job's stop request, or the schedule's ``abort``)."""
        engine_set = EngineSet(
            rollout, cluster, seed, model_path, placement, layout, log_dir, key_file, frozen, role, deterministic, lora,
            routed_experts, fleet, adapter_name,
        )  # fmt: skip
        engine_set.start()
        health = Health(engine_set)
        health.locate()
        return cls.of(engine_set, health, stop)

    @classmethod
    def of(cls, engine_set: EngineSet, health: Health, stop: StopCheck | None = None) -> EnginePool:
        """The pool over engines already up."""
        return cls(engine_set, health, FanOut(engine_set, health, stop))

    # ------------------------------------------------------------ what callers read

    @property
    def frozen(self) -> bool:
        return self.engine_set.frozen

    @property
    def role(self) -> str:
        return self.engine_set.role

    @property
    def clients(self) -> list[EngineClient]:
        return self.engine_set.clients

    @property
    def engines(self) -> list:
        """Each engine's Ray actor serving HTTP."""
        return self.engine_set.engines

    @property
    def engine_logs(self) -> list[str]:
        return self.engine_set.engine_logs

    @property
    def engine_urls(self) -> list[str]:
        return self.engine_set.engine_urls

    @property
    def restarts(self) -> list[int]:
        return self.engine_set.restarts

    @property
    def down(self) -> set[int]:
        return self.health.down

    @property
    def lost(self) -> dict[int, str]:
        return self.health.lost

    @property
    def num_engines(self) -> int:
        """Engines serving now (those lost with their node do not count)."""
        return self.health.num_engines

    # ------------------------------------------------------------ generation

    def restarts_deferred(self) -> Iterator[None]:
        """In this thread, engines found dead are marked down, not restarted (see the package doc)."""
        return self.fanout.restarts_deferred()

    def send(self, requests: Sequence[Any], done: Callable[[int, Any], None] | None = None,
             call: Call | None = None, first: int = 0) -> list[Any]:  # fmt: skip
        """``FanOut.send``."""
        return self.fanout.send(requests, done, call, first)

    def generate(
        self, requests: Sequence[Request], done: Callable[[int, list[dict]], None] | None = None
    ) -> list[list[dict]]:
        """A ``rlhpc.wire.request.Send``: bring engines known to be down back first (no round trip when none is), then ``send``."""
        self.ensure_engines()
        return self.send(requests, done)

    def ensure_engines(self) -> None:
        """Before generating, without a round trip: restart the engines marked down (by a generation
        with ``restarts_deferred``) and bring them to the current weights. With ``restarts_deferred``:
        leave them down, raise ``EnginesDown`` if none is left. Deaths nobody has seen yet show as
        failed requests (``send``), which are handled there."""
        h = self.health
        h.check_nodes_due()
        if self.fanout.deferring():
            if len(h.down) == len(self.clients):
                raise EnginesDown(sorted(h.down))
        elif h.down or h.router_down or h.changed:
            self.fanout.repair()

    # ------------------------------------------------------------ restarts, reported

    def report_restarts(self, restarted: Callable[[], None]) -> None:
        """Tell ``restarted`` of engines restarted (or back, or lost) before they serve again: the
        weight owner of the trained engines (``rlhpc.rollout.weight_sync``) re-syncs them."""
        if self.frozen:
            raise RlhpcError(f"weights kept on the {self.role} engines", "the model is frozen: push nothing to it")
        self.fanout.restarted = restarted

    # ------------------------------------------------------------ memory and lifecycle

    def _on_engines(
        self, fn: Callable[[EngineClient], Any], again_on_restarted: bool, only: set[int] | None = None
    ) -> None:
        """Run fn on every engine (``only``: on those); restart engines that turn out dead
        (``again_on_restarted``: run fn on them too). Their weights are brought back by the next push."""
        clients, lost = self.clients, self.health.lost
        futures = {
            e: self.fanout.threads.submit(fn, c)
            for e, c in enumerate(clients)
            if e not in lost and (only is None or e in only)
        }
        failed: dict[int, EngineUnavailable] = {}
        for e, f in futures.items():
            try:
                f.result()
            except EngineUnavailable as err:
                failed[e] = err
        if not failed:
            return
        restarted = self.health.restart_dead()
        for e, err in failed.items():
            if e not in restarted and e not in lost:
                raise err
        if again_on_restarted:
            for e in restarted:
                fn(clients[e])

    def offload(self) -> None:
        """Free engine weights and KV cache (for the actor's turn on shared GPUs). Once each: SGLang
        dies when asked to release memory it released already."""
        s = self.engine_set
        self._on_engines(lambda c: c.release_memory_occupation(), again_on_restarted=True, only=self._resident())
        s.released.update(self._resident())

    def onload(self) -> None:
        """Resume the memory ``offload`` released, on those engines only: SGLang's resume of memory
        it did not release raises in its scheduler, which kills the server. An engine started
        (or restarted) since is resident: nothing to resume."""
        s = self.engine_set
        # an engine restarted here is new, so resident: not resumed again
        self._on_engines(lambda c: c.resume_memory_occupation(), again_on_restarted=False, only=set(s.released))
        s.released.clear()

    def _resident(self) -> set[int]:
        """The engines serving with their memory in place (not released, not lost with their node)."""
        lost = self.health.lost
        return {e for e in range(len(self.clients)) if e not in self.engine_set.released and e not in lost}

    def shutdown(self) -> None:
        self.fanout.close()
        self.health.close()
        self.engine_set.shutdown()
