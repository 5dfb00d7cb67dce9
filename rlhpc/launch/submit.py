"""Submission: validate everything, prepare the run dir, hand the job to submitit, follow it."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import submitit

from rlhpc.cluster.layout import describe_layout, plan_layout
from rlhpc.config import Config
from rlhpc.errors import RlhpcError
from rlhpc.launch import slurm
from rlhpc.launch.job import TrainJob
from rlhpc.launch.slurm import SlurmOptions, sbatch_script, slurm_executor
from rlhpc.run_dir import RunDir

log = logging.getLogger(__name__)


def choose_cluster(requested: str) -> str:
    if requested != "auto":
        return requested
    if slurm.slurm_available():
        return "slurm"
    log.info("no working Slurm here (sinfo does not answer): running the job locally (--cluster local)")
    return "local"


def local_executor(run: RunDir, timeout_min: int, gpus: int) -> submitit.LocalExecutor:
    executor = submitit.LocalExecutor(folder=run.submitit_dir)
    # gpus=0 makes submitit hide GPUs (CUDA_VISIBLE_DEVICES=""): right on a CPU machine,
    # and on a workstation with GPUs we pass their count so the job sees them.
    executor.update_parameters(timeout_min=timeout_min, gpus_per_node=gpus, tasks_per_node=1, nodes=1)
    return executor


def _slurm_done(job: submitit.Job) -> bool:
    # submitit's own watcher asks sacct, which many sites (and the minicluster) do not run.
    if job.paths.result_pickle.exists():
        return True
    return slurm.job_state(job.job_id) not in slurm.SLURM_ACTIVE


def follow(job: submitit.Job, poll_s: float = 0.5) -> int:
    """Stream task 0's output to this terminal until the job ends; 0 if it succeeded."""
    is_done = _slurm_done if isinstance(job, submitit.SlurmJob) else (lambda j: j.done())
    out_pos = err_pos = 0

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

    while True:
        done = is_done(job)
        out_pos = pump(job.paths.stdout, out_pos, sys.stdout)
        err_pos = pump(job.paths.stderr, err_pos, sys.stderr)
        if done:
            break
        time.sleep(poll_s)
    for _ in range(20):  # the result file can land a moment after the state changes
        if job.paths.result_pickle.exists():
            break
        time.sleep(0.25)
    if not job.paths.result_pickle.exists():
        raise RlhpcError(
            f"job {job.job_id} ended without a result (cancelled, or killed by Slurm)",
            f"see the job log {job.paths.stderr}",
        )
    outcome, value = submitit.core.utils.pickle_load(job.paths.result_pickle)
    if outcome != "success":  # the job's own traceback is already in its stderr above
        raise RlhpcError(
            f"job {job.job_id} failed: {_exception_line(str(value))}", f"see the job log {job.paths.stderr}"
        )
    return 0


def _exception_line(text: str) -> str:
    """The ``SomeError: message`` line of a traceback, the part a user reads first."""
    hits = re.findall(r"^\s*([A-Za-z_.]*(?:Error|Exception|Interrupt)\b.*)$", text, flags=re.M)
    return hits[-1].strip() if hits else text.strip().splitlines()[-1] if text.strip() else "no error text"


def submit_local(run: RunDir, timeout_min: int, gpus: int, wait: bool) -> int:
    job = local_executor(run, timeout_min, gpus).submit(TrainJob(str(run.path)))
    log.info("local job %s started; log: %s", job.job_id, job.paths.stdout)
    if not wait:
        log.info("follow it with: tail -f %s", job.paths.stdout)
        return 0
    return follow(job)


def submit_slurm(run: RunDir, opts: SlurmOptions, wait: bool) -> int:
    executor = slurm_executor(run, opts)
    job = executor.submit(TrainJob(str(run.path)))
    run.write_job_id(job.job_id)
    log.info("submitted Slurm job %s (%d node(s) x %d GPU(s))", job.job_id, opts.nodes, opts.gpus_per_node)
    log.info("logs: %s (task 0), %s", job.paths.stdout, run.submitit_dir)
    log.info("follow: tail -f %s    status: python jobs/status.py %s", job.paths.stdout, run.path)
    return follow(job) if wait else 0


def dry_run(cfg: Config, run_dir: Path, opts: SlurmOptions) -> str:
    """The sbatch script and the GPU plan, without submitting (or writing anything)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # submitit wants a folder; the real one stays untouched
        script = sbatch_script(slurm_executor(RunDir(tmp), opts)).replace(tmp, str(run_dir))
    layout = describe_layout(plan_layout(cfg.cluster), cfg.cluster.gpus_per_node)
    return f"{script}\n\n{layout}\n"
