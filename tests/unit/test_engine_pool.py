"""The engine pool's restart rules without Ray or servers: deferred restarts during async
generation (requests go to the healthy engines, no restart behind training) and the router's
restart limit."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlhpc.config import RolloutConfig
from rlhpc.errors import RlhpcError
from rlhpc.rollout.client import EngineUnavailable
from rlhpc.rollout.engine_pool import EnginePool, EnginesDown
from rlhpc.rollout.generation import Request


class FakeClient:
    def __init__(self, name: str):
        self.base_url, self.alive, self.served = f"http://{name}", True, []

    def health(self) -> bool:
        return self.alive

    def generate(self, *, input_ids, sampling_params, return_logprob) -> list[dict]:
        if not self.alive:
            raise EngineUnavailable(f"{self.base_url} refused", "is it up?")
        self.served.append(input_ids[0][0])
        return [{"output_ids": [ids[0]], "meta_info": {}} for ids in input_ids]

    def close(self) -> None:
        pass


class FakeRouter:
    def __init__(self, log_path: Path):
        self.log_path, self.starts = log_path, 0

    def start(self, urls: list[str]) -> str:
        self.starts += 1
        return f"http://router-{self.starts}"


def bare_pool(n: int, max_restarts: int = 2) -> EnginePool:
    """An EnginePool's routing and restart state over fake clients (no Ray, no servers)."""
    pool = EnginePool.__new__(EnginePool)
    pool.rollout_cfg = RolloutConfig(max_engine_restarts=max_restarts)
    pool.stop, pool.api_key, pool.weight_version = None, "k", 3
    pool.clients = [FakeClient(f"e{e}") for e in range(n)]
    pool.router, pool.router_client, pool.router_restarts = None, None, 0
    pool.down, pool._router_down, pool._deferred = set(), False, threading.local()
    pool._threads = ThreadPoolExecutor(4)
    pool.restarted: list[int] = []
    pool._restart = lambda e: (pool.restarted.append(e), setattr(pool.clients[e], "alive", True))
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
    pool._restart_dead()  # the gap (sync_weights on the main thread)
    assert pool.restarted == [1] and pool.down == set()


def test_deferred_restarts_with_no_engine_left_raise_engines_down():
    pool = bare_pool(2)
    for c in pool.clients:
        c.alive = False
    with pool.restarts_deferred(), pytest.raises(EnginesDown) as err:
        pool.send(requests(2))
    assert err.value.dead == [0, 1] and err.value.version == 3 and pool.restarted == []


def test_a_failure_on_a_healthy_engine_is_an_error_not_a_restart():
    pool = bare_pool(2)

    def broken(**kw):
        raise EngineUnavailable("500 from e0", "read its log")

    pool.clients[0].generate = broken
    with pool.restarts_deferred(), pytest.raises(EngineUnavailable, match="500 from e0"):
        pool.send(requests(2))
    assert pool.down == set()


def test_router_restarts_are_bounded(tmp_path: Path):
    pool = bare_pool(2, max_restarts=2)
    (tmp_path / "router.log").write_text("boom: router crashed\n")
    pool.router = FakeRouter(tmp_path / "router.log")
    pool.router_client = FakeClient("router-0")
    pool.clients[1].alive = False  # an engine restart moves the router too, but is not the router's failure
    pool._restart_dead()
    assert pool.router_restarts == 0 and pool.router.starts == 1
    for n in (1, 2):
        pool.router_client.alive = False
        pool._restart_dead()
        assert pool.router_restarts == n and pool.router_client.base_url == f"http://router-{n + 1}"
    pool.router_client.alive = False
    with pytest.raises(RlhpcError) as err:
        pool._restart_dead()
    msg = str(err.value)
    assert "router" in msg and str(tmp_path / "router.log") in msg and "router crashed" in msg
    assert "rollout.max_engine_restarts = 2" in msg and "fix:" in msg


def test_deferred_restarts_bypass_a_dead_router():
    pool = bare_pool(2)
    pool.router = FakeRouter(Path("/nonexistent/router.log"))
    pool.router_client = FakeClient("router-0")
    pool.router_client.alive = False
    with pool.restarts_deferred():
        pool.send(requests(2))
    assert sorted(pool.clients[0].served + pool.clients[1].served) == [0, 1] and pool.router_restarts == 0
    pool._restart_dead()
    assert pool.router_restarts == 1 and pool._targets() == [pool.router_client]
