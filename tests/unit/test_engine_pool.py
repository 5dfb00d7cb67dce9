"""The engine pool's restart rules without Ray or servers: deferred restarts during async
generation (requests go to the healthy engines, no restart behind training) and the router's
restart limit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from rlhpc.config import ClusterConfig, RolloutConfig
from rlhpc.errors import RlhpcError, WeightPushFailed
from rlhpc.rollout.engines import EnginePool, EnginesDown, EngineSet, Health, NodeLost, health
from rlhpc.rollout.engines import engine_set as engine_set_module
from rlhpc.rollout.engines.health import NODE_CHECK_S
from rlhpc.rollout.generation import MAX_SAMPLES_PER_REQUEST, rows_per_request
from rlhpc.rollout.weight_sync import WeightSync
from rlhpc.wire.client import EngineUnavailable, RequestRefused
from rlhpc.wire.protocol import MEMORY_TAGS
from rlhpc.wire.request import Request


class FakeClient:
    def __init__(self, name: str, router: bool = False):
        self.base_url, self.alive, self.served = f"http://{name}", True, []
        self.router = router
        self.timeout_s = 600.0
        self.health_checks = 0
        self.powered = threading.Event()  # cleared: the node lost power, requests get no answer at all
        self.powered.set()
        self.released: set[str] = set()  # memory tags released
        self.timeouts: list[float | None] = []  # of each /generate

    def health(self) -> bool:
        self.health_checks += 1
        return self.alive and self.powered.is_set()

    def generate(self, *, input_ids, sampling_params, return_logprob, timeout_s=None) -> list[dict]:
        self.timeouts.append(timeout_s)
        self.powered.wait()
        if not self.alive:
            raise EngineUnavailable(f"{self.base_url} refused", "is it up?")
        self.served.append(input_ids[0][0])
        return [{"output_ids": [ids[0]], "meta_info": {}} for ids in input_ids]

    def close(self) -> None:
        pass

    # SGLang's memory rules (issue 40): its server dies on a resume of memory it holds, or a
    # release of memory it released (tests/unit/test_sglang_strict.py reads them in the wheel)
    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._memory(tags, lambda t: t not in self.released, self.released.add)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._memory(tags, lambda t: t in self.released, self.released.discard)

    def _memory(self, tags, allowed, change) -> None:
        if not self.alive:
            raise EngineUnavailable(f"{self.base_url} refused", "is it up?")
        for t in tags or MEMORY_TAGS:
            if not allowed(t):
                self.alive = False
                raise EngineUnavailable(f"{self.base_url} dropped the connection", "it died")
            change(t)


class FakeRouter:
    """The router process: started over engine URLs, answered by a FakeClient (``with_router``)."""

    def __init__(self, log_path: Path):
        self.log_path, self.starts, self.worker_urls = log_path, 0, []

    def start(self, urls: list[str]) -> str:
        self.starts += 1
        self.worker_urls = list(urls)
        return f"http://router-{self.starts}"


class FakeRouterClient(FakeClient):
    """The router's client: each request goes on to its engines in turn (round robin), and
    waits as long as that engine does."""

    def __init__(self, name: str, pool: EnginePool, urls: list[str]):
        super().__init__(name, router=True)
        self.pool, self.urls, self.sent = pool, urls, 0

    def generate(self, **kw) -> list[dict]:
        if not self.alive:
            raise EngineUnavailable(f"{self.base_url} refused", "is it up?")
        url, self.sent = self.urls[self.sent % len(self.urls)], self.sent + 1
        engine = next(c for c in self.pool.clients if c.base_url == url)
        self.served.append(kw["input_ids"][0][0])
        return engine.generate(**kw)


def with_router(pool: EnginePool, log_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeRouter:
    """A router in front of the pool's engines, as ``EngineSet.start`` puts it there."""
    router = pool.engine_set.router = FakeRouter(log_path)
    monkeypatch.setattr(
        engine_set_module,
        "EngineClient",
        lambda url, **kw: FakeRouterClient(url.removeprefix("http://"), pool, router.worker_urls),
    )
    pool.engine_set.route_again(pool.engine_set.engine_urls)
    return router


