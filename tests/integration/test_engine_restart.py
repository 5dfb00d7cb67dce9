"""A rollout engine whose server dies is restarted and re-synced to the current weights.

Real local Ray, real CPU engine servers, a real training rank; the engine's server is killed
with SIGKILL, as the kernel's OOM killer or a crash would end it. (A whole job through
jobs/submit.py that loses an engine: tests/integration/test_hang.py, in its last start.)
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import ray
import torch

from rlhpc.actor.group import ActorGroup, ActorSpec
from rlhpc.batch import RolloutBatch
from rlhpc.cluster.layout import plan_layout
from rlhpc.cluster.placement import create_placement
from rlhpc.config import Config
from rlhpc.data.buffer import DataBuffer, load_data
from rlhpc.errors import RlhpcError
from rlhpc.model import load_tokenizer
from rlhpc.rollout.engines import EnginePool, EnginesDown
from rlhpc.rollout.generation import Generation, task_reward
from rlhpc.rollout.weight_sync import WeightSync

pytestmark = pytest.mark.ray


def _wait_gone(pid: int, timeout_s: float = 15) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return  # a zombie no longer runs
        except (ProcessLookupError, FileNotFoundError):
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


def kill_engine(engines: EnginePool, e: int) -> None:
    pid = ray.get(engines.engines[e].pid.remote())
    os.kill(pid, signal.SIGKILL)
    _wait_gone(pid)


def assert_engine_matches_actor(engines: EnginePool, e: int, actor: ActorGroup, version: int) -> None:
    client = engines.clients[e]
    assert client.get_weight_version() == str(version)
    want = ray.get(actor.workers[0].named_tensors.remote())
    for name, t in want.items():
        got = torch.tensor(client.get_weights_by_name(name, truncate_size=1 << 20), dtype=t.dtype)
        assert torch.equal(got, t), f"engine {e}: {name} differs from the actor's"


def restart_cfg(actor_gpus: int) -> Config:
    """Two CPU engines beside ``actor_gpus`` training ranks, small rollouts, a large step size."""
    cfg = Config(deterministic=True)
    cfg.cluster.gpus_per_node, cfg.cluster.actor_num_gpus, cfg.cluster.rollout_num_gpus = actor_gpus + 2, actor_gpus, 2
    cfg.rollout.rollout_batch_size, cfg.rollout.n_samples_per_prompt, cfg.rollout.max_new_tokens = 8, 4, 6
    cfg.actor.lr = 5e-2  # one step moves the weights away from the ones on disk
    return cfg


@dataclass
class Rollout:
    """The driver's rollout side: the engine pool, the generation step through it, the data."""

    engines: EnginePool
    generation: Generation  # through engines.generate: engines marked down are restarted first
    buffer: DataBuffer
    eval_rows: list[dict]

    def weights(self, actor: object) -> WeightSync:
        """As the driver wires it: the engines' weight owner over ``actor``, generation through it."""
        sync = WeightSync(actor, self.engines, 0)
        self.generation.send = sync.generate
        return sync

    def generate(self, rollout_id: int) -> RolloutBatch:
        return self.generation.rollout(rollout_id, self.buffer.batch(rollout_id))[0]

    def sample_unchecked(self, rows: list[dict]) -> list[list[int]]:
        """Responses through engines.send (no restart of engines marked down first): a dead engine shows as failed requests."""
        direct = Generation(
            self.generation.tokenizer, self.generation.reward_fn, self.generation.rollout_cfg,
            self.generation.eval_cfg, self.generation.algo_cfg, self.generation.seed, send=self.engines.send,
            num_engines=self.generation.num_engines,
        )  # fmt: skip
        return direct.sample(rows, 4, 1.0, 6, "restart-test", "test").response_ids


@contextmanager
def groups(cfg: Config, model_path: str, log_dir: Path) -> Iterator[tuple[ActorGroup, Rollout]]:
    """In the module's one local Ray (``ray_cluster``: 4 GPUs declared, the most a layout here
    takes), the actor group and the rollout side; all torn down after, Ray kept for the next test."""
    layout = plan_layout(cfg.cluster)
    with ExitStack() as undo:  # in reverse, also when a start fails: the next test gets a clean Ray
        placement = create_placement(layout.num_slots)
        undo.callback(placement.remove)
        actor = ActorGroup(ActorSpec.from_config(cfg), model_path, placement, layout.actor_slots, cfg.cluster.colocate)
        undo.callback(actor.shutdown)
        engines = EnginePool.start(
            cfg.rollout, cfg.cluster, cfg.seed, model_path, placement, layout, log_dir, deterministic=cfg.deterministic
        )
        undo.callback(engines.shutdown)
        generation = Generation(
            load_tokenizer(model_path), task_reward(cfg.data), cfg.rollout, cfg.eval, cfg.algo, cfg.seed,
            send=engines.generate, num_engines=len(layout.engine_slots),
        )  # fmt: skip
        yield actor, Rollout(engines, generation, *load_data(cfg.data, cfg.rollout.rollout_batch_size, cfg.seed))


