"""Actor groups on rank processes that live across a test module's groups.

Every rank an ``ActorGroup`` starts is a Ray actor, a process that imports torch, transformers
and (megatron backend) megatron-core: about 7 CPU seconds before it trains, far more than a
tiny model's training. A module that starts dozens of groups spends most of its time there.
``RankHosts`` keeps a few such processes (``RankHost``) alive for the module; a
``HostedGroup`` is a real ``ActorGroup`` (its rendezvous, fan-out, timeouts and every call
the same) whose ranks are fresh rank objects (``rank_class(backend)(spec, ...)``) built in
those processes instead of fresh processes. What a process keeps between groups is what the
rank's own ``shutdown`` leaves: that call must close torch.distributed and megatron's parallel
state (``RankHost.stop`` checks it), so a group that does not clean up fails the next test
instead of leaking into it. A group that fails to shut down, or hangs, takes its processes
with it: the next group gets new ones.

What this does not prove: that a rank in a new process behaves as one in a reused process.
Whole jobs (test_megatron_loop, the torch actor's and the Slurm resumes) start every rank fresh.
"""

from __future__ import annotations

import gc
from typing import Any, NoReturn

import ray

from rlhpc.actor.group import CHECKPOINT_THREAD, ActorGroup, ActorSpec, rank_class
from rlhpc.cluster.placement import Placement, create_placement
from rlhpc.config import Config

SHUTDOWN_WAIT_S = 10.0  # as ActorGroup.shutdown waits for its ranks' own shutdown


@ray.remote(concurrency_groups={CHECKPOINT_THREAD: 1})
class RankHost:
    """One rank process; holds at most one rank object at a time."""

    def __init__(self) -> None:
        self.rank: Any = None

    def start(self, backend: str, spec: ActorSpec, model_path: str, rank: int, world_size: int) -> None:
        assert self.rank is None, "a host holds one rank at a time"
        self.rank = rank_class(backend)(spec, model_path, rank, world_size)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.rank, method)(*args)

    def stop(self) -> None:
        """Drop the rank, after its ``shutdown``: nothing of its process-wide state may stay."""
        import torch.distributed as dist

        self.rank = None
        gc.collect()
        assert not dist.is_initialized(), "the rank's shutdown left torch.distributed initialized"
        try:
            from megatron.core import parallel_state as mpu
            from megatron.core.transformer.moe import moe_utils
        except ImportError:
            return
        assert not mpu.model_parallel_is_initialized(), "the rank's shutdown left megatron's parallel state"
        # megatron-core's class- and module-level MoE state, which no rank owns (a process ends
        # with its rank): back to what a fresh process has. The aux loss's scale, once set, is
        # copied into in place, so a 0-dim one from an unpipelined MoE group fails a pipeline's
        # [1]-shaped copy in the next group (seen: the PP=2 x EP=2 test after the EP ones).
        moe_utils.MoEAuxLossAutoScaler.main_loss_backward_scale = None
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


class _Method:
    """``handle.method`` of a hosted rank: ``.remote(*args)`` and ``.options(...)`` as on an actor."""

    def __init__(self, host: Any, name: str, options: dict[str, Any] | None = None):
        self.host, self.name, self.opts = host, name, options or {}

    def options(self, **options: Any) -> _Method:
        return _Method(self.host, self.name, {**self.opts, **options})

    def remote(self, *args: Any) -> ray.ObjectRef:
        call = self.host.call.options(**self.opts) if self.opts else self.host.call
        return call.remote(self.name, *args)


class HostedRank:
    """Stands where an ``ActorGroup`` keeps a rank's actor handle."""

    def __init__(self, host: Any):
        self.host = host

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.host, name)


class RankHosts:
    """Idle rank processes; ``take`` starts more when too few are idle. Needs Ray up; ``close`` before it goes."""

    def __init__(self) -> None:
        self.idle: list[Any] = []

    def take(self, n: int) -> list[Any]:
        # no resources of their own: the group's placement holds its slots, as for fresh ranks
        while len(self.idle) < n:
            self.idle.append(RankHost.options(num_cpus=0, num_gpus=0).remote())
        taken, self.idle = self.idle[:n], self.idle[n:]
        return taken

    def give_back(self, hosts: list[Any]) -> None:
        self.idle.extend(hosts)

    def close(self) -> None:
        for h in self.idle:
            ray.kill(h)
        self.idle = []


class _HostedActorGroup(ActorGroup):
    def __init__(self, hosts: RankHosts, *args: Any, **kwargs: Any):
        self._pool = hosts
        self._hosts: list[Any] = []
        try:
            super().__init__(*args, **kwargs)
        except BaseException:  # ranks built but no group: their processes' state is unknown
            self._kill_hosts()
            raise

    def _start_ranks(self, spec: ActorSpec, model_path: str, placement: Placement, num_gpus: float) -> list[Any]:
        self._hosts = self._pool.take(self.world_size)
        try:
            ray.get(
                [
                    h.start.remote(spec.actor.backend, spec, model_path, r, self.world_size)
                    for r, h in enumerate(self._hosts)
                ]
            )
        except Exception:
            self._kill_hosts()
            raise
        return [HostedRank(h) for h in self._hosts]

    def _kill_hosts(self) -> None:
        for h in self._hosts:
            ray.kill(h)
        self._hosts = []

    def _hung(self, method: str, silent: list[int], waited_s: float, why: str) -> NoReturn:
        self.workers = list(self._hosts)  # the processes are what ActorGroup kills
        self._hosts = []
        super()._hung(method, silent, waited_s, why)

    def shutdown(self) -> None:
        """The ranks' own ``shutdown``, then the processes go back idle; killed if any rank fails or stays silent."""
        refs = [w.shutdown.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=SHUTDOWN_WAIT_S)
        self.workers = []
        try:
            if len(ready) < len(refs):
                raise TimeoutError("a rank did not shut down")
            ray.get(ready)
            ray.get([h.stop.remote() for h in self._hosts])
        except Exception:
            self._kill_hosts()
            raise
        self._pool.give_back(self._hosts)
        self._hosts = []


class HostedGroup:
    """``support.actors.Group`` (an ActorGroup on its own placement group, both released on exit)
    on ``hosts``' processes."""

    def __init__(self, hosts: RankHosts, cfg: Config, model_path: str, ranks: int):
        self.placement: Placement = create_placement(ranks)
        try:
            self.group = _HostedActorGroup(
                hosts, ActorSpec.from_config(cfg), model_path, self.placement, tuple(range(ranks)), cfg.cluster.colocate
            )
        except BaseException:
            self.placement.remove()
            raise

    def __enter__(self) -> ActorGroup:
        return self.group

    def __exit__(self, *exc: object) -> None:
        try:
            self.group.shutdown()
        finally:
            self.placement.remove()