def bare_pool(n: int, max_restarts: int = 2, frozen: bool = False) -> EnginePool:
    """An EnginePool's parts over fake clients (no Ray, no servers): its routing and restart state."""
    engines = EngineSet(
        RolloutConfig(max_engine_restarts=max_restarts), ClusterConfig(), 0, "model", None, None, Path("/logs"),
        key_file=Path("key"), frozen=frozen,
    )  # fmt: skip
    engines.api_key = "k"
    engines.clients = [FakeClient(f"e{e}") for e in range(n)]
    engines.restarts, engines.engine_world_sizes = [0] * n, [1] * n
    health = Health(engines)
    health.engine_nodes, health.actor_nodes = [{f"node-of-e{e}"} for e in range(n)], {"node-of-actor"}
    pool = EnginePool.of(engines, health)
    pool.dead_nodes: dict[str, str] = {}  # what Ray declared dead (node id -> IP)
    pool.node_queries = 0
    health.dead_ray_nodes = lambda: (setattr(pool, "node_queries", pool.node_queries + 1), pool.dead_nodes)[1]
    pool.restarted: list[int] = []
    engines.restart = lambda e: (pool.restarted.append(e), setattr(pool.clients[e], "alive", True))
    return pool


def requests(n: int) -> list[Request]:
    return [Request(input_ids=[[c]], sampling_params=[{}]) for c in range(n)]


def test_deferred_restarts_send_a_dead_engines_requests_to_the_healthy_ones():
    pool = bare_pool(2)
    pool.clients[1].alive = False
    with pool.restarts_deferred():
        answers = pool.send(requests(4))
    assert [a[0]["output_ids"] for a in answers] == [[0], [1], [2], [3]]  # all answered, in order
    assert sorted(pool.clients[0].served) == [0, 1, 2, 3] and pool.down == {1}
    assert pool.restarted == []  # no restart behind training
    with pool.restarts_deferred():
        pool.ensure_engines()  # the check before the next rollout: still down, still not restarted
    assert pool.restarted == []
    pool.health.restart_dead()  # the gap (the push on the main thread)
    assert pool.restarted == [1] and pool.down == set()


def test_a_request_with_affinity_goes_to_its_engine_and_to_a_healthy_one_when_it_died():
    """An episode's later turns: fewer requests than engines, each to its home engine, not by index."""
    pool = bare_pool(3)
    pool.send([Request(input_ids=[[c]], sampling_params=[{}], affinity=a) for c, a in ((0, 2), (1, 4))])
    assert [c.served for c in pool.clients] == [[], [1], [0]]  # 2 -> engine 2, 4 -> engine 4 mod 3
    pool.clients[2].alive = False
    with pool.restarts_deferred():
        answers = pool.send([Request(input_ids=[[7]], sampling_params=[{}], affinity=2)])
    assert answers[0][0]["output_ids"] == [7] and pool.down == {2}
    assert pool.clients[0].served == [7]  # 2 mod the two engines left -> engine 0


def test_deferred_restarts_with_no_engine_left_raise_engines_down():
    pool = bare_pool(2)
    for c in pool.clients:
        c.alive = False
    with pool.restarts_deferred(), pytest.raises(EnginesDown) as err:
        pool.send(requests(2))
    assert err.value.dead == [0, 1] and pool.restarted == []  # (the version: the weight owner's, WeightSync.generate)


def test_a_failure_on_a_healthy_engine_is_an_error_not_a_restart():
    pool = bare_pool(2)

    def broken(**kw):
        raise EngineUnavailable("500 from e0", "read its log")

    pool.clients[0].generate = broken
    with pool.restarts_deferred(), pytest.raises(EngineUnavailable, match="500 from e0"):
        pool.send(requests(2))
    assert pool.down == set()


