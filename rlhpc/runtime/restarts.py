"""The run's start history and the restart policy: when a start must not run (a restart loop).

Every start of the job appends one line to ``restarts.jsonl`` (``RunDir.restarts_file``); the
policy reads it. Requeue and hold themselves belong to the job shell (rlhpc/launch/backend.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from rlhpc.run_dir import RunDir
from rlhpc.util.files import write_atomic


@dataclass
class RestartPolicy:
    max_restarts: int  # requeues of one job before it is held
    max_starts_without_progress: int  # consecutive starts that trained no rollout


def read_history(run: RunDir | str | Path) -> list[dict]:
    f = RunDir.of(run).restarts_file
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] if f.is_file() else []


def record_start(run: RunDir, job_id: str, restart_count: int, next_rollout_id: int) -> list[dict]:
    """Append this start to the run's history; return the whole history."""
    entry = {
        "job_id": job_id,
        "restart_count": restart_count,
        "next_rollout_id": next_rollout_id,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    history = [*read_history(run), entry]
    write_atomic(run.restarts_file, "".join(json.dumps(h) + "\n" for h in history))
    return history


def refuse_reason(history: list[dict], policy: RestartPolicy) -> str | None:
    """Why this start must not run (a restart loop), or None."""
    this = history[-1]
    if this["restart_count"] > policy.max_restarts:
        return f"job {this['job_id']} was requeued {this['restart_count']} times (checkpoint.max_restarts = {policy.max_restarts})"
    n = policy.max_starts_without_progress
    # Starts of this job only: a submission (a new job) is a person's decision to try again,
    # after a stop they asked for (Ctrl-C, `kill PID`) as much as after a crash.
    recent = [h for h in history if h["job_id"] == this["job_id"]][-(n + 1) :]
    if len(recent) == n + 1 and len({h["next_rollout_id"] for h in recent}) == 1:
        return f"the last {n + 1} starts all began at rollout {this['next_rollout_id']}: no rollout was trained in between (a restart loop)"
    return None