def test_dead_engines_are_restarted_resynced_and_limited(ray_cluster: None, model_path: str, tmp_path: Path) -> None:
    cfg = restart_cfg(actor_gpus=1)
    cfg.rollout.max_engine_restarts = 1
    with groups(cfg, model_path, tmp_path / "engines") as (actor, rollout):
        engines = rollout.engines
        sync = rollout.weights(actor)
        sync.push(0)
        batch = rollout.generate(0)
        actor.train(0, batch)
        sync.push(1)
        rows = rollout.eval_rows[:32]  # 4 samples each: two requests of 16 rows, one per engine
        before = rollout.sample_unchecked(rows)

        # Killed between calls: the /generate requests to it fail mid-run (no health check
        # before engines.send), it is restarted, re-synced, and the failed requests are sent again.
        kill_engine(engines, 1)
        assert rollout.sample_unchecked(rows) == before  # seeded samples on the same weights: the very same tokens
        assert engines.restarts == [0, 1]
        for e in (0, 1):  # both hold version 1: the restarted one was re-synced, not left on disk weights
            assert_engine_matches_actor(engines, e, actor, 1)
        log1 = Path(engines.engine_logs[1]).read_text()
        assert log1.count("starting at") == 2

        # Killed while idle: no /health before generating; its requests fail, it is restarted and re-synced.
        kill_engine(engines, 0)
        rollout.generate(1)
        assert engines.restarts == [1, 1]
        assert_engine_matches_actor(engines, 0, actor, 1)

        # Engine 1's second death, found by the push: past max_engine_restarts = 1.
        actor.train(1, batch)
        kill_engine(engines, 1)
        with pytest.raises(RlhpcError) as err:
            sync.push(2)
        msg = str(err.value)
        assert "rollout engine 1" in msg and engines.engine_logs[1] in msg
        assert "rollout.max_engine_restarts = 1" in msg and "fix:" in msg


def test_async_generation_leaves_dead_engines_to_the_gap(ray_cluster: None, model_path: str, tmp_path: Path) -> None:
    """As the async pipeline's generation thread (beside training): a dead engine is not restarted
    there (its re-sync would queue behind the actor's training and label trained weights with the
    old version); its requests go to the other engine, and the restart waits for the next push."""
    with groups(restart_cfg(actor_gpus=1), model_path, tmp_path / "engines") as (actor, rollout):
        engines = rollout.engines
        sync = rollout.weights(actor)
        sync.push(0)
        batch = rollout.generate(0)
        rows = rollout.eval_rows[:32]  # two requests of 16 rows, one per engine
        before = rollout.sample_unchecked(rows)

        kill_engine(engines, 1)
        with engines.restarts_deferred():
            assert rollout.sample_unchecked(rows) == before  # engine 0 served both, same weights, same tokens
            rollout.generate(1)  # engine 1 stays down, not restarted
        assert engines.restarts == [0, 0] and engines.down == {1}

        actor.train(0, batch)
        sync.push(1)  # the gap: restarted, and given version 1 under its own label
        assert engines.restarts == [0, 1] and engines.down == set()
        for e in (0, 1):
            assert_engine_matches_actor(engines, e, actor, 1)

        # Every engine dead: the generation thread cannot go on, the main thread restarts them
        # on the version they held (the actor idles on it).
        kill_engine(engines, 0)
        kill_engine(engines, 1)
        with engines.restarts_deferred(), pytest.raises(EnginesDown) as err:
            rollout.generate(2)
        assert err.value.dead == [0, 1] and err.value.version == 1 and engines.restarts == [0, 1]
        engines.ensure_engines()
        assert engines.restarts == [1, 2]
        for e in (0, 1):
            assert_engine_matches_actor(engines, e, actor, 1)


class KillBeforePush:
    """The actor, except that engine ``e``'s server is SIGKILLed as a push begins (the pool
    asks no /health before a push): the push fails on the engines' side, mid-update."""

    def __init__(self, actor: ActorGroup, engines: EnginePool, e: int):
        self.actor, self.engines, self.e, self.armed = actor, engines, e, False

    def connect_rollout(self, *args: object) -> None:
        self.actor.connect_rollout(*args)

    def train(self, *args: object) -> dict:
        return self.actor.train(*args)

    def train_and_push(self, *args: object) -> tuple:
        return self.actor.train_and_push(*args)

    def update_weights(self, version: int) -> None:
        if self.armed:
            self.armed = False
            kill_engine(self.engines, self.e)
        self.actor.update_weights(version)


def test_pushes_made_with_training_and_an_engine_killed_during_one(
    ray_cluster: None, model_path: str, tmp_path: Path
) -> None:
    """The synchronous loop's push in the training call (``WeightSync(fuse=True).train``): the
    engines hold the trained weights after one update each, and the push after it has nothing
    left to do. An engine killed during that training fails the push, and the owner restarts it
    and pushes again. Then a push of its own with an engine killed as it begins: every rank
    finishes the failed push; the dead engine is restarted and the push repeated. (One Ray,
    actor and engines for both.)"""
    with groups(restart_cfg(actor_gpus=2), model_path, tmp_path / "engines") as (actor, rollout):
        engines = rollout.engines
        source = KillBeforePush(actor, engines, 1)  # the actor itself until armed
        sync = rollout.weights(source)
        sync.fuse = True
        sync.push(0)
        batch = rollout.generate(0)
        metrics = sync.train(0, batch)
        assert metrics["time/update_weights"] > 0 and sync.version == sync.trained == 1
        sync.push(1)
        for e in (0, 1):
            assert_engine_matches_actor(engines, e, actor, 1)
            assert Path(engines.engine_logs[e]).read_text().count("weight_version 1") == 1  # not pushed twice

        batch = rollout.generate(1)
        kill_engine(engines, 0)  # while the actor trains, unseen by the pool
        sync.train(1, batch)
        sync.push(2)
        assert engines.restarts == [1, 0]
        for e in (0, 1):
            assert_engine_matches_actor(engines, e, actor, 2)
        batch = rollout.generate(2)  # and generation goes on

        actor.train(2, batch)  # no push with it: the owner pushes, and engine 1 is killed as it begins
        source.armed = True
        sync.push(3)
        assert engines.restarts == [1, 1] and not source.armed
        for e in (0, 1):
            assert_engine_matches_actor(engines, e, actor, 3)
        rollout.generate(3)  # and generation goes on