def test_router_restarts_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    pool = bare_pool(2, max_restarts=2)
    (tmp_path / "router.log").write_text("boom: router crashed\n")
    router = with_router(pool, tmp_path / "router.log", monkeypatch)
    # a restarted engine serves at a new URL, so an engine restart moves the router too, but is
    # not the router's failure
    pool.engine_set.restart = lambda e: pool.clients.__setitem__(e, FakeClient(f"e{e}-restarted"))
    pool.clients[1].alive = False
    pool.health.restart_dead()
    assert pool.engine_set.router_restarts == 0 and router.starts == 2
    assert router.worker_urls == ["http://e0", "http://e1-restarted"]
    for n in (1, 2):
        pool.engine_set.router_client.alive = False
        pool.health.restart_dead()
        assert (
            pool.engine_set.router_restarts == n and pool.engine_set.router_client.base_url == f"http://router-{n + 2}"
        )
    pool.engine_set.router_client.alive = False
    with pytest.raises(RlhpcError) as err:
        pool.health.restart_dead()
    msg = str(err.value)
    assert "router" in msg and str(tmp_path / "router.log") in msg and "router crashed" in msg
    assert "rollout.max_engine_restarts = 2" in msg and "fix:" in msg


def test_deferred_restarts_bypass_a_dead_router(monkeypatch: pytest.MonkeyPatch):
    pool = bare_pool(2)
    with_router(pool, Path("/nonexistent/router.log"), monkeypatch)
    pool.engine_set.router_client.alive = False
    with pool.restarts_deferred():
        pool.send(requests(2))
    assert sorted(pool.clients[0].served + pool.clients[1].served) == [0, 1] and pool.engine_set.router_restarts == 0
    pool.health.restart_dead()
    assert pool.engine_set.router_restarts == 1 and pool.health.targets() == [pool.engine_set.router_client]


def test_a_request_lost_to_an_engine_restarted_beside_generation_is_sent_again():
    """Partial rollouts: the main thread's push may restart a dead engine while the generation
    thread's requests to it fail. The failure is no error: the engine set changed, so send again."""
    pool = bare_pool(2)

    class DiesThenRestarted(FakeClient):
        def generate(self, **kw) -> list[dict]:
            pool.clients[1] = FakeClient("e1-restarted")  # what the push's restart does meanwhile
            raise EngineUnavailable(f"{self.base_url} reset", "is it up?")

    pool.clients[1] = DiesThenRestarted("e1")
    with pool.restarts_deferred():
        answers = pool.send(requests(2))
    assert [a[0]["output_ids"] for a in answers] == [[0], [1]] and pool.down == set()
    assert pool.clients[1].served == [1]  # the request went to the restarted engine


class FakeSource:
    def __init__(self):
        self.connected: list[list[str]] = []

    def connect_rollout(self, engine_urls, engine_world_sizes, colocate, key_file=None) -> None:
        self.connected.append(list(engine_urls))


def test_an_engine_node_that_loses_power_mid_generation_leaves_the_run_to_the_others(monkeypatch):
    monkeypatch.setattr(health, "NODE_CHECK_S", 0.05)
    pool = bare_pool(3)
    pool.clients[1].powered.clear()  # its requests hang: no refused connection, no answer
    pool.dead_nodes = {"node-of-e1": "10.9.0.11"}  # Ray's health checks declared its node dead
    try:
        answers = pool.send(requests(6))
    finally:
        pool.clients[1].powered.set()
    assert [a[0]["output_ids"] for a in answers] == [[c] for c in range(6)]  # every request answered, in order
    assert pool.lost == {1: "10.9.0.11"} and pool.num_engines == 2
    assert sorted(pool.clients[0].served + pool.clients[2].served) == list(range(6))  # requests 1, 4 sent again
    assert pool.restarted == []  # a lost node's engine is not restarted in place
    source = FakeSource()
    WeightSync(source, pool, 0).connect()  # the weight-sync group is formed again without it
    assert source.connected == [["http://e0", "http://e2"]]


