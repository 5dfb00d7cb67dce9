"""Follow-up jobs (``--then CMD``): a command that runs once a training run has succeeded.

Under Slurm each follow-up is its own job with ``--dependency=afterok:JOB`` (for a sweep: one
per task, ``afterok:ARRAY_TASK``) and ``--kill-on-invalid-dep=yes``: Slurm starts it when the
training job COMPLETED, and cancels it when that job failed, was cancelled or timed out. A
requeue is no end: rlhpc's own requeue (``scontrol requeue``) puts the job back in the queue,
so the follow-up waits for its real end, as it does for a job held after a restart loop.
Locally, ``jobs/submit.py`` runs the commands itself after the run succeeded.

The command runs with ``bash -c`` in the directory jobs/submit.py was started from, with the
submitting Python's environment (less the PYTHONSAFEPATH rlhpc sets for its own processes) and
``RLHPC_RUN_DIR`` set to the run dir.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import replace

import submitit

from rlhpc.errors import RlhpcError
from rlhpc.launch.slurm import SlurmOptions, slurm_executor
from rlhpc.run_dir import RunDir
from rlhpc.util.processes import SAFE_PATH_ENV

log = logging.getLogger(__name__)

RUN_DIR_ENV = "RLHPC_RUN_DIR"


class FollowUp:
    """The callable a follow-up job runs: ``command`` in ``cwd`` with RLHPC_RUN_DIR set."""

    def __init__(self, command: str, run_dir: str, cwd: str):
        self.command, self.run_dir, self.cwd = command, run_dir, cwd

    def __call__(self) -> int:
        env = {**os.environ, RUN_DIR_ENV: self.run_dir}
        # the user's own command, as the user would run it: a script of theirs may import what lies
        # beside it, which rlhpc's PYTHONSAFEPATH (for its own processes) would hide
        env.pop(SAFE_PATH_ENV, None)
        log.info("follow-up of %s: %s", self.run_dir, self.command)
        code = subprocess.run(["bash", "-c", self.command], cwd=self.cwd, env=env).returncode
        if code:
            raise RlhpcError(f"follow-up {self.command!r} exited with status {code}", "see its output above")
        return 0


def submit_after(run: RunDir, job_id: str, commands: list[str], opts: SlurmOptions) -> list[submitit.Job]:
    """One job per command, started by Slurm once job ``job_id`` succeeded (cancelled if it fails).
    It gets one node with the training job's GPUs per node, partition, account and time limit."""
    extra = {**opts.extra, "dependency": f"afterok:{job_id}", "kill-on-invalid-dep": "yes"}
    followup_opts = replace(opts, nodes=1, job_name=f"{opts.job_name}-then", extra=extra)
    executor = slurm_executor(run, followup_opts, folder=run.followup_dir)
    jobs = []
    for command in commands:
        job = executor.submit(FollowUp(command, str(run.path), os.getcwd()))
        log.info(
            "follow-up job %s runs after job %s succeeds: %s (log %s)", job.job_id, job_id, command, job.paths.stdout
        )
        jobs.append(job)
    return jobs


def run_now(run: RunDir, commands: list[str]) -> None:
    """Locally: the run succeeded, so run the commands here, one after another."""
    for command in commands:
        FollowUp(command, str(run.path), os.getcwd())()
