"""The engine pool: the rollout engines on their GPUs, kept alive and on the current weights.

It lives in the driver process and talks to every engine over SGLang's HTTP protocol, so the
same code drives the CPU engine server here and SGLang servers on a GPU cluster. It sends the
/generate requests it is handed (``rlhpc.rollout.generation`` makes them) and knows nothing of
prompts, rewards or tokenizers.

An engine whose server dies or stops answering /health is restarted (at most
``rollout.max_engine_restarts`` times) and brought back to the current weights through the
weight source it was connected to (``connect_weights``, the actor): the weight-sync channel is
opened again over all engines, since they share one group, and the current version is pushed.
Generation requests that failed on it are sent again; every sample has its own seed, so they
give the same tokens.

/health is asked only after a failure (a request or a push that an engine did not answer),
never before every generation, evaluation or push: SGLang's /health is itself a generation
that waits at least a second. A dead server refuses connections at once, so its death shows
as failed requests; a hung one, as requests that time out (``EngineClient.timeout_s``).

Restarts wait for a safe moment. A restarted engine must get the weights the others hold, and
only the actor has them, and only while it is not training. Generation in the async pipeline
runs beside training (``restarts_deferred``): an engine it finds dead is only marked down, its
requests go to the healthy engines (same weights, same tokens), and the restart waits for the
next gap, where the thread that pushes weights calls ``sync_weights`` or ``ensure_engines``.
With no healthy engine left such a generation raises ``EnginesDown`` for the schedule.
The router (SGLang backend) is restarted when it dies, at most ``rollout.max_engine_restarts``
times as well.

Every engine route requires the job's engine key (``rlhpc.wire.engine_key``): a fresh one is
written to ``key_file`` when the pool starts, the engines, the router and the weight source get
the file (its path), and the pool's clients send it. Engines listen on loopback when every slot
of the placement is on the driver's node (nobody else needs to reach them), else on the node's IP.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from rlhpc.engine_server.host import EngineActor
from rlhpc.engine_server.sglang import Router, engine_parts
from rlhpc.errors import RlhpcError, WeightPushFailed
from rlhpc.util.files import tail
from rlhpc.weights.source import WeightSource
from rlhpc.wire.client import EngineClient, EngineUnavailable
from rlhpc.wire.engine_key import new_key
from rlhpc.wire.request import GenerationAborted, Request

if TYPE_CHECKING:
    from rlhpc.cluster.layout import Layout
    from rlhpc.cluster.placement import Placement
    from rlhpc.config import ClusterConfig, RolloutConfig
    from rlhpc.runtime.signals import StopRequest

log = logging.getLogger(__name__)

# Share of a GPU an engine takes when it sits beside an actor rank (colocate).
COLOCATED_ENGINE_GPU = 0.2
# How often generation in flight asks Ray whether an engine's node died: a request to a node that
# lost power gets no answer at all (no refused connection), only Ray's health checks notice.
NODE_CHECK_S = 2.0
SILENT_S = 60.0  # no request answered for this long: the engines still waited on are named in the log


class Silence:
    """How long a send has had no answer; due once per ``SILENT_S`` of it."""

    def __init__(self, now: float):
        self.since = self.warned = now

    def answered(self) -> None:
        self.since = self.warned = time.monotonic()

    def for_s(self) -> float:
        return time.monotonic() - self.since

    def due(self) -> bool:
        if time.monotonic() - self.warned < SILENT_S:
            return False
        self.warned = time.monotonic()
        return True


class NodeLost(RlhpcError):
    """A node holding actor ranks died: their state (weights, optimizer) is gone with it."""

    transient = True  # the job requeues and resumes from the newest checkpoint

    def __init__(self, nodes: list[str]):
        super().__init__(
            f"node(s) {', '.join(nodes)} holding actor ranks died: the ranks' state is gone",
            "nothing to do: the job requeues and resumes from the newest checkpoint",
        )
        self.nodes = nodes


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


class EnginePool:
    """Start, watch, restart, feed and stop the rollout engines.

    ``stop`` is the job's stop request: generation in flight is aborted when it is set.
    ``key_file``: where the engine key is written (``RunDir.engine_key``); None: a private temp dir.
    """

    frozen = False  # see __init__
    role = "rollout"

    def __init__(
        self,
        rollout: RolloutConfig,
        cluster: ClusterConfig,
        seed: int,
        model_path: str,
        placement: Placement,
        layout: Layout,
        log_dir: Path,
        stop: StopRequest | None = None,
        key_file: Path | None = None,
        frozen: bool = False,
        role: str = "reward",
    ):
        # frozen: the reward (or, ``role`` "teacher", the teacher's) engines (``layout.reward_slots``,
        # ``layout.teacher_slots``), on GPUs of their own, never given
        # weights: a restarted one serves the model on disk, as the others do (no channel to reopen)
        self.frozen = frozen
        self.role = role if frozen else "rollout"
        self.rollout_cfg, self.cluster_cfg, self.seed = rollout, cluster, seed
        self.stop = stop
        self._key_dir = None if key_file is not None else Path(tempfile.mkdtemp(prefix="rlhpc-engine-key-"))
        self.key_file = Path(key_file) if key_file is not None else self._key_dir / "engine_key"
        self.api_key = new_key(self.key_file)  # a new one at every start of the job
        here = ray.util.get_node_ip_address()
        # Loopback when every engine and actor rank is on the driver's node (the embedded default).
        self.engine_host = "127.0.0.1" if all(ip == here for ip, _ in placement.location_of_slot) else None
        self._layout = layout
        self.engine_world_sizes = [len(slots) for slots in self._own_slots()]
        self._placement, self._layout, self._model_path, self._log_dir = placement, layout, model_path, log_dir
        # engine e's actors, one per node it spans (node rank 0 first, the one serving HTTP)
        self.engine_parts = [
            self._start_engine(e, slots, model_path, placement, layout, log_dir)
            for e, slots in enumerate(self._own_slots())
        ]
        self.engines = [parts[0] for parts in self.engine_parts]
        urls = ray.get([e.url.remote() for e in self.engines])
        self.clients = [EngineClient(url, api_key=self.api_key) for url in urls]
        self.engine_logs: list[str] = ray.get([e.log_file.remote() for e in self.engines])
        log.info("%s engines up: %s", self.role, ", ".join(urls))
        self.router: Router | None = None
        self.router_client: EngineClient | None = None  # generation goes through it when set
        self.router_restarts = 0  # after it died, bounded by rollout.max_engine_restarts
        if rollout.backend == "sglang" and rollout.sglang.router:
            self.router = Router("127.0.0.1", log_dir / "router.log", 60.0, self.key_file)
            self.router_client = EngineClient(self.router.start(urls), api_key=self.api_key)
        self.restarts = [0] * len(self.engines)  # per engine, bounded by rollout.max_engine_restarts
        # Found dead by a generation that may not restart them (restarts_deferred): served by none
        # until the next restart point. The router too, when it is dead.
        self.down: set[int] = set()
        self._router_down = False
        self._deferred = threading.local()
        self.weight_version: int | None = None  # what the engines hold (None: the weights on disk)
        self._weights: WeightSource | None = None
        self._reconnect = False  # an engine came back since the weight-sync channel was opened
        self._threads = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)))
        # Health checks of their own: with partial rollouts the main thread checks the engines
        # before a push while the generation's requests fill the pool above.
        self._health_threads = ThreadPoolExecutor(max_workers=max(2, len(self.clients)))
        # Node loss: engines whose node Ray declared dead (engine -> node IP) serve no request and
        # are left out of the weight-sync group until their bundles are placed on a live node again.
        self.lost: dict[int, str] = {}
        self._nodes_checked = -NODE_CHECK_S  # monotonic time of the last node-table query
        self._engine_bundles = [[placement.bundle_of_slot[s] for s in slots] for slots in self._own_slots()]
        self._actor_bundles = [placement.bundle_of_slot[s] for s in layout.actor_slots]
        where = self._bundle_nodes()
        self._engine_nodes = [{where.get(b) for b in bundles} for bundles in self._engine_bundles]
        self._actor_nodes = {where.get(b) for b in self._actor_bundles}

    def _start_engine(
        self, e: int, slots: tuple[int, ...], model_path: str, placement: Placement, layout: Layout, log_dir: Path
    ) -> list[ray.actor.ActorHandle]:
        """Create engine e's actor(s); they start their servers (an engine over nodes: all at once)."""
        r = self.rollout_cfg
        gpu = COLOCATED_ENGINE_GPU if layout.colocate and not self.frozen else 1
        if r.backend == "cpu":
            parts = [(slots[0], None)]
        else:
            memory_saver = not self.frozen and (self.cluster_cfg.colocate or self.cluster_cfg.offload)
            parts = engine_parts(
                slots, placement.location_of_slot, r.sglang.mem_fraction_static, memory_saver, self.seed,
                r.sglang.extra_args,
            )  # fmt: skip
        multi = len(parts) > 1
        actors = [
            EngineActor.options(num_gpus=gpu, num_cpus=0.5, scheduling_strategy=placement.strategy(slot)).remote(
                model_path,
                str(log_dir),
                e,
                r.engine_startup_timeout_s,
                None,
                spec,
                not multi,
                key_file=str(self.key_file),
                host=self.engine_host,
            )
            for slot, spec in parts
        ]
        if multi:
            self._start_parts(actors)
        return actors

    def _own_slots(self) -> tuple[tuple[int, ...], ...]:
        """The slots of each engine of this pool: the rollout engines', or the reward engines'."""
        if not self.frozen:
            return self._layout.engine_slots
        return self._layout.teacher_slots if self.role == "teacher" else self._layout.reward_slots

    @staticmethod
    def _start_parts(actors: list[ray.actor.ActorHandle]) -> str:
        """Start every node's part of one engine together (node rank 0 waits for the others)."""
        addr = ray.get(actors[0].reserve_dist_init_addr.remote())
        return ray.get([a.start.remote(addr) for a in actors])[0]

    @property
    def engine_urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    @property
    def num_engines(self) -> int:
        """Engines serving now (those lost with their node do not count)."""
        return len(self.clients) - len(self.lost)

    # ------------------------------------------------------------ node loss

    def _bundle_nodes(self) -> dict[int, str]:
        """Placement-group bundle -> the Ray node id it is placed on now (absent while unplaced)."""
        table = ray.util.placement_group_table(self._placement.pg)
        return {int(b): n for b, n in table.get("bundles_to_node_id", {}).items() if n}

    @staticmethod
    def _dead_ray_nodes() -> dict[str, str]:
        """Ray node id -> IP of every node Ray declared dead."""
        return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if not n.get("Alive")}

    def check_nodes(self) -> list[int]:
        """Mark the engines whose node Ray declared dead as lost; returns the newly lost ones.
        A dead node that holds actor ranks raises ``NodeLost``: the run cannot go on without them."""
        self._nodes_checked = time.monotonic()
        dead = self._dead_ray_nodes()
        if not dead:
            return []
        actor_lost = sorted({dead[n] for n in self._actor_nodes if n in dead})
        if actor_lost:
            raise NodeLost(actor_lost)
        new = [e for e, nodes in enumerate(self._engine_nodes) if e not in self.lost and nodes & dead.keys()]
        for e in new:
            self.lost[e] = dead[next(iter(self._engine_nodes[e] & dead.keys()))]
            self.down.discard(e)
        if new:
            self._reconnect = True  # the weight-sync group is formed again without them
            for ip in sorted({self.lost[e] for e in new}):
                gone = [e for e in new if self.lost[e] == ip]
                log.warning(
                    "node %s is lost: rollout engine(s) %s gone with it; the run goes on with %d engine(s), "
                    "their requests are sent again to the others",
                    _node_name(ip), gone, self.num_engines,
                )  # fmt: skip
            if not self.num_engines:
                raise EnginesDown(sorted(self.lost), self.weight_version)
        return new

    def _rejoin(self) -> None:
        """Start lost engines again where Ray placed their bundles anew (the node back, or a
        replacement node that joined the job's Ray); they get the current weights with the others."""
        if not self.lost:
            return
        where = self._bundle_nodes()
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for e in sorted(self.lost):
            nodes = {where.get(b) for b in self._engine_bundles[e]}
            if not nodes <= alive:
                continue  # not placed yet
            try:
                parts = self._start_engine(
                    e, self._own_slots()[e], self._model_path, self._placement, self._layout, self._log_dir
                )
                url = ray.get(parts[0].url.remote(), timeout=self.rollout_cfg.engine_startup_timeout_s)
            except Exception as err:  # the new node may be gone again: try at the next boundary
                log.warning("rollout engine %d could not start again on its new node: %s", e, err)
                continue
            self.engine_parts[e] = parts
            self.engines[e] = parts[0]
            self.clients[e].close()
            self.clients[e] = EngineClient(url, api_key=self.api_key)
            self._engine_nodes[e] = nodes
            del self.lost[e]
            self._reconnect = True
            log.warning("rollout engine %d is back at %s: %d engine(s) serve", e, url, self.num_engines)

    def _abandon_threads(self) -> None:
        """Requests to a node that lost power hang until their HTTP timeout: leave their threads
        behind in the old pool and send from a new one."""
        old = self._threads
        self._threads = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.clients)))
        old.shutdown(wait=False)

    # ------------------------------------------------------------ generation

    @contextmanager
    def restarts_deferred(self) -> Iterator[None]:
        """In this thread, engines found dead are marked down, not restarted (see the module doc)."""
        self._deferred.on = True
        try:
            yield
        finally:
            self._deferred.on = False

    def _deferring(self) -> bool:
        return getattr(self._deferred, "on", False)

    def generate(
        self, requests: Sequence[Request], done: Callable[[int, list[dict]], None] | None = None
    ) -> list[list[dict]]:
        """A ``generation.Send``: bring engines known to be down back first (no round trip when none is), then ``send``."""
        self.ensure_engines()
        return self.send(requests, done)

    def _name_the_silent(self, silent: Silence, waiting_on: list[EngineClient]) -> None:
        """A warning naming who has not answered a request for ``SILENT_S`` and more (once per
        ``SILENT_S``) nor its /health now, with their logs, long before the client's read timeout
        ends the wait. A long generation answers /health meanwhile: it is not named."""
        distinct = list({c.base_url: c for c in waiting_on}.values())
        mute = {
            c.base_url for c, ok in zip(distinct, self._health_threads.map(lambda c: c.health(), distinct)) if not ok
        }
        if not mute:
            return
        counts = Counter(c.base_url for c in waiting_on if c.base_url in mute)
        logs = dict(zip((c.base_url for c in self.clients), getattr(self, "engine_logs", [])))
        named = ", ".join(
            f"{url} ({n} request(s){f', log {logs[url]}' if url in logs else ''})" for url, n in sorted(counts.items())
        )
        log.warning(
            "no answer for %.0f s from %s: stopped (SIGSTOP), hung or out of memory? the wait ends at the "
            "client's %.0f s timeout", silent.for_s(), named, max(c.timeout_s for c in waiting_on),
        )  # fmt: skip

    def _targets(self) -> list[EngineClient]:
        """Where requests go: the router, or the engines not marked down."""
        if self.router_client is not None and not self.down and not self._router_down:
            return [self.router_client]
        return [c for e, c in enumerate(self.clients) if e not in self.down and e not in self.lost]

    def send(
        self,
        requests: Sequence[Any],
        done: Callable[[int, Any], None] | None = None,
        call: Callable[[EngineClient, Any], Any] | None = None,
        first: int = 0,
    ) -> list[Any]:
        """Send request c to engine ``first`` + c (or its ``affinity``) mod the engine count (or to
        the router), all at once; the answers in request order. Requests that failed on an engine
        found dead are sent again once it is back on the current weights, or (``restarts_deferred``)
        to the healthy engines (an episode's turns then keep to the engine its affinity picks among
        those left); ``done(c, answer)`` runs as request c succeeds, once. ``call(client, request)``:
        what a request is (default: a /generate of a ``rlhpc.wire.request.Request``; the reward engines'
        scoring passes its own). ``first``: where request 0 goes (a caller sending one request at a
        time rotates it)."""

        def target(c: int, targets: list[EngineClient]) -> EngineClient:
            affinity = getattr(requests[c], "affinity", None)  # an episode's turns: one engine while it lives
            return targets[(first + c if affinity is None else affinity) % len(targets)]

        def request(c: int, targets: list[EngineClient]) -> Any:
            r = requests[c]
            if call is not None:
                return call(target(c, targets), r)
            return target(c, targets).generate(
                input_ids=r.input_ids, sampling_params=r.sampling_params, return_logprob=r.return_logprob
            )

        answers: list[Any] = [[] for _ in requests]
        pending = list(range(len(requests)))
        while pending:
            targets = self._targets()
            futures = {self._threads.submit(request, c, targets): c for c in pending}
            failed: list[int] = []
            error: EngineUnavailable | None = None
            lost_before = len(self.lost)
            waiting, checked = set(futures), time.monotonic()
            silent = Silence(time.monotonic())
            while waiting:
                finished, waiting = wait(waiting, timeout=NODE_CHECK_S, return_when=FIRST_COMPLETED)
                if finished:
                    silent.answered()
                elif silent.due():  # an engine stopped (SIGSTOP), hung or swapping answers nothing, says nothing
                    self._name_the_silent(silent, [target(futures[f], targets) for f in waiting])
                for fut in finished:
                    if self.stop is not None and self.stop.requested:
                        self._abort(futures)
                    c = futures[fut]
                    try:
                        answers[c] = fut.result()
                    except EngineUnavailable as e:  # maybe a dead engine: decided once all have answered
                        failed.append(c)
                        error = e
                        continue
                    if done is not None:
                        done(c, answers[c])
                if not waiting or time.monotonic() - checked < NODE_CHECK_S:
                    continue
                checked = time.monotonic()
                if self.check_nodes():  # their requests will never be answered
                    gone_clients = {id(self.clients[e]) for e in self.lost}
                    gone = {f for f in waiting if id(target(futures[f], targets)) in gone_clients}
                    failed += [futures[f] for f in gone]
                    waiting -= gone
                    self._abandon_threads()
            if failed:
                # Nothing is in flight now, so re-syncing (which pauses every engine) loses nothing.
                self.check_nodes()
                if self._deferring():
                    # every engine and the router answer, none was lost with its node, and none was
                    # restarted (a partial-rollout push restarts dead ones beside generation) since
                    # these were sent: a real error
                    marked = self._mark_down()
                    if not marked and len(self.lost) == lost_before and targets == self._targets():
                        raise error
                    where = "the healthy engine(s)"
                else:
                    router = self.router_client
                    dead = self._restart_dead()  # may find more engines gone with their node
                    if not dead and len(self.lost) == lost_before and self.router_client is router:
                        raise error  # nothing was down: a real error
                    if dead:
                        self._resync()
                    where = "the restarted engine(s)" if dead else "the remaining engine(s)"
                log.warning("sending %d generation request(s) again to %s", len(failed), where)
            pending = sorted(failed)
        return answers

    def _abort(self, futures: dict[Future, int]) -> None:
        """Cut generation short: the engines drop what is in flight, pending requests are dropped."""
        for fut in futures:
            fut.cancel()
        for client in self.clients:
            try:
                client.abort_request(abort_all=True)
            except Exception as e:  # an engine already gone has nothing to abort
                log.debug("abort on %s: %s", client.base_url, e)
        raise GenerationAborted()

    # ------------------------------------------------------------ weights and engine restarts

    def connect_weights(self, source: WeightSource) -> None:
        """Open the weight-sync channel from ``source`` (the actor) to every engine; ``source`` is
        also how a restarted engine gets the current weights back."""
        if self.frozen:
            raise RlhpcError(f"connect_weights on the {self.role} engines", "the model is frozen: push nothing to it")
        self._weights = source
        live = [e for e in range(len(self.clients)) if e not in self.lost]  # a lost engine cannot join the group
        source.connect_rollout(
            [self.clients[e].base_url for e in live],
            [self.engine_world_sizes[e] for e in live],
            self.cluster_cfg.colocate,
            str(self.key_file),
        )
        self._reconnect = False

    def push_ready(self) -> bool:
        """Whether ``sync_weights`` would go straight to the push (no engine to restart or start
        again, no channel to reopen): then the source may push ahead of it, with training."""
        return self._weights is not None and not (self.down or self._router_down or self.lost or self._reconnect)

    def sync_weights(self, version: int) -> None:
        """Push the source's current weights to every engine as ``version`` (restarting those known to
        be down first; one that died unnoticed fails the push, which restarts it and pushes again)."""
        if self._weights is None:
            raise RlhpcError(
                "sync_weights before connect_weights", "call connect_weights(actor) once the engines are up"
            )
        if self.down or self._router_down:
            self._restart_dead()
        self._rejoin()  # a rollout boundary: engines lost with a node start again where it came back
        if self._reconnect:
            self.connect_weights(self._weights)
        self._push(version)
        self.weight_version = version

    def _push(self, version: int) -> None:
        """Push ``version``; engines that died during the push are restarted and the push repeated
        (bounded: each repeat restarts at least one engine, at most max_engine_restarts each)."""
        while True:
            try:
                self._weights.update_weights(version)
                return
            except WeightPushFailed as e:
                lost_before = len(self.lost)
                if not self._restart_dead() and len(self.lost) == lost_before:  # (lost: gone with their node)
                    raise  # every engine answers: a refusal, not a death
                log.warning("weight push %d: engine died during the push; pushing again (%s)", version, e.problem)
                self.connect_weights(self._weights)

    def ensure_engines(self) -> None:
        """Before generating, without a round trip: restart the engines marked down (by a generation
        with ``restarts_deferred``) and bring them to the current weights. With ``restarts_deferred``:
        leave them down, raise ``EnginesDown`` if none is left. Deaths nobody has seen yet show as
        failed requests (``send``), which are handled there."""
        # Ray's node table at most every NODE_CHECK_S, not every step (it was ~5% of a tiny step):
        # a death seen later is seen by the generation's own check or by a failed request.
        if time.monotonic() - self._nodes_checked >= NODE_CHECK_S:
            self.check_nodes()
        if self._deferring():
            if len(self.down) == len(self.clients):
                raise EnginesDown(sorted(self.down), self.weight_version)
        elif self.down or self._router_down or self._reconnect:
            if self._restart_dead() or self._reconnect:
                self._resync()

    def _dead(self) -> list[int]:
        healthy = list(self._health_threads.map(lambda c: c.health(), self.clients))
        return [e for e, ok in enumerate(healthy) if not ok and e not in self.lost]

    def _mark_down(self) -> bool:
        """Mark the engines (and the router) that do not answer as down, without restarting them;
        whether any was newly marked. No engine left: ``EnginesDown``."""
        new = sorted(set(self._dead()) - self.down)
        if new:
            log.warning(
                "rollout engine(s) %s down during generation: restarted between rollouts, "
                "their requests go to the others meanwhile",
                new,
            )
        self.down.update(new)
        router_died = self.router_client is not None and not self._router_down and not self.router_client.health()
        if router_died:
            log.warning("the router is down during generation: restarted between rollouts, engines used directly")
            self._router_down = True
        if len(self.down) + len(self.lost) == len(self.clients):
            raise EnginesDown(sorted(self.down | self.lost.keys()), self.weight_version)
        return bool(new) or router_died

    def _restart_dead(self) -> list[int]:
        """Restart every engine that does not answer /health (and the router); returns their indices.
        Engines whose node Ray declared dead are marked lost first, not restarted."""
        self.check_nodes()
        dead = self._dead()
        for e in list(dead):
            try:
                self._restart(e)
            except RlhpcError:
                if e not in self.lost and (e not in self.check_nodes()):
                    raise
                dead.remove(e)  # gone with its node: left out until the node (or a replacement) is back
        self.down.clear()  # those that answered came back by themselves, the others were restarted
        if self.router is not None:
            if not self.router_client.health():
                self._restart_router()
            elif dead:  # the router knows engines by URL, and a restarted engine has a new one
                self.router_client = EngineClient(self.router.start(self.engine_urls), api_key=self.api_key)
            self._router_down = False
        return dead

    def _restart_router(self) -> None:
        """Start the router again after it died, at most ``rollout.max_engine_restarts`` times."""
        limit, log_file = self.rollout_cfg.max_engine_restarts, self.router.log_path
        if self.router_restarts >= limit:
            raise RlhpcError(
                f"the sglang router ({self.router_client.base_url}) died or stopped answering /health after "
                f"{self.router_restarts} restart(s), the most rollout.max_engine_restarts = {limit} allows; "
                f"its log {log_file} ends with:\n{tail(Path(log_file), 15)}",
                f"read {log_file} for why it stopped; set rollout.sglang.router: false to send requests to "
                "the engines directly, or raise rollout.max_engine_restarts if such failures are transient",
            )
        self.router_restarts += 1
        log.warning(
            "the sglang router is down; restart %d of at most %d (log %s)", self.router_restarts, limit, log_file
        )
        self.router_client.close()
        self.router_client = EngineClient(self.router.start(self.engine_urls), api_key=self.api_key)

    def _restart(self, e: int) -> None:
        limit, log_file = self.rollout_cfg.max_engine_restarts, self.engine_logs[e]
        if self.restarts[e] >= limit:
            raise RlhpcError(
                f"{self.role} engine {e} ({self.clients[e].base_url}) died or stopped answering /health after "
                f"{self.restarts[e]} restart(s), the most rollout.max_engine_restarts = {limit} allows; "
                f"its log {log_file} ends with:\n{tail(Path(log_file), 15)}",
                f"read {log_file} for why the server stopped (out of memory, a crash, a lost GPU); "
                "raise rollout.max_engine_restarts if such failures are transient",
            )
        self.restarts[e] += 1
        log.warning(
            "%s engine %d (%s) is down; restart %d of at most %d (log %s)",
            self.role,
            e,
            self.clients[e].base_url,
            self.restarts[e],
            limit,
            log_file,
        )
        parts = self.engine_parts[e]
        try:
            url = ray.get(parts[0].restart.remote()) if len(parts) == 1 else self._start_parts(parts)
        except ray.exceptions.RayActorError as err:  # the actor itself is gone (its node, most likely)
            raise RlhpcError(
                f"{self.role} engine {e}'s Ray actor died, so its server cannot be restarted: {err}",
                "check that the engine's node is still up; the job can resume from the last checkpoint",
            ) from err
        self.clients[e].close()
        self.clients[e] = EngineClient(url, api_key=self.api_key)
        self._reconnect = True  # the old weight-sync group is gone with the server
        log.warning("%s engine %d is back at %s", self.role, e, url)

    def _resync(self) -> None:
        """Open the weight-sync channel again (all engines share one group) and push the current version."""
        if self._weights is None:
            return  # never connected: every engine serves the weights on disk, as the restarted one does
        self.connect_weights(self._weights)
        if self.weight_version is not None:
            self._push(self.weight_version)
            log.info("engines re-synced to weight version %d", self.weight_version)

    def _on_engines(self, fn: Callable[[EngineClient], Any], again_on_restarted: bool) -> None:
        """Run fn on every engine; restart engines that turn out dead (``again_on_restarted``: run fn on
        them too). Their weights are brought back by the next sync_weights."""
        futures = {e: self._threads.submit(fn, c) for e, c in enumerate(self.clients) if e not in self.lost}
        failed: dict[int, EngineUnavailable] = {}
        for e, f in futures.items():
            try:
                f.result()
            except EngineUnavailable as err:
                failed[e] = err
        if not failed:
            return
        restarted = self._restart_dead()
        for e, err in failed.items():
            if e not in restarted and e not in self.lost:
                raise err
        if again_on_restarted:
            for e in restarted:
                fn(self.clients[e])

    # ------------------------------------------------------------ memory and lifecycle

    def offload(self) -> None:
        """Free engine weights and KV cache (for the actor's turn on shared GPUs)."""
        self._on_engines(lambda c: c.release_memory_occupation(), again_on_restarted=True)

    def onload(self) -> None:
        self._on_engines(lambda c: c.resume_memory_occupation(), again_on_restarted=False)  # a new engine is resident

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._health_threads.shutdown(wait=False, cancel_futures=True)
        if self.router is not None:
            self.router.stop()
        for engine in (a for parts in self.engine_parts for a in parts):
            try:
                ray.get(engine.shutdown.remote(), timeout=30)
            except Exception as e:  # a dead engine has nothing left to stop
                log.debug("engine shutdown: %s", e)
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)


def _node_name(ip: str) -> str:
    """``name (ip)`` when the IP has a name (/etc/hosts on clusters), else the IP."""
    import socket

    try:
        return f"{socket.gethostbyaddr(ip)[0]} ({ip})"
    except OSError:
        return ip