def test_requests_in_flight_through_the_router_when_an_engine_node_is_lost_go_again_to_the_others(monkeypatch):
    """Which engine serves a request is the router's secret: all it has in flight go again, to
    the engines left (directly while restarts wait, the async pipeline), and the next repair
    routes it over them."""
    monkeypatch.setattr(health, "NODE_CHECK_S", 0.05)
    pool = bare_pool(3)
    router = with_router(pool, Path("/logs/router.log"), monkeypatch)
    first = pool.engine_set.router_client
    pool.clients[1].powered.clear()  # its requests hang: no refused connection, no answer
    pool.dead_nodes = {"node-of-e1": "10.9.0.11"}
    try:
        with pool.restarts_deferred():
            answers = pool.send(requests(6))
    finally:
        pool.clients[1].powered.set()
    assert [a[0]["output_ids"] for a in answers] == [[c] for c in range(6)]
    assert pool.lost == {1: "10.9.0.11"} and sorted(first.served) == list(range(6))
    # the two the router had sent to engine 1 went again, to the engines left directly
    assert sorted(pool.clients[0].served + pool.clients[2].served) == list(range(6))
    assert pool.health.targets() == [pool.clients[0], pool.clients[2]]  # until the router is routed again
    pool.health.restart_dead()  # the next repair
    assert router.worker_urls == ["http://e0", "http://e2"] and pool.engine_set.router_restarts == 0
    assert pool.health.targets() == [pool.engine_set.router_client] != [first]


def test_a_refused_request_ends_the_send_at_once_without_restarts():
    """A 4xx is a bad request: sent again it would be refused again, and no engine is at fault."""
    pool = bare_pool(2)

    def refuses(**kw):
        raise RequestRefused("engine http://e1/generate refused prompt 0 of 1 with HTTP 400: too long", "fix it", 400)

    pool.clients[1].generate = refuses
    with pytest.raises(RequestRefused, match="too long"):
        pool.generate(requests(4))
    assert pool.restarted == [] and [c.health_checks for c in pool.clients] == [0, 0]


def declared_dead_on_restart(pool: EnginePool, e: int, ip: str) -> None:
    """Engine e's requests fail before Ray has declared its node dead; the restart that follows
    fails (its actor is gone with the node) and by then Ray has declared it."""

    def restart(k: int) -> None:
        pool.dead_nodes = {f"node-of-e{k}": ip}
        raise RlhpcError(f"rollout engine {k}'s Ray actor died", "its node may be gone")

    pool.clients[e].alive = False
    pool.engine_set.restart = restart


def test_a_node_declared_dead_while_its_failed_requests_are_handled_leaves_the_run_to_the_others():
    pool = bare_pool(2)
    declared_dead_on_restart(pool, 1, "10.9.0.12")
    answers = pool.send(requests(4))
    assert [a[0]["output_ids"] for a in answers] == [[c] for c in range(4)]
    assert pool.lost == {1: "10.9.0.12"} and sorted(pool.clients[0].served) == [0, 1, 2, 3]


def test_a_push_that_failed_on_a_node_declared_dead_meanwhile_is_repeated_without_it():
    pool = bare_pool(2)
    declared_dead_on_restart(pool, 1, "10.9.0.12")
    pushes: list[int] = []

    class Source(FakeSource):
        def update_weights(self, version: int) -> None:
            pushes.append(version)
            if len(pushes) == 1:
                raise WeightPushFailed(version, "engine http://e1 unreachable on /pause_generation")

    source = Source()
    sync = WeightSync(source, pool, 3)
    sync.connect()
    source.connected.clear()
    sync.push(4)
    assert pushes == [4, 4] and pool.lost == {1: "10.9.0.12"} and sync.version == 4
    assert source.connected == [["http://e0"]]  # the group formed again without the lost engine


