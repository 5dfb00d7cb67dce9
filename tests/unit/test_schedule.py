"""The async schedule without Ray or engines: which weight version each rollout is generated
with, what a checkpoint must hold, what a stop may drop. Versions are asserted, not timings."""

import random
import threading
import time

import pytest
import torch

from rlhpc.batch import RolloutBatch
from rlhpc.errors import RlhpcError
from rlhpc.schedule import AsyncRollouts, BusyClock, Generated, RolloutWeightsLost, SyncRollouts
from rlhpc.wire.request import EnginesDown, GenerationAborted


class FakeEngines:
    """Generation records the version on the 'engines'; a push changes it (never during a generation)."""

    def __init__(self, jitter: float = 0.002, abort=None):
        self.version = 0
        self.generating = 0
        self.log: list[tuple[int, int]] = []  # (rollout, version)
        self.jitter = jitter
        self.abort = abort
        self.rng = random.Random(0)

    def generate(self, r: int) -> Generated:
        self.generating += 1
        v = self.version
        time.sleep(self.rng.random() * self.jitter)
        if self.abort is not None and self.abort():
            self.generating -= 1
            raise GenerationAborted()
        assert self.version == v, "weights changed during a generation"
        self.generating -= 1
        self.log.append((r, v))
        batch = RolloutBatch([[1]], [[2]], [[-0.5]], torch.zeros(1), torch.zeros(1), 1, [v])
        return Generated(r, batch, {"staleness/max": float(r - v)}, {"response": ["x"]})

    def push(self, version: int) -> None:
        assert self.generating == 0, "a push during a generation"
        time.sleep(self.rng.random() * self.jitter)
        self.version = version


def drive(schedule, engines, num_rollout: int, start: int = 0, pending=None, train_s: float = 0.002):
    schedule.start(start, pending or {})
    got = []
    try:
        for r in range(start, num_rollout):
            g = schedule.get(r)
            got.append((r, g.batch.weight_versions[0]))
            time.sleep(train_s * random.random())
            schedule.push(r + 1)
    finally:
        schedule.close()
    return got


@pytest.mark.parametrize("k", [1, 2, 3])
def test_fixed_lag_uses_exactly_version_r_minus_k(k):
    engines = FakeEngines()
    s = AsyncRollouts(engines.generate, engines.push, BusyClock(), k, 12, deterministic=True)
    got = drive(s, engines, 12)
    assert got == [(r, max(0, r - k)) for r in range(12)]


@pytest.mark.parametrize("k", [1, 2])
def test_freshest_weights_never_older_than_k(k):
    engines = FakeEngines(jitter=0.005)
    s = AsyncRollouts(engines.generate, engines.push, BusyClock(), k, 15, deterministic=False)
    got = drive(s, engines, 15, train_s=0.01)
    assert [r for r, _ in got] == list(range(15))
    assert all(0 <= r - v <= k for r, v in got), got


def test_sync_schedule_generates_with_the_newest_weights():
    engines = FakeEngines()
    s = SyncRollouts(engines.generate, engines.push, BusyClock())
    assert drive(s, engines, 5) == [(r, r) for r in range(5)]


def test_pending_holds_what_needs_older_weights_and_resume_continues_the_same_schedule():
    k, n = 2, 10
    engines = FakeEngines()
    s = AsyncRollouts(engines.generate, engines.push, BusyClock(), k, n, deterministic=True)
    s.start(0, {})
    for r in range(4):
        s.get(r)
        s.push(r + 1) if r < 3 else None
    pending = s.pending(3)  # the checkpoint of rollout 3 (weights version 4)
    assert sorted(pending) == [4, 5]  # generated with versions 2 and 3, which the resumed job lacks
    assert [g.batch.weight_versions[0] for g in pending.values()] == [2, 3]
    s.close()
    # resumed: the engines hold version 4; rollouts 4, 5 come from the checkpoint, 6.. use r - 2
    engines2 = FakeEngines()
    engines2.version = 4
    s2 = AsyncRollouts(engines2.generate, engines2.push, BusyClock(), k, n, deterministic=True)
    got = drive(s2, engines2, n, start=4, pending=pending)
    assert got == [(r, r - k) for r in range(4, n)]
    assert [r for r, _ in engines2.log] == list(range(6, n))  # nothing generated twice


