"""The engines' health: which engine serves, and what to do about one that does not.

An engine is in one of four states: serving; down (found dead by a generation that may not
restart it, ``restarts_deferred``: served by none until the next restart point); restarted (by
``restart_dead``, on the same node); or lost (its node was declared dead by Ray: left out, also
of the weight-sync group, until its bundles are placed on a live node again, ``rejoin``). The
router can be down too. ``changed`` says an engine came back, was restarted or was lost since
the weight channel was opened (``rlhpc.rollout.weight_sync`` opens it again).

/health is asked only after a failure, never before every generation (SGLang's /health is
itself a generation that waits at least a second, unless switched off as rlhpc switches it off
on every engine: ``rlhpc.engine_server.sglang.ENGINE_SWITCHES``).
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import ray

from rlhpc.errors import RlhpcError
from rlhpc.wire.request import EnginesDown

if TYPE_CHECKING:
    from rlhpc.rollout.engines.engine_set import EngineSet
    from rlhpc.wire.client import EngineClient

log = logging.getLogger(__name__)

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


class Health:
    """The state of each engine of ``engines`` (and of its router), node loss, and restarts."""

    def __init__(self, engines: EngineSet):
        self.engines = engines
        self.down: set[int] = set()
        self.router_down = False
        self.lost: dict[int, str] = {}  # engine -> the IP of its node Ray declared dead
        self.changed = False  # an engine came back or was lost since the weight channel was opened
        self.nodes_checked = -NODE_CHECK_S  # monotonic time of the last node-table query
        # Health checks of their own: with partial rollouts the main thread checks the engines
        # before a push while the generation's requests fill the send's threads.
        self.threads = ThreadPoolExecutor(max_workers=max(2, len(engines.clients)))
        self.engine_nodes: list[set[str | None]] = []  # the Ray nodes each engine is placed on
        self.actor_nodes: set[str | None] = set()

    def locate(self) -> None:
        """Where the engines and the actor ranks are placed now (once the engines are up)."""
        placement, where = self.engines.placement, self.bundle_nodes()
        self.engine_nodes = [{where.get(placement.bundle_of_slot[s]) for s in slots} for slots in self.engines.slots()]
        self.actor_nodes = {where.get(placement.bundle_of_slot[s]) for s in self.engines.layout.actor_slots}

    @property
    def num_engines(self) -> int:
        """Engines serving now (those lost with their node do not count)."""
        return len(self.engines.clients) - len(self.lost)

    def serving(self) -> list[EngineClient]:
        """The engines neither marked down nor lost with their node."""
        return [c for e, c in enumerate(self.engines.clients) if e not in self.down and e not in self.lost]

    def targets(self) -> list[EngineClient]:
        """Where requests go: the router while it routes to exactly the engines serving, else those
        engines (until the next ``restart_dead`` or ``rejoin`` routes it over them again)."""
        s, serving = self.engines, self.serving()
        routed = s.router is not None and s.router.worker_urls == [c.base_url for c in serving]
        if s.router_client is not None and not self.router_down and routed:
            return [s.router_client]
        return serving

    def reroute(self) -> None:
        """The router over the engines serving now: started again if it died (bounded), or if an
        engine was restarted (a new URL), lost or is back since it was started."""
        s = self.engines
        if s.router is None:
            return
        urls = [c.base_url for c in self.serving()]
        if not urls:  # none to route to: generation raises EnginesDown
            return
        if not s.router_client.health():
            s.restart_router(urls)
        elif s.router.worker_urls != urls:
            s.route_again(urls)
        self.router_down = False

    def all_well(self) -> bool:
        """Nothing to restart, start again or reconnect."""
        return not (self.down or self.router_down or self.lost or self.changed)

    # ------------------------------------------------------------ node loss

    def bundle_nodes(self) -> dict[int, str]:
        """Placement-group bundle -> the Ray node id it is placed on now (absent while unplaced)."""
        table = ray.util.placement_group_table(self.engines.placement.pg)
        return {int(b): n for b, n in table.get("bundles_to_node_id", {}).items() if n}

    @staticmethod
    def dead_ray_nodes() -> dict[str, str]:
        """Ray node id -> IP of every node Ray declared dead."""
        return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if not n.get("Alive")}

    def check_nodes_due(self) -> None:
        """``check_nodes`` at most every NODE_CHECK_S (Ray's node table was ~5% of a tiny step):
        a death seen later is seen by the generation's own check or by a failed request."""
        if time.monotonic() - self.nodes_checked >= NODE_CHECK_S:
            self.check_nodes()

    def check_nodes(self) -> list[int]:
        """Mark the engines whose node Ray declared dead as lost; returns the newly lost ones.
        A dead node that holds actor ranks raises ``NodeLost``: the run cannot go on without them."""
        self.nodes_checked = time.monotonic()
        dead = self.dead_ray_nodes()
        if not dead:
            return []
        actor_lost = sorted({dead[n] for n in self.actor_nodes if n in dead})
        if actor_lost:
            raise NodeLost(actor_lost)
        new = [e for e, nodes in enumerate(self.engine_nodes) if e not in self.lost and nodes & dead.keys()]
        for e in new:
            self.lost[e] = dead[next(iter(self.engine_nodes[e] & dead.keys()))]
            self.down.discard(e)
        if new:
            self.changed = True  # the weight-sync group is formed again without them
            for ip in sorted({self.lost[e] for e in new}):
                gone = [e for e in new if self.lost[e] == ip]
                log.warning(
                    "node %s is lost: rollout engine(s) %s gone with it; the run goes on with %d engine(s), "
                    "their requests are sent again to the others",
                    node_name(ip), gone, self.num_engines,
                )  # fmt: skip
            if not self.num_engines:
                raise EnginesDown(sorted(self.lost))
        return new

    def rejoin(self) -> None:
        """Start the engines lost with their node again where their bundles are placed now (Ray
        re-places a dead node's bundles on a new or returned node); those not placed yet wait."""
        if not self.lost:
            return
        s, where = self.engines, self.bundle_nodes()
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        for e in sorted(self.lost):
            nodes = {where.get(s.placement.bundle_of_slot[slot]) for slot in s.slots()[e]}
            if not nodes <= alive:
                continue  # not placed yet
            try:
                parts = s.start_engine(e)
                url = ray.get(parts[0].url.remote(), timeout=s.startup_timeout_s)
            except Exception as err:  # the new node may be gone again: try at the next boundary
                log.warning("rollout engine %d could not start again on its new node: %s", e, err)
                continue
            s.replace(e, parts, url)
            self.engine_nodes[e] = nodes
            del self.lost[e]
            self.changed = True
            log.warning("rollout engine %d is back at %s: %d engine(s) serve", e, url, self.num_engines)
        self.reroute()

    # ------------------------------------------------------------ dead engines

    def dead(self) -> list[int]:
        """The engines (not lost) that do not answer /health now."""
        healthy = list(self.threads.map(lambda c: c.health(), self.engines.clients))
        return [e for e, ok in enumerate(healthy) if not ok and e not in self.lost]

    def mark_down(self) -> bool:
        """Mark the engines (and the router) that do not answer as down, without restarting them;
        whether any was newly marked. No engine left: ``EnginesDown``."""
        s = self.engines
        new = sorted(set(self.dead()) - self.down)
        if new:
            log.warning(
                "rollout engine(s) %s down during generation: restarted between rollouts, "
                "their requests go to the others meanwhile",
                new,
            )
        self.down.update(new)
        router_died = s.router_client is not None and not self.router_down and not s.router_client.health()
        if router_died:
            log.warning("the router is down during generation: restarted between rollouts, engines used directly")
            self.router_down = True
        if len(self.down) + len(self.lost) == len(s.clients):
            raise EnginesDown(sorted(self.down | self.lost.keys()))
        return bool(new) or router_died

    def restart_dead(self) -> list[int]:
        """Restart every engine that does not answer /health (and the router); returns their indices.
        Engines whose node Ray declared dead are marked lost first, not restarted."""
        s = self.engines
        self.check_nodes()
        dead = self.dead()
        for e in list(dead):
            try:
                s.restart(e)
            except RlhpcError:
                if e not in self.lost and (e not in self.check_nodes()):
                    raise
                dead.remove(e)  # gone with its node: left out until the node (or a replacement) is back
            else:
                self.changed = True  # the old weight-sync group is gone with the server
        self.down.clear()  # those that answered came back by themselves, the others were restarted
        self.reroute()  # the router knows engines by URL, and a restarted engine has a new one
        return dead

    def name_the_silent(self, silent: Silence, waiting_on: list[EngineClient]) -> None:
        """A warning naming who has not answered a request for ``SILENT_S`` and more (once per
        ``SILENT_S``) nor its /health now, with their logs, long before the client's read timeout
        ends the wait. A long generation answers /health meanwhile: it is not named."""
        distinct = list({c.base_url: c for c in waiting_on}.values())
        behind = [c for c in self.serving() if c.base_url not in {d.base_url for d in distinct}]
        if any(c.router for c in distinct):  # the router answers for itself: ask its engines too
            distinct += behind
        mute = {c.base_url for c, ok in zip(distinct, self.threads.map(lambda c: c.health(), distinct)) if not ok}
        if not mute:
            return
        counts = Counter(c.base_url for c in waiting_on if c.base_url in mute)
        logs = dict(zip(self.engines.engine_urls, self.engines.engine_logs))
        named = ", ".join(
            f"{url} ({f'{counts[url]} request(s)' if url in counts else 'behind the router'}"
            f"{f', log {logs[url]}' if url in logs else ''})"
            for url in sorted(mute)
        )
        log.warning(
            "no answer for %.0f s from %s: stopped (SIGSTOP), hung or out of memory? the wait ends at the "
            "request's read timeout (a /generate's: rollout.generate_timeout_s)", silent.for_s(), named,
        )  # fmt: skip

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)


def node_name(ip: str) -> str:
    """``name (ip)`` when the IP has a name (/etc/hosts on clusters), else the IP."""
    try:
        return f"{socket.gethostbyaddr(ip)[0]} ({ip})"
    except OSError:
        return ip