class RecordingActor(FakeSource):
    """The actor group's push calls, recorded: a push whose version is in ``fail`` fails once."""

    def __init__(self, fail: set[int] = frozenset()):
        super().__init__()
        self.fail, self.pushes, self.trained = set(fail), [], []

    def train(self, rollout_id, batch) -> dict:
        self.trained.append(rollout_id)
        return {"loss": 0.0}

    def train_and_push(self, rollout_id, batch, version):
        self.trained.append(rollout_id)
        self.pushes.append(version)
        error = "engine http://e1 unreachable" if version in self.fail else None
        self.fail.discard(version)
        return {"loss": 0.0}, error, 0.5

    def update_weights(self, version: int) -> None:
        self.pushes.append(version)
        if version in self.fail:
            self.fail.discard(version)
            raise WeightPushFailed(version, "engine http://e1 unreachable")


def test_the_weight_owner_pushes_with_training_and_resyncs_what_the_pool_restarted():
    """One owner: a push made with training is not made again, a failed one is made again before
    ``train`` returns (the dead engine restarted), and an engine the pool restarts mid-generation
    gets the version the others hold before its requests go again."""
    pool = bare_pool(2)
    actor = RecordingActor(fail={2})
    sync = WeightSync(actor, pool, 0, fuse=True)
    sync.connect()
    sync.push(sync.trained)  # the first push: the checkpoint's version
    assert actor.pushes == [0] and sync.version == 0
    metrics = sync.train(0, None)
    sync.push(sync.trained)  # made with training: nothing left to do
    assert actor.pushes == [0, 1] and sync.version == sync.trained == 1 and metrics["time/update_weights"] == 0.5
    pool.clients[1].alive = False
    sync.train(1, None)  # the push with it fails on engine 1: restarted, connected, pushed again
    assert actor.pushes == [0, 1, 2, 2] and pool.restarted == [1] and sync.version == 2
    pool.clients[1].alive = False
    sync.generate(requests(2))  # its request fails: restarted, re-synced to 2, sent again
    assert pool.restarted == [1, 1] and actor.pushes[-1] == 2 and len(actor.connected) == 3
    sync.fuse = False
    sync.train(2, None)  # not fused: the push waits for the schedule
    assert sync.trained == 3 and sync.version == 2 and actor.pushes[-1] == 2
    sync.push(3)
    assert actor.pushes[-1] == 3 and sync.version == 3


def test_a_lost_node_with_actor_ranks_stops_the_run():
    pool = bare_pool(2)
    pool.dead_nodes = {"node-of-actor": "10.9.0.10"}
    with pytest.raises(NodeLost, match="10.9.0.10"):
        pool.ensure_engines()


def test_the_step_asks_ray_for_its_nodes_at_most_every_node_check_interval(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: clock[0])
    pool = bare_pool(2)
    for _ in range(3):
        pool.ensure_engines()
    assert pool.node_queries == 1  # the first step asks, the next ones within NODE_CHECK_S do not
    pool.dead_nodes = {"node-of-e1": "10.9.0.12"}
    pool.ensure_engines()
    assert pool.node_queries == 1 and not pool.lost  # not seen yet: the generation's check would see it
    clock[0] += NODE_CHECK_S
    pool.ensure_engines()
    assert pool.lost == {1: "10.9.0.12"}


def test_losing_every_engine_node_is_engines_down():
    pool = bare_pool(2)
    pool.dead_nodes = {"node-of-e0": "10.9.0.11", "node-of-e1": "10.9.0.12"}
    with pytest.raises(EnginesDown):
        pool.health.check_nodes()


