"""Stop requests (preemption, time limit): recorded by a signal handler, acted on by the driver.

Slurm warns a job with ``--signal=USR2@grace`` before its time limit, and on preemption
(with ``preempt_send_user_signal``); without that setting preemption sends only SIGTERM.
The handler here only records the signal. The driver looks at it between the phases of a
rollout, saves, stops Ray, and raises ``Stopped``; the job then requeues itself
(rlhpc/launch/requeue.py). A checkpoint written inside a signal handler can deadlock on
collectives (Lightning #21406); this one is written by the normal code path.

Ray and engine processes must survive the warning long enough to be saved from: they are
started with SIGUSR2 ignored (an ignored signal stays ignored across fork and exec), so
Slurm's USR2 to every process of the step reaches only the task that acts on it.
"""

from __future__ import annotations

import os
import signal
import time


def shield_from_user_signal() -> None:
    """Ignore SIGUSR2 in this process, so processes started from here inherit the ignore.

    This also replaces submitit's own USR2 handler (it would checkpoint and requeue from
    inside the handler; rlhpc does neither there, see rlhpc/launch/requeue.py)."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class StopRequest:
    """Set by SIGUSR2 or SIGTERM; read by the driver at safe points."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None

    def install(self, signals: tuple[int, ...] = (signal.SIGUSR2, signal.SIGTERM)) -> StopRequest:
        """Record ``signals`` from now on. SIGTERM can be recorded from a task's first line (what
        this process starts gets it back as the default at exec either way); SIGUSR2 only once Ray
        and the engines were started with it ignored (``shield_from_user_signal``)."""
        for sig in signals:
            signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            # os.write: logging takes locks a signal handler must not wait for
            os.write(2, f"rlhpc: got {signal.Signals(signum).name}: stopping at the next safe point\n".encode())

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "none"


class Stopped(Exception):
    """Raised by the driver once it stopped for a stop request (state saved as far as possible)."""

    def __init__(self, next_rollout_id: int, reason: str):
        super().__init__(f"stopped before rollout {next_rollout_id} ({reason})")
        self.next_rollout_id = next_rollout_id
