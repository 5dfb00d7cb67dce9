"""Stop requests (preemption, time limit) and requeue, decided by the driver, never in a handler.

Slurm warns a job with ``--signal=USR2@grace`` before its time limit, and on preemption
(with ``preempt_send_user_signal``); without that setting preemption sends only SIGTERM.
The handler here only records the signal. The driver looks at it between the phases of a
rollout, saves, stops Ray, and the job requeues itself. A checkpoint written inside a
signal handler can deadlock on collectives (Lightning #21406); this one is written by the
normal code path.

Ray and engine processes must survive the warning long enough to be saved from: they are
started with SIGUSR2 ignored (an ignored signal stays ignored across fork and exec), so
Slurm's USR2 to every process of the step reaches only the task that acts on it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rlhpc.checkpoint import write_atomic

log = logging.getLogger(__name__)

LOCAL_REQUEUE_EXIT_CODE = 144  # submitit's local executor restarts a task that exits with this


def shield_from_user_signal() -> None:
    """Ignore SIGUSR2 in this process, so processes started from here inherit the ignore."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


class StopRequest:
    """Set by SIGUSR2 or SIGTERM; read by the driver at safe points."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None

    def install(self) -> StopRequest:
        for sig in (signal.SIGUSR2, signal.SIGTERM):
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


# ---------------------------------------------------------------- restart history


@dataclass
class RestartPolicy:
    max_restarts: int  # requeues of one job before it is held
    max_starts_without_progress: int  # consecutive starts that trained no rollout


def history_file(run_dir: Path) -> Path:
    return run_dir / "restarts.jsonl"


def read_history(run_dir: Path) -> list[dict]:
    f = history_file(run_dir)
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []


def record_start(run_dir: Path, job_id: str, restart_count: int, next_rollout_id: int) -> list[dict]:
    """Append this start to the run's history; return the whole history."""
    entry = {
        "job_id": job_id,
        "restart_count": restart_count,
        "next_rollout_id": next_rollout_id,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    history = [*read_history(run_dir), entry]
    write_atomic(history_file(run_dir), "".join(json.dumps(h) + "\n" for h in history))
    return history


def refuse_reason(history: list[dict], policy: RestartPolicy) -> str | None:
    """Why this start must not run (a restart loop), or None."""
    this = history[-1]
    if this["restart_count"] > policy.max_restarts:
        return f"job {this['job_id']} was requeued {this['restart_count']} times (checkpoint.max_restarts = {policy.max_restarts})"
    n = policy.max_starts_without_progress
    recent = history[-(n + 1) :]
    if len(recent) == n + 1 and len({h["next_rollout_id"] for h in recent}) == 1:
        return f"the last {n + 1} starts all began at rollout {this['next_rollout_id']}: no rollout was trained in between (a restart loop)"
    return None


# ---------------------------------------------------------------- requeue


def requeue(cluster: str, job_id: str) -> None:
    """Put the job back in the queue and leave. Never returns."""
    if cluster == "slurm":
        # Fails harmlessly when Slurm is already requeueing the job (scontrol requeue, node failure).
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
        log.info(
            "job %s requeued%s; it resumes from the newest checkpoint",
            job_id,
            f" ({out.stderr.strip()})" if out.returncode else "",
        )
        sys.exit(0)  # SystemExit passes through submitit: no result file, the job is not over
    log.info("local job %s restarting; it resumes from the newest checkpoint", job_id)
    sys.exit(LOCAL_REQUEUE_EXIT_CODE)


def hold(cluster: str, job_id: str, reason: str) -> None:
    """Stop a restart loop: Slurm keeps the job, held, for a person to look at."""
    if cluster == "slurm":
        subprocess.run(["scontrol", "requeuehold", job_id], timeout=60)
        log.error(
            "job %s held (scontrol requeuehold): %s. Fix the cause, then `scontrol release %s`", job_id, reason, job_id
        )
        sys.exit(0)
    log.error("not restarting: %s", reason)
    sys.exit(1)
