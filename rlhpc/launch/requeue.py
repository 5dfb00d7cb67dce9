"""Requeue and hold: how a task leaves when the job must start again, or stop for a person.

rlhpc requeues itself; it does not use submitit's requeue machinery. submitit's
(``helpers.Checkpointable`` and its USR2 handler) re-pickles the callable and requeues from
inside the signal handler. Here the driver stops at a safe point and saves
(rlhpc/runtime/signals.py), the job requeues itself, and the next start reads everything
from disk. So ``TrainJob`` is a plain callable that replaces submitit's USR2 handler first.

Leaving the process: a backend's ``requeue`` and ``hold`` (rlhpc/launch/backend.py) raise
``JobExit`` with the exit code the runner acts on; ``TrainJob.__call__`` (the process boundary
submitit calls) is the one place that turns it into ``SystemExit``. A SystemExit passes through
submitit (it catches Exception only), so no result file is written and the job is not over:

- requeue under Slurm: 0, after ``scontrol requeue`` (Slurm starts the job again);
- requeue locally: 144, on which rlhpc's local controller starts the task again
  (rlhpc/launch/local_controller.py: as often as ``checkpoint.max_restarts`` allows);
- hold: 0 under Slurm (``scontrol requeuehold``: the job stays, held), 1 locally (no restart);
- a requeue or hold that Slurm refused: 1, so the job ends FAILED where people (and
  Slurm's own requeue-on-failure settings) see it, never COMPLETED with the run stopped.

``JobExit.final`` says whether the job is over for good (its run dir owner is released).
"""

from __future__ import annotations

import logging
from typing import NoReturn

from rlhpc.launch import slurm

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


def _job_state(job_id: str) -> str | None:
    """The job's Slurm state, None when gone or when slurmctld cannot be asked (said as unknown)."""
    try:
        return slurm.job_state(job_id)
    except slurm.SlurmUnreachable as e:
        log.warning("%s", e)
        return None


def requeue_slurm(job_id: str, num_nodes: tuple[int, ...] | None = None) -> NoReturn:
    """Put the job back in the queue; raises the ``JobExit`` that ends this task. ``num_nodes``:
    after a node loss, the node count of each component (one for a homogeneous job) the requeued
    job asks for again (Slurm shrank it)."""
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


def requeue_local(job_id: str) -> NoReturn:
    """Restart the local job: its controller starts the task again (rlhpc/launch/local_controller.py)."""
    log.info("local job %s restarting; it resumes from the newest checkpoint", job_id)
    raise JobExit(LOCAL_REQUEUE_EXIT_CODE, f"local job {job_id} restarting")


def hold_slurm(job_id: str, reason: str) -> NoReturn:
    """Stop a restart loop: Slurm keeps the job, held, for a person to look at."""
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


def hold_local(reason: str) -> NoReturn:
    """Stop a restart loop: a local job has nobody to hold it for, so it ends."""
    log.error("not restarting: %s", reason)
    raise JobExit(1, f"not restarting: {reason}", final=True)