def test_generation_asks_no_health_until_a_request_fails():
    """/health is off the critical path (SGLang's is a generation of its own): a dead engine is
    found by its failed requests, then restarted, and its requests are sent again."""
    pool = bare_pool(2)
    pool.generate(requests(4))
    assert [c.health_checks for c in pool.clients] == [0, 0]
    pool.clients[1].alive, pool.clients[1].served = False, []
    answers = pool.generate(requests(4))
    assert [a[0]["output_ids"] for a in answers] == [[0], [1], [2], [3]]
    assert pool.restarted == [1] and [c.health_checks for c in pool.clients] == [1, 1]
    assert sorted(pool.clients[1].served) == [1, 3]  # the restarted engine served its requests again


def test_an_engine_marked_down_is_restarted_before_the_next_generation():
    pool = bare_pool(2)
    pool.clients[1].alive = False
    with pool.restarts_deferred():
        pool.send(requests(2))  # found dead: marked down, not restarted
        pool.ensure_engines()
    assert pool.down == {1} and pool.restarted == []
    pool.generate(requests(2))  # the main thread: restarted first
    assert pool.restarted == [1] and pool.down == set()


def test_a_batch_is_spread_over_the_configured_engines_in_bounded_requests():
    """One request per engine where it fits (the CPU engine runs a request as one batch), at
    most MAX_SAMPLES_PER_REQUEST samples each, whole rows, and never fewer than one row."""
    cap_rows = MAX_SAMPLES_PER_REQUEST // 8
    assert rows_per_request(32, 8, 1) == 32  # the embedded rollout: one request of 256 samples
    assert rows_per_request(32, 8, 4) == 8  # one request per engine
    assert rows_per_request(30, 8, 4) == 8  # the last engine gets the remainder
    assert rows_per_request(1000, 8, 2) == cap_rows  # bounded: several requests per engine
    assert rows_per_request(3, 1000, 1) == 1  # a row has more samples than the cap: one row
    assert rows_per_request(2, 8, 16) == 1  # more engines than rows


def test_an_engine_that_answers_nothing_is_named_long_before_the_read_timeout(monkeypatch, caplog):
    # Issue 32, item 14: an engine stopped with SIGSTOP hung the job silently for 600 s.
    monkeypatch.setattr(health, "SILENT_S", 0.5)
    monkeypatch.setattr(health, "NODE_CHECK_S", 0.2)
    pool = bare_pool(2)
    pool.engine_set.engine_logs = ["/logs/engine_0.log", "/logs/engine_1.log"]
    pool.clients[1].powered.clear()  # answers nothing, refuses nothing, not even /health
    slow = pool.clients[0].generate
    pool.clients[0].generate = lambda **kw: (time.sleep(1.5), slow(**kw))[1]  # slow, but its /health answers
    out: list = []
    sender = threading.Thread(target=lambda: out.extend(pool.send(requests(4))))
    sender.start()
    try:
        deadline = time.monotonic() + 10
        while "no answer for" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        pool.clients[1].powered.set()
        sender.join(10)
    line = next(r.getMessage() for r in caplog.records if "no answer for" in r.getMessage())
    assert "http://e1 (2 request(s), log /logs/engine_1.log)" in line and "http://e0" not in line
    assert "rollout.generate_timeout_s" in line and len(out) == 4


def test_an_engine_behind_the_router_that_answers_nothing_is_named(monkeypatch, caplog):
    monkeypatch.setattr(health, "SILENT_S", 0.5)
    monkeypatch.setattr(health, "NODE_CHECK_S", 0.2)
    pool = bare_pool(2)
    with_router(pool, Path("/logs/router.log"), monkeypatch)
    pool.engine_set.engine_logs = ["/logs/engine_0.log", "/logs/engine_1.log"]
    pool.clients[1].powered.clear()  # the router's requests to it hang; the router's /health answers
    out: list = []
    sender = threading.Thread(target=lambda: out.extend(pool.send(requests(4))))
    sender.start()
    try:
        deadline = time.monotonic() + 10
        while "no answer for" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        pool.clients[1].powered.set()
        sender.join(10)
    line = next(r.getMessage() for r in caplog.records if "no answer for" in r.getMessage())
    assert "http://e1 (behind the router, log /logs/engine_1.log)" in line and "http://e0" not in line
    assert "router-1" not in line and len(out) == 4