def test_stop_keeps_what_the_checkpoint_needs_and_drops_the_rest():
    stop = threading.Event()
    engines = FakeEngines(jitter=0.0)
    s = AsyncRollouts(
        engines.generate, engines.push, BusyClock(), 1, 20, deterministic=True, stop_requested=stop.is_set
    )
    engines.abort = lambda: s.abort.requested  # what the engine pool polls
    s.start(0, {})
    s.get(0)
    s.push(1)
    s.get(1)  # being trained when the stop comes
    stop.set()
    pending = s.pending(1)  # rollout 2 was generated with version 1, older than the checkpoint's 2
    assert sorted(pending) == [2]
    s.push(2)
    # Either the stop dropped rollout 3 first (then nothing more is trained), or training took
    # rollout 2 first (then its checkpoint needs rollout 3, which is generated): never half of it.
    try:
        s.get(2)
    except GenerationAborted:
        assert 3 not in [r for r, _ in engines.log]
    else:
        assert sorted(s.pending(2)) == [3]
    s.close()
    assert max(r for r, _ in engines.log) <= 3


def test_a_generation_error_reaches_the_main_thread():
    def boom(r):
        raise ValueError("reward crashed")

    s = AsyncRollouts(boom, lambda v: None, BusyClock(), 1, 5, deterministic=True)
    s.start(0, {})
    with pytest.raises(ValueError, match="reward crashed"):
        s.get(0)
    s.close()


def test_busy_clock_idle_fraction():
    c = BusyClock()
    c.intervals = [(0.0, 1.0), (2.0, 3.0), (3.5, 10.0)]
    assert c.idle_fraction(0.5, 4.5) == pytest.approx(1 - (0.5 + 1.0 + 1.0) / 4.0)
    assert c.intervals == [(3.5, 10.0)]


def test_busy_clock_counts_overlapping_intervals_once():
    c = BusyClock()  # two requests of a group in flight together: the group was busy 0-3, idle 3-4
    c.intervals = [(0.0, 2.0), (1.0, 3.0), (1.5, 2.5)]
    assert c.idle_fraction(0.0, 4.0) == pytest.approx(0.25)


def test_generated_round_trips_through_torch_save(tmp_path):
    batch = RolloutBatch([[1, 2]], [[3]], [[-0.1]], torch.ones(1), torch.zeros(1), 1, [7])
    g = Generated(9, batch, {"reward": 1.0}, {"prompt": ["p"]})
    torch.save([g.state_dict()], tmp_path / "p.pt")
    (back,) = [Generated.from_state_dict(d) for d in torch.load(tmp_path / "p.pt", weights_only=True)]
    assert back.rollout_id == 9 and back.batch.weight_versions == [7] and back.texts == g.texts
    assert torch.equal(back.batch.rewards, batch.rewards) and back.metrics == g.metrics


class DyingEngines(FakeEngines):
    """Every engine dies at rollout ``at``'s first attempt, once training took rollout ``after``
    (``taken``): the generation thread must not restart them; the main thread does, in a gap."""

    def __init__(self, at: int, after: int | None = None):
        super().__init__(jitter=0.0)
        self.at, self.after, self.down = at, after, False
        self.taken = {r: threading.Event() for r in range(20)}
        self.repairs: list[int] = []  # the version the engines were re-synced to
        self.pushes_while_down: list[int] = []

    def generate(self, r: int) -> Generated:
        if r == self.at and not self.repairs and not self.pushes_while_down:
            if self.after is not None:
                self.taken[self.after].wait(5)
            self.down = True
        if self.down:
            raise EnginesDown([0], self.version)
        return super().generate(r)

    def repair(self) -> None:
        assert self.down
        self.down = False
        self.repairs.append(self.version)

    def push(self, version: int) -> None:
        if self.down:  # the push restarts the dead engines with the new version
            self.down = False
            self.pushes_while_down.append(version)
        super().push(version)


def drive_marking(schedule, engines, num_rollout: int):
    """``drive`` that tells the engines when training took each rollout."""
    schedule.start(0, {})
    got = []
    try:
        for r in range(num_rollout):
            g = schedule.get(r)
            engines.taken[r].set()
            got.append((r, g.batch.weight_versions[0]))
            schedule.push(r + 1)
    finally:
        schedule.close()
    return got


