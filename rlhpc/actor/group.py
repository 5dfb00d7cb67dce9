"""Driver-side handle on the training ranks: one rank per actor slot, calls fanned out.

The rank class is the configured backend's (``actor.backend``): ``TrainWorker`` (PyTorch DDP)
or ``MegatronTrainWorker`` (megatron-core, TP x DP); both answer the same calls, so nothing
above this group knows which one trains. Callers build the group from an ``ActorSpec`` (the
config sections the ranks read), re-exported here.

Every method waits for all ranks. If a rank fails, the first failure is raised at once as
``ActorRankError`` naming the rank (the surviving ranks may be stuck in a collective; the
driver is expected to ``shutdown()`` the group). No call waits forever: a rank silent for
``actor.call_timeout_s`` (``actor.start_timeout_s`` in a call of its start, ``START_CALLS``) is
taken as hung, and so is one still silent ``actor.stop_wait_s`` after
a stop request (the job must requeue before Slurm's time limit ends it); the group's ranks are
then killed and ``ActorCallTimeout`` names the call, the ranks and their nodes.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, NoReturn

import ray
import torch

from rlhpc.actor.rank import RankBase
from rlhpc.actor.spec import ActorSpec
from rlhpc.actor.worker import TrainWorker
from rlhpc.batch import RolloutBatch
from rlhpc.cluster.placement import Placement
from rlhpc.errors import RlhpcError, WeightPushFailed

if TYPE_CHECKING:
    from rlhpc.runtime.signals import StopRequest

log = logging.getLogger(__name__)

# Colocated: the actor takes this share of its slot's GPU and the engine(s) the rest.
COLOCATE_GPU_FRACTION = 0.4
# A bundle is {"GPU": 1, "CPU": 1}; a fractional CPU leaves room for an engine or helper beside it.
WORKER_NUM_CPUS = 0.4
# The Ray concurrency group (one thread per rank) that writes checkpoints while the default thread trains.
CHECKPOINT_THREAD = "checkpoint"
# Calls wait in slices this long, so a stop request is seen while a call runs.
WAIT_SLICE_S = 1.0
# A rank that raised waits this long for a peer's death to show (see ``ActorGroup._root_cause``).
PEER_DEATH_GRACE_S = 10.0
# The calls of a start, bounded by actor.start_timeout_s: the first waits for the ranks' processes
# and their model; then the process group, the checkpoint (or initial state) loaded, the weight
# channel. Every other call is bounded by actor.call_timeout_s.
START_CALLS = frozenset({"rendezvous", "init_process_group", "load", "connect_rollout"})


class ActorRankError(RlhpcError):
    """A training rank died or raised."""

    def __init__(self, rank: int, method: str, cause: BaseException):
        dead = isinstance(cause, ray.exceptions.RayActorError)
        super().__init__(
            f"actor rank {rank} {'died' if dead else 'failed'} during {method}: {cause}",
            "see that rank's log above (OOM, a crashed node, or the exception shown); "
            "a dead rank requeues the job, which resumes from the last checkpoint",
        )
        self.rank = rank
        self.method = method
        # A dead process (SIGKILL, OOM killer, a lost node) is gone at the next start, like a dead
        # engine: requeued within the restart caps. An exception the rank raised would recur.
        self.transient = dead


class ActorCallTimeout(RlhpcError):
    """Training ranks did not answer a call in time: hung (a stuck collective, a stopped process)."""

    transient = True  # a fresh start on fresh processes may well get through: requeued like a crash

    def __init__(self, method: str, silent: dict[int, str], waited_s: float, why: str):
        ranks = ", ".join(f"rank {rank} on {where}" for rank, where in silent.items())
        super().__init__(
            f"actor call {method} got no answer from {ranks} within {waited_s:.0f} s ({why})",
            "see those ranks' logs (a stuck collective, a dead peer or network, a stopped process); the job "
            "requeues and resumes from the last checkpoint; raise the limit named if the call is just slow",
        )
        self.method = method
        self.ranks = sorted(silent)


def rank_class(backend: str) -> type[RankBase]:
    """The rank class of ``actor.backend``."""
    if backend == "megatron":
        from rlhpc.actor.megatron.worker import MegatronTrainWorker  # late: megatron-core is optional

        return MegatronTrainWorker
    return TrainWorker


class ActorGroup:
    """One rank per slot of ``placement``; ``colocate``: the slots' GPUs are shared with engines."""

    def __init__(
        self,
        spec: ActorSpec,
        model_path: str,
        placement: Placement,
        slots: tuple[int, ...],
        colocate: bool,
        stop: StopRequest | None = None,
    ):
        self.slots = tuple(slots)
        self.world_size = len(self.slots)
        self.call_timeout_s = spec.actor.call_timeout_s
        self.start_timeout_s = spec.actor.start_timeout_s
        self.stop_wait_s = spec.actor.stop_wait_s
        self.stop = stop  # seen between wait slices: a stop shortens the wait for a hung rank
        self.nodes = [f"{ip} (GPU {gpu})" for ip, gpu in (placement.location_of_slot[s] for s in self.slots)]
        # Ranks of one tensor-parallel group see the same data: megatron orders ranks TP-fastest,
        # then DP, with the pipeline stages outermost (every stage of a replica: the same data).
        self.tp_size = spec.tp_size
        self.dp_size = self.world_size // (self.tp_size * spec.pp_size)
        num_gpus = COLOCATE_GPU_FRACTION if colocate else 1
        self.workers = self._start_ranks(spec, model_path, placement, num_gpus)
        one_node = len({ip for ip, _ in (placement.location_of_slot[s] for s in self.slots)}) == 1
        rendezvous = self._get([self.workers[0].rendezvous.remote(one_node)], "rendezvous")[0]
        self._call("init_process_group", rendezvous)
        log.info(
            "actor group: %d rank(s) on slots %s (%s), rendezvous %s",
            self.world_size, self.slots, ", ".join(self.nodes), rendezvous,
        )  # fmt: skip

    def _start_ranks(self, spec: ActorSpec, model_path: str, placement: Placement, num_gpus: float) -> list[Any]:
        """One Ray actor (a process) per rank, on its slot's bundle. (Tests that start many
        groups override this to reuse live processes: tests/support/rank_hosts.py.)"""
        # Each rank gets a second thread, alive as long as it: checkpoint writes run there beside training.
        remote_cls = ray.remote(concurrency_groups={CHECKPOINT_THREAD: 1})(rank_class(spec.actor.backend))
        return [
            remote_cls.options(
                num_gpus=num_gpus,
                num_cpus=WORKER_NUM_CPUS,
                scheduling_strategy=placement.strategy(slot),
            ).remote(spec, model_path, rank, self.world_size)
            for rank, slot in enumerate(self.slots)
        ]

    # ------------------------------------------------------------------ fan-out

    def _get(self, refs: list[ray.ObjectRef], method: str) -> list[Any]:
        """Results in rank order; the first rank to fail raises at once (no waiting on the rest).

        Raises ``ActorCallTimeout`` when ranks stay silent past ``call_timeout_s`` (``start_timeout_s``
        in ``START_CALLS``), or past ``actor.stop_wait_s`` after a stop request (counted from the
        later of the request and the call)."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        started = time.monotonic()
        limit_s, knob = self.limit_of(method)
        while pending:
            now = time.monotonic()
            limit, why = started + limit_s, f"{knob} = {limit_s:g}"
            if self.stop is not None and self.stop.requested:
                after_stop = max(self.stop.at or started, started) + self.stop_wait_s
                if after_stop < limit:
                    limit, why = (
                        after_stop,
                        f"{self.stop.name} asked the job to stop; waited {self.stop_wait_s:g} s more",
                    )
            if now >= limit:
                self._hung(method, sorted(rank_of[r] for r in pending), now - started, why)
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(WAIT_SLICE_S, limit - now))
            if not ready:
                continue
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                raise ActorRankError(rank, method, e) from e
            except ray.exceptions.RayTaskError as e:
                raise self._root_cause(rank, method, e, pending, rank_of) from e
        return [results[r] for r in range(len(refs))]

    def limit_of(self, method: str) -> tuple[float, str]:
        """How long a call of ``method`` may stay unanswered, and the key that says so."""
        if method in START_CALLS:
            return self.start_timeout_s, "actor.start_timeout_s"
        return self.call_timeout_s, "actor.call_timeout_s"

    @staticmethod
    def _root_cause(
        rank: int,
        method: str,
        error: BaseException,
        pending: list[ray.ObjectRef],
        rank_of: dict,
        grace_s: float = PEER_DEATH_GRACE_S,
    ) -> ActorRankError:
        """The error to report when ``rank`` raised: a rank whose peer died fails in the collective
        it shared with it (gloo: connection closed), often before Ray reports the death itself. A
        dead rank is the cause (and a requeue its cure), so give the others ``PEER_DEATH_GRACE_S``
        to show one before blaming the rank that raised."""
        deadline = time.monotonic() + grace_s
        while pending and (left := deadline - time.monotonic()) > 0:
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                break
            try:
                ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                return ActorRankError(rank_of[ready[0]], method, e)
            except ray.exceptions.RayTaskError:
                pass  # another victim of the same cause
        return ActorRankError(rank, method, error)

    def _hung(self, method: str, silent: list[int], waited_s: float, why: str) -> NoReturn:
        """The group is lost (its live ranks may wait in a collective on the silent ones): kill it, say who."""
        error = ActorCallTimeout(method, {r: self.nodes[r] for r in silent}, waited_s, why)
        for w in self.workers:
            ray.kill(w)  # a stopped or stuck process is SIGKILLed, not left holding its GPU
        self.workers = []
        raise error

    def _call(self, method: str, *args: Any) -> list[Any]:
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return self._get(refs, method)

    # ------------------------------------------------------------------ API

    def load(self, ckpt_dir: str | None) -> None:
        self._call("load", ckpt_dir)

    def _shards(self, rollout_id: int, batch: RolloutBatch) -> list[RolloutBatch]:
        """Each rank's part of ``batch``: the ranks of one tensor-parallel group get the same."""
        if len(batch) < self.dp_size:
            raise RlhpcError(
                f"rollout {rollout_id} has {len(batch)} samples for {self.dp_size} data-parallel actor ranks",
                "raise rollout.rollout_batch_size or lower cluster.actor_num_gpus",
            )
        return [batch.shard(r // self.tp_size % self.dp_size, self.dp_size) for r in range(self.world_size)]

    def train(self, rollout_id: int, batch: RolloutBatch) -> dict[str, float]:
        """One rollout's training; metrics are global (every rank returns the same, rank 0's is used)."""
        shards = self._shards(rollout_id, batch)
        refs = [w.train.remote(rollout_id, shard) for w, shard in zip(self.workers, shards)]
        return self._get(refs, "train")[0]

    def train_and_push(
        self, rollout_id: int, batch: RolloutBatch, version: int
    ) -> tuple[dict[str, float], str | None, float]:
        """``train``, then the trained weights pushed as ``version`` in the same call (one trip to
        the ranks fewer). Returns the metrics, why the push failed on the engines' side (None:
        it did not) and the push's seconds; the ranks stay usable either way."""
        shards = self._shards(rollout_id, batch)
        refs = [w.train_and_push.remote(rollout_id, shard, version) for w, shard in zip(self.workers, shards)]
        return self._get(refs, "train_and_push")[0]

    def kl_to_reference(self, batch: RolloutBatch) -> torch.Tensor:
        """Per sample of ``batch`` [N]: sum_t KL_t of the current policy to the reference over its
        response tokens (``algo.kl_in_reward``); each data-parallel rank measures its shard."""
        shards = [batch.shard(r // self.tp_size, self.dp_size) for r in range(self.world_size)]
        refs = [w.kl_to_reference.remote(shard) for w, shard in zip(self.workers, shards)]
        per_rank = self._get(refs, "kl_to_reference")
        # the TP ranks of a replica hold the same shard and agree: one replica's answer each, in shard order
        return torch.tensor([kl for kls in per_rank[:: self.tp_size] for kl in kls], dtype=torch.float32)

    def save(self, ckpt_dir: str) -> None:
        """All ranks write into ``ckpt_dir/actor/``; returns when every rank has finished."""
        self._call("save", ckpt_dir)

    def snapshot(self, ckpt_dir: str) -> None:
        """Every rank copies its checkpoint state to host memory (the part of a save that blocks)."""
        self._call("snapshot", ckpt_dir)

    def write_snapshot(self) -> dict[str, tuple[int, int]]:
        """Every rank writes its last snapshot into ``ckpt_dir/actor/`` on its checkpoint thread;
        returns when all have, with the (size, CRC-32) of the files the ranks summed as they wrote
        (paths relative to ``ckpt_dir``). Safe to wait for from another thread while the ranks train."""
        workers = self.workers  # the list is replaced (emptied) if a hung call kills the ranks meanwhile
        refs = [w.write_snapshot.options(concurrency_group=CHECKPOINT_THREAD).remote() for w in workers]
        known: dict[str, tuple[int, int]] = {}
        for sums in self._get(refs, "write_snapshot"):
            known.update(sums or {})
        return known

    def connect_rollout(
        self, engine_urls: list[str], engine_world_sizes: list[int], colocate: bool, key_file: str | None = None
    ) -> None:
        self._call("connect_rollout", engine_urls, engine_world_sizes, colocate, key_file)

    def update_weights(self, version: int) -> None:
        """Raises ``WeightPushFailed`` when the engines' side failed; the ranks stay usable."""
        error = self._call("update_weights", version)[0]
        if error is not None:
            raise WeightPushFailed(version, error)

    def offload(self) -> None:
        self._call("offload")

    def onload(self) -> None:
        self._call("onload")

    def fingerprints(self) -> list[str]:
        return self._call("state_fingerprint")

    def reference_fingerprints(self) -> list[str | None]:
        """Per rank, the reference model's fingerprint (torch actor only; None: no reference)."""
        return self._call("reference_fingerprint")

    def lora_adapter(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """The LoRA adapter in PEFT's format, as rank 0 holds it (torch actor with actor.lora):
        its ``adapter_config.json`` as a dict and its tensors under PEFT's names (CPU copies)."""
        return self._get([self.workers[0].lora_adapter.remote()], "lora_adapter")[0]

    def shutdown(self) -> None:
        """Close process groups where ranks still answer, then kill every actor."""
        refs = [w.shutdown.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception:  # a rank already dead or stuck: it is killed below anyway
                log.debug("actor shutdown call failed", exc_info=True)
        for w in self.workers:
            ray.kill(w)
        self.workers = []
