"""The engine set's lifecycle: the engines' Ray actors and servers, their clients, the router,
and the bounded restarts of each. No health policy and no weights: ``Health`` decides when an
engine is restarted, ``rlhpc.rollout.weight_sync`` what it holds afterwards."""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import ray

from rlhpc.config import startup_timeout_s
from rlhpc.engine_server.host import EngineActor
from rlhpc.engine_server.sglang import Router, engine_parts
from rlhpc.errors import RlhpcError
from rlhpc.model import weight_bytes
from rlhpc.rollout.engines.fleet import FleetFile
from rlhpc.util.files import tail
from rlhpc.wire.client import EngineClient
from rlhpc.wire.engine_key import new_key, read_key
from rlhpc.wire.lora import POLICY_ADAPTER, LoraServing

if TYPE_CHECKING:
    from rlhpc.cluster.layout import Layout
    from rlhpc.cluster.placement import Placement
    from rlhpc.config import ClusterConfig, RolloutConfig

log = logging.getLogger(__name__)

# Share of a GPU an engine takes when it sits beside an actor rank (colocate).
COLOCATED_ENGINE_GPU = 0.2


class EngineSet:
    """One group of engines on their slots: started by ``start``, restarted one by one.

    ``frozen``: the reward (or, ``role`` "teacher", the teacher's) engines (``layout.reward_slots``,
    ``layout.teacher_slots``), on GPUs of their own, never given weights: a restarted one serves
    the model on disk, as the others do. ``key_file``: where the engine key is written
    (``RunDir.engine_key``); None: a private temp dir. ``deterministic`` (the run's): every engine
    honours its requests' seeds (SGLang's --enable-deterministic-inference). ``routed_experts``
    (algo.routing_replay): every engine answers each token's experts (--enable-return-routed-experts).
    Nothing starts before ``start``. ``fleet`` (a run on a shared fleet, ``rollout.fleet``): the
    fleet file of engines already up, which ``start`` attaches to, serving the run's adapter under
    ``adapter_name``; the fleet's owner restarts and stops them, this set never does.
    """

    def __init__(
        self,
        rollout: RolloutConfig,
        cluster: ClusterConfig,
        seed: int,
        model_path: str,
        placement: Placement,
        layout: Layout,
        log_dir: Path,
        key_file: Path | None = None,
        frozen: bool = False,
        role: str = "reward",
        deterministic: bool = False,
        lora: LoraServing | None = None,
        routed_experts: bool = False,
        fleet: str | None = None,
        adapter_name: str = POLICY_ADAPTER,
    ):
        self.frozen, self.deterministic = frozen, deterministic
        self.fleet, self.adapter_name = fleet, adapter_name
        self.routed_experts = routed_experts
        # the trained engines serving the run's adapter (actor.lora.push: adapter): every request names it
        self.lora = lora
        self.role = role if frozen else "rollout"
        self.rollout_cfg, self.cluster_cfg, self.seed = rollout, cluster, seed
        self.model_path, self.placement, self.layout, self.log_dir = model_path, placement, layout, log_dir
        # rollout.engine_startup_timeout_s, or its formula for this model's size
        self.startup_timeout_s = startup_timeout_s(rollout, weight_bytes(model_path))
        self._key_dir = None if key_file is not None else Path(tempfile.mkdtemp(prefix="rlhpc-engine-key-"))
        self.key_file = Path(key_file) if key_file is not None else self._key_dir / "engine_key"
        self.api_key = ""
        self.engine_host: str | None = None
        self.engine_parts: list[list[ray.actor.ActorHandle]] = []  # per engine, one actor per node it spans
        self.clients: list[EngineClient] = []
        self.engine_logs: list[str] = []
        self.engine_world_sizes: list[int] = []
        self.restarts: list[int] = []  # per engine, bounded by rollout.max_engine_restarts
        self.router: Router | None = None
        self.router_client: EngineClient | None = None  # generation goes through it when set
        self.router_restarts = 0  # after it died, bounded by rollout.max_engine_restarts
        self.released: set[int] = set()  # engines whose memory is released (offloaded), until resumed

    def start(self) -> None:
        """A new engine key, every engine's server (and the router), up and answering."""
        if self.fleet is not None:
            self._attach(FleetFile.read(self.fleet))
            return
        self.api_key = new_key(self.key_file)  # a new one at every start of the job
        here = ray.util.get_node_ip_address()
        # Loopback when every engine and actor rank is on the driver's node (the embedded default).
        local = all(ip == here for ip, _ in self.placement.location_of_slot)
        self.engine_host = "127.0.0.1" if local else None
        self.engine_world_sizes = [len(slots) for slots in self.slots()]
        self.engine_parts = [self.start_engine(e) for e in range(len(self.slots()))]
        urls = ray.get([parts[0].url.remote() for parts in self.engine_parts])
        self.clients = [self.client(url) for url in urls]
        self.engine_logs = ray.get([parts[0].log_file.remote() for parts in self.engine_parts])
        self.restarts = [0] * len(self.clients)
        log.info("%s engines up: %s", self.role, ", ".join(urls))
        if self.rollout_cfg.sglang.router:  # CPU engines too: the real router sits in every loop
            self.router = Router("127.0.0.1", self.log_dir / "router.log", 60.0, self.key_file)
            self.route_again(urls)

    def _attach(self, fleet: FleetFile) -> None:
        """The shared fleet's engines, as they are: their key, their clients, no actors of ours.
        Requests go to the engines directly (the fan-out spreads them), not through a router."""
        self.key_file = Path(fleet.key_file)
        self.api_key = read_key(self.key_file)
        self.engine_world_sizes = [1] * len(fleet.engines)
        self.clients = [self.client(url) for url in fleet.engines]
        self.engine_logs = list(fleet.logs)
        self.restarts = [0] * len(self.clients)
        log.info("attached to the shared fleet %s: %s (adapter %s)", self.fleet, ", ".join(fleet.engines), self.adapter)

    def client(self, url: str) -> EngineClient:
        """An engine's client. With the router, batches go to the engine one prompt per request
        too (as the router takes them), so a sample is computed alike whichever way it goes."""
        return EngineClient(url, api_key=self.api_key, per_prompt=self.rollout_cfg.sglang.router, adapter=self.adapter)

    @property
    def adapter(self) -> str | None:
        return self.adapter_name if self.lora is not None else None

    @property
    def engines(self) -> list[ray.actor.ActorHandle]:
        """Each engine's actor on node rank 0 (the one serving HTTP)."""
        return [parts[0] for parts in self.engine_parts]

    @property
    def engine_urls(self) -> list[str]:
        return [c.base_url for c in self.clients]

    def slots(self) -> tuple[tuple[int, ...], ...]:
        """The slots of each engine of this set: the rollout engines', or the reward or teacher engines'."""
        if not self.frozen:
            return self.layout.engine_slots
        return self.layout.teacher_slots if self.role == "teacher" else self.layout.reward_slots

    def start_engine(self, e: int) -> list[ray.actor.ActorHandle]:
        """Create engine e's actor(s); they start their servers (an engine over nodes: all at once)."""
        r, slots = self.rollout_cfg, self.slots()[e]
        gpu = COLOCATED_ENGINE_GPU if self.layout.colocate and not self.frozen else 1
        if r.backend == "cpu":
            parts = [(slots[0], None)]
        else:
            memory_saver = not self.frozen and (self.cluster_cfg.colocate or self.cluster_cfg.offload)
            parts = engine_parts(
                slots, self.placement.location_of_slot, r.sglang.mem_fraction_static, memory_saver, self.seed,
                r.sglang.extra_args, self.deterministic, self.layout.colocate and not self.frozen, self.lora,
                self.routed_experts,
            )  # fmt: skip
        multi = len(parts) > 1
        strategy = self.placement.strategy
        actors = [
            EngineActor.options(num_gpus=gpu, num_cpus=0.5, scheduling_strategy=strategy(slot)).remote(
                self.model_path,
                str(self.log_dir),
                e,
                self.startup_timeout_s,
                None,
                spec,
                not multi,
                key_file=str(self.key_file),
                host=self.engine_host,
                deterministic=self.deterministic,
                lora=self.lora if r.backend == "cpu" else None,  # SGLang's comes in its spec
                routed_experts=self.routed_experts,
            )  # fmt: skip
            for slot, spec in parts
        ]
        if multi:
            start_parts(actors)
        return actors

    def replace(self, e: int, parts: list[ray.actor.ActorHandle], url: str) -> None:
        """Engine e is now ``parts``, serving at ``url`` (started again on another node): a new
        server, with its memory resident."""
        self.released.discard(e)
        self.engine_parts[e] = parts
        self.clients[e].close()
        self.clients[e] = self.client(url)

    def restart(self, e: int) -> None:
        """Restart engine e's server in its actor(s), at most ``rollout.max_engine_restarts`` times."""
        limit, log_file, url = self.rollout_cfg.max_engine_restarts, self.engine_logs[e], self.clients[e].base_url
        if self.fleet is not None:
            raise RlhpcError(
                f"engine {e} ({url}) of the shared fleet {self.fleet} died or stopped answering /health; "
                f"its log {log_file} ends with:\n{tail(Path(log_file), 15)}",
                "the fleet's owner (the sweep) holds its engines: read the log, then resubmit the sweep, "
                "which resumes each unfinished run from its last checkpoint",
            )
        if self.restarts[e] >= limit:
            raise RlhpcError(
                f"{self.role} engine {e} ({url}) died or stopped answering /health after "
                f"{self.restarts[e]} restart(s), the most rollout.max_engine_restarts = {limit} allows; "
                f"its log {log_file} ends with:\n{tail(Path(log_file), 15)}",
                f"read {log_file} for why the server stopped (out of memory, a crash, a lost GPU); "
                "raise rollout.max_engine_restarts if such failures are transient",
            )
        self.restarts[e] += 1
        log.warning(
            "%s engine %d (%s) is down; restart %d of at most %d (log %s)",
            self.role, e, url, self.restarts[e], limit, log_file,
        )  # fmt: skip
        parts = self.engine_parts[e]
        try:
            url = ray.get(parts[0].restart.remote()) if len(parts) == 1 else start_parts(parts)
        except ray.exceptions.RayActorError as err:  # the actor itself is gone (its node, most likely)
            raise RlhpcError(
                f"{self.role} engine {e}'s Ray actor died, so its server cannot be restarted: {err}",
                "check that the engine's node is still up; the job can resume from the last checkpoint",
            ) from err
        self.replace(e, parts, url)
        log.warning("%s engine %d is back at %s", self.role, e, url)

    def restart_router(self, urls: list[str]) -> None:
        """Start the router again after it died (over ``urls``), at most ``rollout.max_engine_restarts`` times."""
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
        self.route_again(urls)

    def route_again(self, urls: list[str]) -> None:
        """The router (started again) over the engines serving at ``urls`` now: a restarted engine
        has a new URL, and one lost with its node must not be routed to."""
        if self.router_client is not None:
            self.router_client.close()
        self.router_client = EngineClient(
            self.router.start(urls), api_key=self.api_key, router=True, adapter=self.adapter
        )

    def shutdown(self) -> None:
        if self.fleet is not None:  # the fleet's owner stops its engines (and unloads the run's adapter)
            for c in self.clients:
                c.close()
        if self.router is not None:
            self.router.stop()
        if self.router_client is not None:
            self.router_client.close()
        for engine in (a for parts in self.engine_parts for a in parts):
            try:
                ray.get(engine.shutdown.remote(), timeout=30)
            except Exception as e:  # a dead engine has nothing left to stop
                log.debug("engine shutdown: %s", e)
        if self._key_dir is not None:
            shutil.rmtree(self._key_dir, ignore_errors=True)


def start_parts(actors: list[ray.actor.ActorHandle]) -> str:
    """Start every node's part of one engine together (node rank 0 waits for the others)."""
    addr = ray.get(actors[0].reserve_dist_init_addr.remote())
    return ray.get([a.start.remote(addr) for a in actors])[0]