def test_dead_engines_before_training_takes_a_rollout_are_repaired_on_the_same_version():
    """Rollout 0 fails while the main thread waits for it (the actor idles on version 0): it
    restarts the engines on version 0, and the fixed lag holds."""
    engines = DyingEngines(at=0)
    s = AsyncRollouts(
        engines.generate, engines.push, BusyClock(), 1, 6, deterministic=True, repair=engines.repair
    )  # fmt: skip
    assert drive_marking(s, engines, 6) == [(r, max(0, r - 1)) for r in range(6)]
    assert engines.repairs == [0] and engines.pushes_while_down == []
    assert [r for r, _ in engines.log] == list(range(6))  # every rollout generated once


def test_deterministic_dead_engines_during_training_stop_the_job_for_a_resume():
    """Rollout 3 needs version 2; the engines die once the actor trains rollout 2 (version 2 is
    gone): the push of version 3 cannot wait for rollout 3, nor restart the engines for it."""
    engines = DyingEngines(at=3, after=2)
    s = AsyncRollouts(
        engines.generate, engines.push, BusyClock(), 1, 6, deterministic=True, repair=engines.repair
    )  # fmt: skip
    with pytest.raises(RolloutWeightsLost, match="rollout 3 was generated with weight version 2") as err:
        drive_marking(s, engines, 6)
    assert err.value.transient and "fix:" in str(err.value)
    assert engines.repairs == [] and engines.pushes_while_down == []  # never restarted behind training
    assert [r for r, _ in engines.log] == [0, 1, 2]


def test_freshest_weights_dead_engines_during_training_wait_for_the_next_push():
    """Not deterministic: rollout 3 is generated after the push of version 3 restarted the engines."""
    engines = DyingEngines(at=3, after=2)
    s = AsyncRollouts(
        engines.generate, engines.push, BusyClock(), 1, 6, deterministic=False, repair=engines.repair
    )  # fmt: skip
    got = drive_marking(s, engines, 6)
    assert [r for r, _ in got] == list(range(6)) and all(0 <= r - v <= 1 for r, v in got)
    # restarted by the push of version 3, or (if it came first) while training waited for rollout 3
    assert engines.pushes_while_down + engines.repairs == [3]
    assert (3, 3) in engines.log


class PartialEngines:
    """Engines that tag each token with the version on them when it is made, and let a push land
    in the middle of a generation (pause, new weights, continue): rollout 1's generation makes one
    token, then waits for the push of version 1 (which a partial-rollout schedule lets through while
    it is in flight), then makes another."""

    def __init__(self):
        self.version = 0
        self.changed = threading.Condition()
        self.in_flight_1 = threading.Event()

    def generate(self, r: int) -> Generated:
        tokens = [self.version]
        if r == 1:
            self.in_flight_1.set()
            with self.changed:  # bounded: a schedule that held the push back would fail, not hang
                assert self.changed.wait_for(lambda: self.version >= 1, timeout=30), "the push waited for generation"
        tokens.append(self.version)
        batch = RolloutBatch(
            [[1]], [[2, 3]], [[-0.5, -0.5]], torch.zeros(1), torch.zeros(1), 1, [min(tokens)], [tokens]
        )
        return Generated(r, batch, {}, {"response": ["x"]})

    def push(self, version: int) -> None:
        with self.changed:
            self.version = version
            self.changed.notify_all()


def test_partial_rollout_push_lands_in_flight_and_every_token_keeps_its_version():
    k, n = 1, 6
    engines = PartialEngines()
    s = AsyncRollouts(engines.generate, engines.push, BusyClock(), k, n, deterministic=False, partial=True)
    s.start(0, {})
    got = {}
    try:
        for r in range(n):
            got[r] = s.get(r).batch
            if r == 0:  # push version 1 once rollout 1 is being generated (with version 0)
                assert engines.in_flight_1.wait(30)
            s.push(r + 1)
    finally:
        s.close()
    assert got[1].token_versions == [[0, 1]] and got[1].weight_versions == [0]  # straddles the push of 1
    for r, batch in got.items():
        versions = batch.token_versions[0]
        assert versions == sorted(versions) and all(0 <= r - v <= k for v in versions), (r, versions)


def test_partial_rollouts_are_refused_with_the_fixed_lag():
    with pytest.raises(RlhpcError, match="partial rollouts cannot be deterministic"):
        AsyncRollouts(lambda r: None, lambda v: None, BusyClock(), 1, 4, deterministic=True, partial=True)
