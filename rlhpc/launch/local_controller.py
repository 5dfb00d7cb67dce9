"""submitit's local executor and job controller, allowed as many starts as rlhpc's restart policy needs.

submitit's LocalExecutor starts ``python -m submitit.local._local``, whose controller starts
a task that asks for a restart (exit 144) at most 6 times, whatever ``checkpoint.max_restarts``
says; the job then ends without a result. Here the same controller runs with the number of
starts given (``max_restarts`` + 2: the first start, the restarts, and one more that rlhpc's
own policy refuses, so rlhpc, not the controller, decides when a local job stops).

    python -m rlhpc.launch.local_controller SUBMITIT_FOLDER MAX_STARTS
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import submitit
from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE, Controller, LocalJob

from rlhpc.util.processes import python_command

if TYPE_CHECKING:  # the controller process imports no more than it runs
    from rlhpc.run_dir import RunDir


class StoppableController(Controller):
    """SIGTERM (``kill PID``, as a refused submission says to stop a local job) stops the job for
    good: the task gets it, saves at its next safe point and asks for a restart, which is not
    given (submitit's controller would start it again). A SIGKILL of the controller takes the
    task with it (``TrainJob.run``)."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        self.stopping = False
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, signum: int, *args: object) -> None:
        self.stopping = True
        self._forward_signal(signum)

    def start_tasks(self) -> None:
        super().start_tasks()
        if self.stopping:  # the SIGTERM came before there was a task to pass it to
            self._forward_signal(signal.SIGTERM)

    def wait(self, freq: int = 24) -> list[int | None]:
        codes = list(super().wait(freq))
        for k, code in enumerate(codes):
            if code is not None and code < 0:  # said nowhere else: the task's own log ends before it
                print(f"rlhpc: local task {k} ended by signal {-code}", file=sys.stderr, flush=True)
        return [0 if self.stopping and c == LOCAL_REQUEUE_RETURN_CODE else c for c in codes]


class LocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose controller (``StoppableController``) starts the task up to
    ``max_starts`` times, in a session of its own.

    It overrides submitit's private ``_submit_command``: the public ``start_controller`` (submitit
    1.5.4) runs ``python -m submitit.local._local``, whose controller starts a task at most 6 times
    and restarts it after a SIGTERM, and takes no Popen arguments (no new session); nothing public
    chooses the controller (a ``setup`` line that execs ours would give it the submitter's pid as
    the job id). So its environment is written here as ``start_controller`` writes it, ``setup``
    and ``visible_gpus`` included."""

    def __init__(self, folder: Path, max_starts: int):
        super().__init__(folder=folder, python=shlex.join(python_command()))  # the task's command: python -P -u -m ...
        self.max_starts = max_starts

    def _submit_command(self, command: str) -> LocalJob:
        p = self.parameters
        ntasks = p.get("tasks_per_node", 1)
        visible = p.get("visible_gpus", ())
        gpus = range(p.get("gpus_per_node", 0)) if visible == () else visible[: p.get("gpus_per_node", 0)]
        setup = list(p.get("setup", ()))
        env = {
            **os.environ,
            "SUBMITIT_LOCAL_NTASKS": str(ntasks),
            "SUBMITIT_LOCAL_COMMAND": command,
            "SUBMITIT_LOCAL_TIMEOUT_S": str(int(60 * p.get("timeout_min", 2.0))),
            "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(int(p.get("signal_delay_s", 30))),
            "SUBMITIT_LOCAL_NODEID": "0",
            "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
            "SUBMITIT_STDERR_TO_STDOUT": "1" if p.get("stderr_to_stdout") else "",
            "SUBMITIT_EXECUTOR": "local",
            "CUDA_VISIBLE_DEVICES": ",".join(str(k) for k in gpus),
            "SUBMITIT_LOCAL_WITH_SHELL": "1" if setup else "",  # the job id is then the shell's pid
        }
        cmd: list[str] | str = python_command(
            "-m", "rlhpc.launch.local_controller", str(self.folder), str(self.max_starts)
        )
        if setup:
            cmd = " && ".join([*setup, shlex.join(cmd)])
        # A session of its own: a terminal's Ctrl-C reaches every process of its foreground group
        # (Ray's workers take it as a task cancellation, engines as a shutdown). It reaches only
        # this submission, which stops the job through its controller (``follow``'s ``stop``).
        process = subprocess.Popen(cmd, shell=bool(setup), env=env, start_new_session=True)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))


def local_executor(run: RunDir, timeout_min: int, gpus: int, max_restarts: int) -> LocalExecutor:
    # Starts: the first, max_restarts restarts, and one that rlhpc's restart policy refuses.
    executor = LocalExecutor(run.submitit_dir, max_starts=max_restarts + 2)
    # gpus=0 makes submitit hide GPUs (CUDA_VISIBLE_DEVICES=""): right on a CPU machine,
    # and on a workstation with GPUs we pass their count so the job sees them.
    executor.update_parameters(timeout_min=timeout_min, gpus_per_node=gpus, tasks_per_node=1, nodes=1)
    return executor


def main(argv: list[str]) -> None:
    folder, max_starts = argv
    StoppableController(Path(folder)).run(max_retry=int(max_starts))


if __name__ == "__main__":
    main(sys.argv[1:])
