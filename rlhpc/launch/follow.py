"""Following a submitted job from the submitting terminal: its output streamed, its end said plainly."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import submitit
from submitit.local.local import LocalJob

from rlhpc.errors import RlhpcError, StoppedByUser
from rlhpc.launch import slurm
from rlhpc.launch.job import ENDED_LINE
from rlhpc.util.files import tail

log = logging.getLogger(__name__)


def _slurm_done(job: submitit.Job) -> bool:
    # submitit's own watcher asks sacct, which many sites (and the minicluster) do not run.
    if job.paths.result_pickle.exists():
        return True
    info = slurm.show_job(job.job_id)
    # A held job waits for a person: following it would never end.
    return info is None or info.get("JobState") not in slurm.SLURM_ACTIVE or slurm.hold_reason(info) is not None


def follow(job: submitit.Job, poll_s: float = 0.5) -> int:
    """Stream task 0's output to this terminal until the job ends; 0 if it succeeded.

    A local job is stopped by the first Ctrl-C (or the terminal closing): its controller gets
    SIGTERM, so the job saves at its next safe point and ends for good, and this raises
    ``StoppedByUser`` once it has. A second Ctrl-C leaves it stopping on its own."""
    is_done = _slurm_done if isinstance(job, submitit.SlurmJob) else (lambda j: j.done())
    stop = isinstance(job, LocalJob)
    out_pos = err_pos = 0
    stopping = False

    def pump(path: Path, pos: int, stream) -> int:
        if path.is_file():
            with open(path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            if chunk:
                stream.buffer.write(chunk)
                stream.flush()
            return pos + len(chunk)
        return pos

    hangup = signal.signal(signal.SIGHUP, _interrupt) if stop else None
    try:
        while True:
            try:
                done = is_done(job)
                out_pos = pump(job.paths.stdout, out_pos, sys.stdout)
                err_pos = pump(job.paths.stderr, err_pos, sys.stderr)
                if done:
                    break
                time.sleep(poll_s)
            except KeyboardInterrupt:
                if not stop or stopping:
                    raise
                stopping = True
                os.kill(int(job.job_id), signal.SIGTERM)  # the controller: rlhpc/launch/local_controller.py
                log.warning(
                    "stopping local job %s at its next safe point (it saves there); Ctrl-C again leaves it "
                    "stopping on its own", job.job_id,
                )  # fmt: skip
    finally:
        if hangup is not None:
            signal.signal(signal.SIGHUP, hangup)
    if stopping:
        raise StoppedByUser(
            f"local job {job.job_id} stopped at your request", "run the same command again to resume where it stopped"
        )
    for _ in range(20):  # the result file can land a moment after the state changes
        if job.paths.result_pickle.exists():
            break
        time.sleep(0.25)
    if not job.paths.result_pickle.exists():
        raise _no_result(job)
    outcome, value = submitit.core.utils.pickle_load(job.paths.result_pickle)
    if outcome != "success":  # the job's own traceback is already in its stderr above
        line, fix = _exception_line(str(value))
        log_fix = f"see the job log {job.paths.stderr}"
        raise RlhpcError(f"job {job.job_id} failed: {line}", f"{fix} ({log_fix})" if fix else log_fix)
    return 0


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt  # the terminal closed: stop the job as a Ctrl-C would


# The line a task writes when it ends on purpose without a result (a hold, a refused requeue).
_ENDING = re.compile(rf"^{re.escape(ENDED_LINE)}(.*)$", flags=re.M)


def _no_result(job: submitit.Job) -> RlhpcError:
    """Say plainly how a job that left no result ended."""
    said = _ENDING.findall(tail(job.paths.stderr, 200))
    why = said[-1].strip() if said else None
    if isinstance(job, submitit.SlurmJob):
        info = slurm.show_job(job.job_id)
        held = slurm.hold_reason(info)
        if held is not None:
            return RlhpcError(
                f"job {job.job_id} is held ({held}){': ' + why if why else ''}",
                f"fix what its log says ({job.paths.stderr}), then `scontrol release {job.job_id}`: it resumes "
                f"from the newest checkpoint; or `scancel {job.job_id}`",
            )
        state = info.get("JobState") if info else "no longer known to Slurm"
        return RlhpcError(
            f"job {job.job_id} ended without a result ({state}): {why or 'cancelled, or killed by Slurm'}",
            f"see the job log {job.paths.stderr}; run the same command again to resume from the newest checkpoint",
        )
    return RlhpcError(
        f"local job {job.job_id} ended without a result: "
        f"{why or 'its task was killed (a signal, out of memory, or the --time limit)'}",
        f"see the job log {job.paths.stderr}; run the same command again to resume from the newest checkpoint",
    )


def _exception_line(text: str) -> tuple[str, str | None]:
    """The ``SomeError: message`` line of a traceback, the part a user reads first, and the fix
    an ``RlhpcError`` printed under it (None if none)."""
    lines = text.strip().splitlines()
    hits = [i for i, line in enumerate(lines) if _ERROR_LINE.match(line)]
    if not hits:
        return (lines[-1] if lines else "no error text"), None
    i = hits[-1]
    fix = lines[i + 1].strip().removeprefix("fix:").strip() if i + 1 < len(lines) and _FIX.match(lines[i + 1]) else None
    return lines[i].strip(), fix


_ERROR_LINE = re.compile(r"^\s*[A-Za-z_.]*(?:Error|Exception|Interrupt)\b.*$")
_FIX = re.compile(r"^\s+fix: ")