def test_a_frozen_pool_restarts_and_routes_but_has_no_weight_channel():
    """The reward model's and the teacher's engines: lifecycle, health and fan-out, no weights."""
    pool = bare_pool(2, frozen=True)
    assert pool.fanout.restarted is None
    with pytest.raises(RlhpcError, match="frozen"):
        WeightSync(FakeSource(), pool, 0)
    pool.clients[1].alive = False
    answers = pool.generate(requests(2))
    assert [a[0]["output_ids"] for a in answers] == [[0], [1]] and pool.restarted == [1]
    assert pool.clients[1].served == [1]  # sent again to the restarted engine, which serves the model on disk


def test_onload_resumes_only_what_offload_released(monkeypatch):
    """Issue 40: SGLang's server dies resuming memory it holds. Engines just started hold theirs
    (the first push resumes nothing), and so does one restarted while the others are offloaded."""
    monkeypatch.setattr(engine_set_module, "EngineClient", lambda url, **kw: FakeClient(url))
    pool = bare_pool(2)
    engines = pool.engine_set
    engines.engine_parts = [["part"], ["part"]]
    engines.restart = lambda e: (pool.restarted.append(e), engines.replace(e, ["part"], f"e{e}-restarted"))
    pool.onload()  # nothing was released: nothing is resumed
    assert all(c.alive and not c.released for c in pool.clients)

    pool.offload()
    assert all(c.released == set(MEMORY_TAGS) for c in pool.clients)
    engines.restart(1)  # a new server, its memory in place
    pool.onload()
    assert pool.restarted == [1] and all(c.alive and not c.released for c in pool.clients)

    pool.clients[0].alive = False  # dies while its memory is in place
    pool.offload()  # restarted, then released as the others
    assert pool.restarted == [1, 0] and all(c.released == set(MEMORY_TAGS) for c in pool.clients)
    pool.onload()
    assert pool.restarted == [1, 0] and all(c.alive and not c.released for c in pool.clients)


def test_a_generate_request_may_take_as_long_as_its_longest_sample(tmp_path):
    """Issue 40, item 8: no fixed 600 s read timeout, which one long chain of thought outlasts."""
    from rlhpc.config import GENERATE_BASE_S, GENERATE_S_PER_TOKEN, STARTUP_BASE_S, STARTUP_S_PER_GB, startup_timeout_s

    pool = bare_pool(1)
    long = Request(input_ids=[[1], [2]], sampling_params=[{"max_new_tokens": 100}, {"max_new_tokens": 32768}])
    pool.send([long, Request(input_ids=[[3]], sampling_params=[{}])])
    assert pool.clients[0].timeouts == [GENERATE_BASE_S + GENERATE_S_PER_TOKEN * n for n in (32768, 128)]
    pool.engine_set.rollout_cfg = RolloutConfig(generate_timeout_s=30.0)
    pool.send([long])
    assert pool.clients[0].timeouts[-1] == 30.0

    (tmp_path / "model.safetensors").write_bytes(b"\0" * 2_000_000)
    assert (
        startup_timeout_s(RolloutConfig(backend="sglang"), 15 * 10**9)
        == STARTUP_BASE_S["sglang"] + 15 * STARTUP_S_PER_GB
    )
    assert EngineSet(RolloutConfig(), ClusterConfig(), 0, str(tmp_path), None, None, tmp_path).startup_timeout_s == (
        STARTUP_BASE_S["cpu"] + STARTUP_S_PER_GB * 0.002
    )
    assert startup_timeout_s(RolloutConfig(engine_startup_timeout_s=5.0), 10**12) == 5.0
