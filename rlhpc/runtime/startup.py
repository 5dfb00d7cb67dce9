"""How long each start of the job takes to reach its first rollout, phase by phase.

Every start pays this (a requeue after a preemption or a time limit too), so it is timed as
carefully as the step: Ray up, placement, engines up, actor ranks up and loaded, the weight
channel, the first push, the first rollout. Each phase, as it ends, is appended to the run's
``startup.jsonl`` (``RunDir.startup_file``) as one line and logged; ``jobs/status.py`` shows the
newest start's phases. Phases may overlap (the engines start while the actor ranks do), so each
line carries its own begin and end, in seconds since the job started.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Generic, TypeVar

from rlhpc.run_dir import RunDir

log = logging.getLogger(__name__)

T = TypeVar("T")

# Every phase a start records, in the order they begin; some only happen in some runs
# (``ray_up`` and ``prepare`` inside a job only, ``first_eval`` when an evaluation precedes the loop).
PHASES = (
    "prepare",  # job start -> Ray: the run dir's owner, the restart check
    "stage",  # cluster.stage_dir: the model and checkpoint copied to this node (task 0's share)
    "ray_up",
    "placement",
    "quantize",  # rollout.quantization: fp8: the engines' FP8 copy of the model written (the first start only)
    "engines_up",  # beside actor_up and actor_load
    "actor_up",
    "actor_load",
    "sandbox_up",  # the sandbox pool on the driver's node, when the run runs code (docs/guides/sandbox.md)
    "weight_channel",
    "first_push",
    "first_eval",
    "first_rollout",
)


class StartupClock:
    """Times one start's phases from ``origin`` (a ``time.monotonic()``; default: now). Thread-safe:
    phases running in other threads record themselves the same way."""

    def __init__(self, run: RunDir, job_id: str = "", origin: float | None = None):
        self.run = run
        self.origin = time.monotonic() if origin is None else origin
        started = time.time() - (time.monotonic() - self.origin)
        self.start = {"job_id": str(job_id), "started_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))}
        self._lock = threading.Lock()
        self._done = False

    def since_origin(self, t: float | None = None) -> float:
        return (time.monotonic() if t is None else t) - self.origin

    def record(self, phase: str, began: float, ended: float | None = None) -> None:
        """Phase ``phase`` ran from ``began`` to ``ended`` (``time.monotonic()`` values; default: now)."""
        ended = time.monotonic() if ended is None else ended
        line = {
            **self.start,
            "phase": phase,
            "began_s": round(self.since_origin(began), 3),
            "ended_s": round(self.since_origin(ended), 3),
            "seconds": round(ended - began, 3),
        }
        with self._lock:
            with open(self.run.startup_file, "a") as f:  # one short line per write: appends do not interleave
                f.write(json.dumps(line) + "\n")
        log.info("start-up: %s took %.2f s (%.2f s since the job started)", phase, ended - began, line["ended_s"])

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record ``name`` if the block completes (a failed phase is in the log, not in the file)."""
        began = time.monotonic()
        yield
        self.record(name, began)

    def background(self, name: str, start: Callable[[], T]) -> Starting[T]:
        """Run ``start`` in a thread as phase ``name`` while the caller starts something else."""
        return Starting(self, name, start)

    def first_rollout_done(self, began: float) -> None:
        """Phase ``first_rollout`` ended now (once per start), and a one-line summary is logged."""
        if self._done:
            return
        self._done = True
        self.record("first_rollout", began)
        phases = read_startup(self.run)
        log.info(
            "start-up: job start -> first rollout %.1f s (%s)",
            self.since_origin(),
            ", ".join(f"{p['phase']} {p['seconds']:.1f}" for p in phases),
        )


class Starting(Generic[T]):
    """A component being started in its own thread (``StartupClock.background``)."""

    def __init__(self, clock: StartupClock, name: str, start: Callable[[], T]):
        self._future: Future[T] = Future()

        def run() -> None:
            try:
                with clock.phase(name):
                    value = start()
            except BaseException as e:  # handed to whoever waits for it
                self._future.set_exception(e)
            else:
                self._future.set_result(value)

        self._thread = threading.Thread(target=run, name=f"startup-{name}", daemon=True)
        self._thread.start()

    def result(self) -> T:
        """The started component, once its thread is done; its exception if it failed."""
        return self._future.result()


def read_startup(run: RunDir) -> list[dict]:
    """The phases of the newest start that recorded any, in the order they began ([] if none)."""
    try:
        text = run.startup_file.read_text()
    except FileNotFoundError:
        return []
    lines = []
    for raw in text.splitlines():
        try:
            lines.append(json.loads(raw))
        except ValueError:  # a line cut short by a kill mid-write
            continue
    if not lines:
        return []
    newest = (lines[-1]["job_id"], lines[-1]["started_at"])
    return sorted((p for p in lines if (p["job_id"], p["started_at"]) == newest), key=lambda p: p["began_s"])
