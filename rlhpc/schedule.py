"""When each rollout is generated, and with which weights: the synchronous loop or the async pipeline.

Weight version v is the policy after training rollouts 0 .. v-1 (version 0: the initial model).
The driver asks a schedule for rollout r's generated batch (``get``), trains it, and pushes
version r + 1 through the schedule (``push``), which decides when the engines may take it.

- ``SyncRollouts`` (``rollout.max_staleness: 0``): generation runs inline in ``get``, with the
  version pushed after the previous rollout: rollout r uses version r, the engines idle while
  the actor trains and the actor idles while they generate.
- ``AsyncRollouts`` (``max_staleness`` K >= 1): a thread of the driver generates rollouts ahead
  while the main thread trains; the engines are HTTP servers, so the two overlap. Rollout r
  is generated with version >= r - K (``deterministic``: exactly max(0, r - K), a fixed lag, so
  nothing depends on timing). One rollout is generated at a time, and weight pushes and
  evaluations take the engines only between rollouts (``exclusive``), so a generation never
  sees half-pushed weights and its requests are batched as in the synchronous loop.
  With partial rollouts (``rollout.partial_rollout``) a push does not wait for the rollout in
  flight: its requests pause on the engines (pause mode "retract"), the weights change, they go
  on; every token records the version it was sampled with, and the bound still holds (a push
  only makes the weights newer). Evaluations still wait for the gap between rollouts.

Engine restarts (``rlhpc.rollout.engines``) happen only in the gaps between rollouts, on the
main thread, which pushes the weights: a restarted engine must get the version the others hold,
and the actor holds it only before it trains again. The generation thread never restarts an
engine: it sends a dead engine's requests to the healthy ones (same weights, same tokens), or,
with none left (``EnginesDown``), waits for the main thread: ``get`` and ``exclusive`` restart
and re-sync the engines to the version they held (the actor is idle on it), a ``push`` restarts
them with the new one. Deterministic, a rollout may only be generated with its own version, so a
push (or a checkpoint) that waits for such a rollout cannot restart the engines for it: that
version is gone from the actor, and the job stops (``RolloutWeightsLost``) to resume from its
last checkpoint, which holds everything needed to go on exactly.

Generated but untrained rollouts are part of the run's state: ``pending`` hands them to the
checkpoint (``save_pending``, ``load_pending``), and a resumed schedule starts from them (their
weights no longer exist).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rlhpc.errors import RlhpcError
from rlhpc.wire.request import EnginesDown, GenerationAborted, StopCheck

if TYPE_CHECKING:
    from rlhpc.batch import RolloutBatch

log = logging.getLogger(__name__)


@dataclass
class Generated:
    """One generated rollout: the training batch, its generation metrics and its texts."""

    rollout_id: int
    batch: RolloutBatch
    metrics: dict[str, float]
    texts: dict[str, list[str]]

    def state_dict(self) -> dict:
        return {"rollout_id": self.rollout_id, **self.batch.state_dict(), "metrics": self.metrics, "texts": self.texts}

    @classmethod
    def from_state_dict(cls, d: dict) -> Generated:
        from rlhpc.batch import RolloutBatch  # torch: not for a login node's dry run (its clock only)

        return cls(d["rollout_id"], RolloutBatch.from_state_dict(d), d["metrics"], d["texts"])


PENDING_FILE = "pending_rollouts.pt"  # in a checkpoint: generated, not yet trained rollouts (async pipeline)


def save_pending(checkpoint: Path, pending: dict[int, Generated]) -> None:
    """Write the generated, untrained rollouts (``pending``) into a checkpoint (nothing when none)."""
    if pending:
        import torch

        torch.save([g.state_dict() for g in pending.values()], checkpoint / PENDING_FILE)


def load_pending(checkpoint: Path) -> dict[int, Generated]:
    """The rollouts ``save_pending`` wrote into ``checkpoint``, by rollout id (none: empty)."""
    path = checkpoint / PENDING_FILE
    if not path.is_file():
        return {}
    import torch

    return {d["rollout_id"]: Generated.from_state_dict(d) for d in torch.load(path, weights_only=True)}


@dataclass
class BusyClock:
    """The intervals a group worked, to tell how much of a step window it idled."""

    intervals: list[tuple[float, float]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextmanager
    def busy(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.intervals.append((start, time.perf_counter()))

    def idle_fraction(self, start: float, stop: float) -> float:
        """Share of ``[start, stop]`` not covered by busy intervals (overlapping ones counted once:
        the group was busy); forgets intervals before ``start``."""
        with self._lock:
            busy, reached = 0.0, start
            for a, b in sorted(self.intervals):
                a, b = max(a, reached), min(b, stop)
                if b > a:
                    busy += b - a
                    reached = b
            self.intervals = [(a, b) for a, b in self.intervals if b > stop]
        span = stop - start
        return max(0.0, 1.0 - busy / span) if span > 0 else 0.0


Generate = Callable[[int], Generated]
Push = Callable[[int], None]


class RolloutWeightsLost(RlhpcError):
    """Deterministic async: every engine died while generating a rollout with weights the actor
    has since trained past, so the rollout cannot be generated as the fixed lag requires."""

    transient = True  # the last checkpoint holds all that is needed: resume from it

    def __init__(self, rollout_id: int, version: int, what: str):
        super().__init__(
            f"every rollout engine died while rollout {rollout_id} was generated with weight version "
            f"{version}, which {what} needs and the actor no longer holds (it has trained since): "
            "the job stops and resumes from its last checkpoint, with the same results",
            "nothing to do if it is rare; more engines (cluster.rollout_num_gpus) let generation go on "
            "on the healthy ones, which loses nothing",
        )


class AbortWhen:
    """The ``StopCheck`` the engine pools poll: drop the generation in flight? The job's stop
    request (``stop``), or, once an async schedule is built over it, that schedule's
    ``abort_requested``. Made before the schedule, which is built once the engines are up."""

    def __init__(self, stop: StopCheck | None = None):
        self.stop = stop
        self.schedule: AsyncRollouts | None = None

    @property
    def requested(self) -> bool:
        if self.schedule is not None:
            return self.schedule.abort_requested()
        return self.stop is not None and self.stop.requested


class SyncRollouts:
    """Generate rollout r when training asks for it, with the weights pushed after rollout r - 1."""

    max_staleness = 0

    def __init__(self, generate: Generate, push: Push, clock: BusyClock, stop: StopCheck | None = None):
        self._generate, self._push, self.clock = generate, push, clock
        # when the engines drop generation in flight: at the job's stop request
        self.abort: StopCheck | None = stop

    def start(self, first: int, pending: dict[int, Generated]) -> None:
        if pending:  # a checkpoint of an async run resumed synchronously: train what it generated
            log.info("training %d rollout(s) generated before the checkpoint first", len(pending))
        self._pending = dict(pending)

    def get(self, rollout_id: int) -> Generated:
        if rollout_id in self._pending:
            return self._pending.pop(rollout_id)
        with self.clock.busy():
            return self._generate(rollout_id)

    def pending(self, trained: int) -> dict[int, Generated]:
        return {r: g for r, g in self._pending.items() if r > trained}

    def push(self, version: int) -> None:
        self._push(version)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        yield

    def close(self) -> None:
        pass


class AsyncRollouts:
    """Generate up to ``max_staleness`` rollouts ahead of training in a background thread.

    ``stop`` is the job's stop request. Generation that a stop makes unnecessary is aborted
    (``abort``, which the driver hands the engine pool, which polls it); in deterministic mode the
    rollouts the next checkpoint must hold (those generated with older weights than it has) are
    finished first.

    ``generate``, ``push`` and ``repair`` are the driver's phases: the schedule decides when they
    run, and knows nothing of the engines.
    """

    def __init__(
        self,
        generate: Generate,
        push: Push,
        clock: BusyClock,
        max_staleness: int,
        num_rollout: int,
        deterministic: bool,
        stop_requested: Callable[[], bool] = lambda: False,
        repair: Callable[[], None] = lambda: None,
        partial: bool = False,
        abort: AbortWhen | None = None,
    ):
        """``repair``: restart dead engines and re-sync them to the version they held (the main
        thread calls it in a gap, with the actor on that version: the engine pool's ``ensure_engines``).
        ``abort``: what the engine pools were given to poll (this schedule answers it from now on).
        ``partial`` (``rollout.partial_rollout``, never deterministic): a push does not wait for
        the rollout in flight; the push pauses its requests on the engines, changes the weights
        and lets them go on, and the engines tag each token with its version."""
        if partial and deterministic:
            raise RlhpcError(
                "partial rollouts cannot be deterministic: where a push lands in a generation depends on timing",
                "set rollout.partial_rollout=false or deterministic=false",
            )
        self.partial = partial
        self._generate, self._push, self.clock = generate, push, clock
        self._repair = repair
        self.max_staleness, self.num_rollout, self.deterministic = max_staleness, num_rollout, deterministic
        self._stop_requested = stop_requested
        self._cond = threading.Condition()
        self._ready: dict[int, Generated] = {}
        self._next = 0  # the next rollout the thread generates
        self._current: int | None = None  # the rollout being generated
        self._version = 0  # the version on the engines
        self._floor = 0  # the oldest version the engines can still be given (the one they started with)
        self._taken = -1  # the newest rollout handed to training (it will be trained before any stop)
        self._exclusive = 0  # the main thread wants or holds the engines
        self._aborted = False
        self._down = False  # no engine left for the generation thread: it waits for a restart in a gap
        self._error: BaseException | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self.abort = abort if abort is not None else AbortWhen()  # for the engine pools: drop the generation in flight?
        self.abort.schedule = self

    # ------------------------------------------------------------ the generation thread

    def start(self, first: int, pending: dict[int, Generated]) -> None:
        """Begin with rollout ``first`` (the engines hold version ``first``), after the rollouts in ``pending``."""
        self._ready = {r: g for r, g in pending.items() if r >= first}
        self._next = max([first - 1, *self._ready]) + 1
        self._version = self._floor = first
        self._taken = first - 1
        self._thread = threading.Thread(target=self._run, name="rollout-generation", daemon=True)
        self._thread.start()

    def _allowed(self, r: int) -> bool:
        """May rollout r be generated with the version on the engines now? (Versions older than the
        engines' first are gone: a rollout that would need one, after a resume from a checkpoint
        that does not hold it, takes the oldest there is.)"""
        lag = max(self._floor, r - self.max_staleness)
        return self._version == lag if self.deterministic else self._version >= lag

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._closed
                        or self._aborted
                        or (
                            self._next < self.num_rollout
                            and not self._exclusive
                            and not self._down
                            and self._allowed(self._next)
                        )
                    )
                )
                if self._closed or self._aborted:
                    return
                if self._stop_requested() and not self._needed(self._next):
                    log.info("stop requested: rollout %d is not generated", self._next)
                    self._aborted = True
                    self._cond.notify_all()
                    return
                r = self._current = self._next
            try:
                with self.clock.busy():
                    generated = self._generate(r)
            except EnginesDown as e:  # rollout r is generated again, once the main thread restarted them
                with self._cond:
                    log.warning("rollout %d waits for the engines' restart between rollouts: %s", r, e.problem)
                    self._down, self._current = True, None
                    self._cond.notify_all()
                continue
            except GenerationAborted:
                with self._cond:
                    log.info("generation of rollout %d aborted for the stop request", r)
                    self._aborted, self._current = True, None
                    self._cond.notify_all()
                return
            except BaseException as e:  # handed to the main thread, which raises it
                with self._cond:
                    self._error, self._current = e, None
                    self._cond.notify_all()
                return
            with self._cond:
                self._ready[r] = generated
                self._next, self._current = r + 1, None
                self._cond.notify_all()

    def _needed(self, r: int) -> bool:
        """Deterministic: rollout r needs weights older than the next checkpoint's (the one after
        the newest rollout handed to training), so that checkpoint must hold it, stop or no stop."""
        return self.deterministic and r <= self._taken + self.max_staleness

    def abort_requested(self) -> bool:
        """For the engine pool (through ``abort``): drop the generation in flight? Only on a stop,
        and (deterministic) only a rollout no checkpoint before the stop will need."""
        if not self._stop_requested():
            return False
        with self._cond:
            if self._current is not None and self._needed(self._current):
                return False
            self._aborted = True  # decided under the lock: training takes nothing more from now on
            return True

    # ------------------------------------------------------------ the main thread

    def _wait(self, cond: Callable[[], bool], what: str, may_repair: bool = False) -> None:
        """Wait (holding the condition) until ``cond``; raise what the generation thread hit. If it
        waits for restarted engines: restart them here (``may_repair``: the actor holds the version
        the engines had), or give up."""

        def done() -> bool:
            return cond() or self._error is not None or (self._current is None and (self._aborted or self._down))

        while True:
            self._cond.wait_for(done)
            if cond():
                return
            if self._error is not None:
                raise self._error
            if self._aborted:
                raise GenerationAborted(f"generation stopped before {what}")
            if not may_repair:
                raise RolloutWeightsLost(self._next, self._version, what)
            self._repair_engines()

    def _repair_engines(self) -> None:
        """Restart the dead engines on the version they held (called holding the condition: the
        generation thread waits for it anyway)."""
        log.warning("restarting the rollout engines between rollouts, on weight version %d", self._version)
        self._repair()
        self._down = False
        self._cond.notify_all()

    def get(self, rollout_id: int) -> Generated:
        """Rollout ``rollout_id``'s generated batch, once it is ready."""
        with self._cond:
            # Once a stop dropped a rollout, training takes none: the next checkpoint must be one
            # whose pending rollouts are all generated.
            # Between push and train: the actor holds the engines' version, so a restart may happen here.
            self._wait(lambda: rollout_id in self._ready or self._aborted, f"rollout {rollout_id}", may_repair=True)
            if self._down:
                self._repair_engines()
            if self._aborted:
                raise GenerationAborted(f"stop requested before rollout {rollout_id} was trained")
            self._taken = rollout_id
            return self._ready.pop(rollout_id)

    def _needed_done(self, trained: int) -> Callable[[], bool]:
        """Every rollout that needs a version older than ``trained + 1`` is generated."""
        last = min(trained + self.max_staleness, self.num_rollout - 1)
        return lambda: self._next > last

    def pending(self, trained: int) -> dict[int, Generated]:
        """The generated rollouts after ``trained``, for its checkpoint. Deterministic: waits until
        every rollout that needs weights older than the checkpoint's is among them."""
        with self._cond:
            if self.deterministic:
                self._wait(self._needed_done(trained), f"the checkpoint of rollout {trained}")
            return {r: g for r, g in sorted(self._ready.items()) if r > trained}

    def push(self, version: int) -> None:
        """Put ``version`` (the weights after rollout ``version - 1``) on the engines between rollouts;
        dead engines are restarted with it."""
        needed = self._needed_done(version - 1) if self.deterministic else (lambda: True)
        with self._engines(needed, f"weight version {version}", in_flight_ok=self.partial):
            self._push(version)
            self._version = version  # read by the thread only under the condition, after we release
            self._down = False  # the push restarted every dead engine

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engines to the caller alone (an evaluation), between two rollouts."""
        with self._engines(lambda: True, "an evaluation"):
            if self._down:  # between push and train, as in get: restart them on the version they held
                with self._cond:
                    self._repair_engines()
            yield

    @contextmanager
    def _engines(self, ready: Callable[[], bool], what: str, in_flight_ok: bool = False) -> Iterator[None]:
        """The engines between two rollouts (``in_flight_ok``: beside the one in flight, which a
        partial-rollout push pauses and continues)."""
        with self._cond:
            self._wait(ready, what)  # first let the thread generate what must precede this
            self._exclusive += 1  # then it starts no new rollout
            try:
                self._wait(lambda: in_flight_ok or self._current is None, what)
            except BaseException:
                self._exclusive -= 1
                self._cond.notify_all()
                raise
        try:
            yield
        finally:
            with self._cond:
                self._exclusive -= 1
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)  # idle unless a stop or an error cut the run short
