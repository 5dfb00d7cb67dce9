"""The restart policy: the run's start history, when a start is refused, requeue and hold.

rlhpc requeues itself; it does not use submitit's requeue machinery. submitit's
(``helpers.Checkpointable`` and its USR2 handler) re-pickles the callable and requeues from
inside the signal handler. Here the driver stops at a safe point and saves
(rlhpc/launch/signals.py), the job requeues itself, and the next start reads everything
from disk. So ``TrainJob`` is a plain callable that replaces submitit's USR2 handler first.

Leaving the process: ``requeue`` and ``hold`` raise ``JobExit`` with the exit code the runner
acts on; ``TrainJob.__call__`` (the process boundary submitit calls) is the one place that
turns it into ``SystemExit``. A SystemExit passes through submitit (it catches Exception
only), so no result file is written and the job is not over:

- requeue under Slurm: 0, after ``scontrol requeue`` (Slurm starts the job again);
- requeue locally: 144, on which rlhpc's local controller starts the task again
  (rlhpc/launch/local_controller.py: as often as ``checkpoint.max_restarts`` allows);
- hold: 0 under Slurm (``scontrol requeuehold``: the job stays, held), 1 locally (no restart);
- a requeue or hold that Slurm refused: 1, so the job ends FAILED where people (and
  Slurm's own requeue-on-failure settings) see it, never COMPLETED with the run stopped.

``JobExit.final`` says whether the job is over for good (its run dir owner is released).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from rlhpc.launch import slurm
from rlhpc.run_dir import RunDir
from rlhpc.util.files import write_atomic

log = logging.getLogger(__name__)

LOCAL_REQUEUE_EXIT_CODE = 144  # submitit's local executor restarts a task that exits with this


class JobExit(Exception):
    """This task must end now with ``code`` (a requeue or a hold), without a result."""

    def __init__(self, code: int, message: str, final: bool = False):
        super().__init__(message)
        self.code = code
        self.final = final  # no start of this job follows: it gives up the run dir


# States in which Slurm itself is already taking the job down or back to the queue (e.g. a
# `scontrol requeue` by hand, preemption): our own requeue is then refused, harmlessly.
SLURM_ALREADY_REQUEUEING = {"REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "PENDING", "PREEMPTED", "COMPLETING"}


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


def _job_state(job_id: str) -> str | None:
    """The job's Slurm state, None when gone or when slurmctld cannot be asked (said as unknown)."""
    try:
        return slurm.job_state(job_id)
    except slurm.SlurmUnreachable as e:
        log.warning("%s", e)
        return None


def requeue(cluster: str, job_id: str, num_nodes: tuple[int, ...] | None = None) -> NoReturn:
    """Put the job back in the queue; raises the ``JobExit`` that ends this task. ``num_nodes``:
    after a node loss, the node count of each component (one for a homogeneous job) the requeued
    job asks for again (Slurm shrank it)."""
    if cluster == "slurm":
        refused = slurm.requeue(job_id)
        if num_nodes is not None and (refused is None or _job_state(job_id) in SLURM_ALREADY_REQUEUEING):
            for k, count in enumerate(num_nodes):
                target = job_id if len(num_nodes) == 1 else f"{job_id}+{k}"  # a het job's component k
                failed = slurm.set_num_nodes(target, count)
                if failed:
                    log.error(
                        "job %s: could not set its node count back to %d (%s): run `scontrol update JobId=%s "
                        "NumNodes=%d`, or it starts with too few nodes and fails naming them",
                        target, count, failed, target, count,
                    )  # fmt: skip
        if refused is None:
            log.info("job %s requeued; it resumes from the newest checkpoint", job_id)
            raise JobExit(0, f"job {job_id} requeued")
        state = _job_state(job_id)
        if state in SLURM_ALREADY_REQUEUEING:
            log.info(
                "job %s: Slurm is already ending or requeueing it (state %s; scontrol requeue said: %s); "
                "once back in the queue it resumes from the newest checkpoint",
                job_id, state, refused,
            )  # fmt: skip
            raise JobExit(0, f"job {job_id} requeued by Slurm")
        log.error(
            "job %s was NOT requeued: scontrol requeue failed (%s; job state %s). The run stops here, its "
            "checkpoint is kept: run the same jobs/submit.py command again to resume",
            job_id, refused, state or "unknown",
        )  # fmt: skip
        raise JobExit(1, f"scontrol requeue of job {job_id} failed: {refused}", final=True)
    log.info("local job %s restarting; it resumes from the newest checkpoint", job_id)
    raise JobExit(LOCAL_REQUEUE_EXIT_CODE, f"local job {job_id} restarting")


def hold(cluster: str, job_id: str, reason: str) -> NoReturn:
    """Stop a restart loop: Slurm keeps the job, held, for a person to look at."""
    if cluster == "slurm":
        refused = slurm.requeue_hold(job_id)
        if refused is not None:
            log.error(
                "not restarting: %s. Holding job %s failed too (scontrol requeuehold: %s): it ends FAILED. "
                "Fix the cause, then run the same jobs/submit.py command again to resume",
                reason, job_id, refused,
            )  # fmt: skip
            raise JobExit(1, f"not restarting: {reason}; scontrol requeuehold failed: {refused}", final=True)
        log.error(
            "job %s held (scontrol requeuehold): %s. Fix the cause, then `scontrol release %s`", job_id, reason, job_id
        )
        raise JobExit(0, f"job {job_id} held: {reason}")
    log.error("not restarting: %s", reason)
    raise JobExit(1, f"not restarting: {reason}", final=True)
