"""Where a job runs, one object per kind: ``local`` (submitit's local executor, one node) or
``slurm``. ``TrainJob`` asks its backend what differs between the two, and nothing else tests
the kind: how Ray comes up, who owns the run dir, how the job is requeued or held, whether
another job still lives, this start's Ray state dir, the node watch.

The kind is submitit's ``JobEnvironment.cluster`` inside a job and ``--cluster`` at submission
(rlhpc/cluster/ is the GPU layout, the ``cluster`` config section the allocation's shape).
"""

from __future__ import annotations

import os
import signal
from contextlib import AbstractContextManager
from typing import NoReturn

import submitit

from rlhpc.cluster.layout import plan_layout
from rlhpc.config import Config
from rlhpc.errors import RlhpcError
from rlhpc.launch import run_owner, slurm, slurm_ray
from rlhpc.launch.local_ray import local_ray
from rlhpc.launch.ray_cluster import NodeWatch
from rlhpc.launch.requeue import hold_local, hold_slurm, requeue_local, requeue_slurm
from rlhpc.launch.run_owner import Owner
from rlhpc.run_dir import JobRayState, RunDir
from rlhpc.runtime.signals import StopRequest
from rlhpc.util.processes import die_with_parent, running

KINDS = ("local", "slurm")


class LocalBackend:
    """One node; the job id is the pid of the job's controller, this task's parent."""

    kind = "local"

    def attach(self, env: submitit.JobEnvironment) -> None:
        """Tie this task to its controller, which the run dir's owner record names: if it dies
        (kill -9), so do we, at once, rather than train on as an orphan in a run dir that looks
        free (a SIGKILL loses nothing: checkpoints are renamed into place whole)."""
        die_with_parent(signal.SIGKILL)
        if str(os.getppid()) != str(env.job_id):
            raise RlhpcError(f"the local job's controller (pid {env.job_id}) is gone", "submit the run again")

    def owner(self, job_id: str) -> Owner:
        return Owner.local_job(int(job_id))

    def job_alive(self, job_id: str) -> bool | None:
        """Whether job ``job_id`` still runs; None when that cannot be told."""
        # Its controller's pid (its start time, which liveness compares, is not kept here).
        return running(int(job_id)) if job_id.isdigit() else None

    def ray_state(self, run: RunDir, job_id: str) -> JobRayState:
        return run.ray_state(job_id, 0)

    def ray(
        self, cfg: Config, run: RunDir, env: submitit.JobEnvironment, job_id: str, stop: StopRequest
    ) -> AbstractContextManager:
        """A private one-node Ray; yields "local"."""
        slots = plan_layout(cfg.cluster, cfg.reward_model, cfg.teacher).num_slots
        return local_ray(cfg.cluster, slots, stop, self.ray_state(run, job_id).token, run.local_ray_dir_file)

    def node_watch(self, cfg: Config, run: RunDir, job_id: str) -> NodeWatch | None:
        return None  # one node: nothing to lose but the job itself

    def engines_only(self, env: submitit.JobEnvironment) -> bool:
        return False

    def requeue(self, job_id: str, num_nodes: tuple[int, ...] | None = None) -> NoReturn:
        requeue_local(job_id)

    def hold(self, job_id: str, reason: str) -> NoReturn:
        hold_local(reason)


class SlurmBackend:
    """A Slurm job: Ray over the allocation; requeue and hold through scontrol."""

    kind = "slurm"

    def attach(self, env: submitit.JobEnvironment) -> None:
        pass  # Slurm ends the job's tasks itself

    def owner(self, job_id: str) -> Owner:
        return Owner.slurm_job(job_id)

    def job_alive(self, job_id: str) -> bool | None:
        return run_owner.liveness(Owner.slurm_job(job_id)).alive

    def ray_state(self, run: RunDir, job_id: str) -> JobRayState:
        return run.ray_state(job_id, slurm_ray.attempt())  # one per attempt

    def ray(
        self, cfg: Config, run: RunDir, env: submitit.JobEnvironment, job_id: str, stop: StopRequest
    ) -> AbstractContextManager:
        """Ray over the allocation: task 0 yields the head's address, the others ``None``."""
        return slurm_ray.slurm_ray(cfg, run, env, stop)

    def node_watch(self, cfg: Config, run: RunDir, job_id: str) -> NodeWatch | None:
        c = cfg.cluster
        return NodeWatch(self.ray_state(run, job_id), job_id, slurm_ray.node_gpus(c), c.replace_lost_nodes)

    def engines_only(self, env: submitit.JobEnvironment) -> bool:
        """A het job's rollout or reward component: it stages the model, not the actor's checkpoint."""
        return (slurm.het_group(env.global_rank) or 0) > 0

    def requeue(self, job_id: str, num_nodes: tuple[int, ...] | None = None) -> NoReturn:
        requeue_slurm(job_id, num_nodes)

    def hold(self, job_id: str, reason: str) -> NoReturn:
        hold_slurm(job_id, reason)


Backend = LocalBackend | SlurmBackend


def backend(kind: str) -> Backend:
    """The backend of ``kind`` (submitit's ``JobEnvironment.cluster``: local or slurm)."""
    if kind == "slurm":
        return SlurmBackend()
    if kind == "local":
        return LocalBackend()
    raise RlhpcError(f"no backend {kind!r}: rlhpc runs jobs {' or '.join(KINDS)}", "submit with jobs/submit.py")
