"""Submission: validate everything, prepare the run dir, hand the job to submitit, follow it."""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import submitit
from submitit.local.local import LocalJob

from rlhpc.cluster import memory
from rlhpc.cluster.layout import idle_note, plan_layout, summarize_layout
from rlhpc.config import Config, dump_config
from rlhpc.errors import RlhpcError, StoppedByUser
from rlhpc.launch import run_owner, slurm
from rlhpc.launch.job import ENDED_LINE, TrainJob
from rlhpc.launch.run_owner import Owner
from rlhpc.launch.slurm import SlurmOptions, sbatch_script, slurm_executor
from rlhpc.run_dir import RunDir
from rlhpc.util.files import tail

log = logging.getLogger(__name__)


def choose_cluster(requested: str) -> str:
    if requested != "auto":
        return requested
    if slurm.slurm_available():
        return "slurm"
    log.info("no working Slurm here (sinfo does not answer): running the job locally (--cluster local)")
    return "local"


class LocalExecutor(submitit.LocalExecutor):
    """submitit's LocalExecutor whose controller starts the task up to ``max_starts`` times
    (rlhpc/launch/local_controller.py says why), with the environment submitit's gives it."""

    def __init__(self, folder: Path, max_starts: int):
        super().__init__(folder=folder)
        self.max_starts = max_starts

    def _submit_command(self, command: str) -> LocalJob:
        p = self.parameters
        ntasks = p.get("tasks_per_node", 1)
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
            "CUDA_VISIBLE_DEVICES": ",".join(str(k) for k in range(p.get("gpus_per_node", 0))),
            "SUBMITIT_LOCAL_WITH_SHELL": "",
        }
        cmd = [sys.executable, "-m", "rlhpc.launch.local_controller", str(self.folder), str(self.max_starts)]
        # A session of its own: a terminal's Ctrl-C reaches every process of its foreground group
        # (Ray's workers take it as a task cancellation, engines as a shutdown). It reaches only
        # this submission, which stops the job through its controller (``follow``'s ``stop``).
        process = subprocess.Popen(cmd, env=env, start_new_session=True)
        return LocalJob(folder=self.folder, job_id=str(process.pid), process=process, tasks=list(range(ntasks)))


def local_executor(run: RunDir, timeout_min: int, gpus: int, max_restarts: int) -> LocalExecutor:
    # Starts: the first, max_restarts restarts, and one that rlhpc's restart policy refuses.
    executor = LocalExecutor(run.submitit_dir, max_starts=max_restarts + 2)
    # gpus=0 makes submitit hide GPUs (CUDA_VISIBLE_DEVICES=""): right on a CPU machine,
    # and on a workstation with GPUs we pass their count so the job sees them.
    executor.update_parameters(timeout_min=timeout_min, gpus_per_node=gpus, tasks_per_node=1, nodes=1)
    return executor


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
        raise RlhpcError(
            f"job {job.job_id} failed: {_exception_line(str(value))}", f"see the job log {job.paths.stderr}"
        )
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


def _exception_line(text: str) -> str:
    """The ``SomeError: message`` line of a traceback, the part a user reads first."""
    hits = re.findall(r"^\s*([A-Za-z_.]*(?:Error|Exception|Interrupt)\b.*)$", text, flags=re.M)
    return hits[-1].strip() if hits else text.strip().splitlines()[-1] if text.strip() else "no error text"


def submit_owned(
    run: RunDir, start: Callable[[], submitit.Job], owner_of: Callable[[submitit.Job], Owner]
) -> submitit.Job:
    """Claim the run dir, ``start`` the job, hand the run dir to it. Refused, before anything is
    written or submitted, when another live job owns the run dir (rlhpc/launch/run_owner.py)."""
    me = Owner.submitter()
    run_owner.claim(run, me)
    try:
        job = start()
    except BaseException:
        run_owner.release(run, me)
        raise
    run_owner.hand_over(run, me, owner_of(job))
    return job


def start_local(run: RunDir, timeout_min: int, gpus: int, max_restarts: int) -> submitit.Job:
    job = local_executor(run, timeout_min, gpus, max_restarts).submit(TrainJob(str(run.path)))
    log.info("local job %s started; log: %s", job.job_id, job.paths.stdout)
    return job


def start_slurm(run: RunDir, opts: SlurmOptions) -> submitit.Job:
    job = slurm_executor(run, opts).submit(TrainJob(str(run.path)))
    run.write_job_id(job.job_id)
    log.info("submitted Slurm job %s (%d node(s) x %d GPU(s))", job.job_id, opts.nodes, opts.gpus_per_node)
    log.info("logs: %s (task 0), %s", job.paths.stdout, run.submitit_dir)
    log.info("follow: tail -f %s    status: python jobs/status.py %s", job.paths.stdout, run.path)
    return job


def dry_run(
    cfg: Config, run_dir: Path, opts: SlurmOptions, array: int | None = None, max_parallel: int | None = None
) -> str:
    """The sbatch script and the GPU plan, without submitting (or writing anything); ``array``:
    the script of a sweep's job array of that many tasks (the plan is its first task's)."""
    # submitit's own builder over the real run dir (it writes nothing until a submission): the
    # script shows each path as sbatch gets it, quoted whatever characters it holds.
    executor = slurm_executor(RunDir(run_dir), opts, preview=True, max_parallel=max_parallel)
    script = sbatch_script(executor, array)
    layout = summarize_layout(plan_layout(cfg.cluster, cfg.reward_model, cfg.teacher))
    idle = idle_note(cfg.cluster, cfg.reward_model, cfg.teacher)
    notes = f"\nWARNING: {idle}" if idle else ""
    where = "each task's layout.txt" if array else RunDir(run_dir).layout_file
    engine = (
        f"\n\nengine 0's launch line (each engine's alike):\n  {engine_preview(cfg)}"
        if cfg.rollout.backend == "sglang"
        else ""
    )
    rm = cfg.reward_model
    if rm is not None and rm.backend == "sglang":
        engine += f"\n\nreward engine 0's launch line (each reward engine's alike):\n  {reward_engine_preview(cfg)}"
    if cfg.teacher is not None and cfg.teacher.backend == "sglang":
        engine += f"\n\nteacher engine 0's launch line (each teacher engine's alike):\n  {teacher_engine_preview(cfg)}"
    return (
        f"{script}\n\n{layout}\n  full map: {where} (written at submission){notes}\n\n{memory.summarize(cfg)}{engine}\n\n"
        f"# the resolved config the job runs (written to {RunDir(run_dir).path / 'config.yaml'}):\n{dump_config(cfg)}"
    )


def reward_engine_preview(cfg: Config) -> str:
    """The SGLang server command of reward engine 0 (a classifier's with ``--is-embedding``: it serves /classify)."""
    from rlhpc.engine_server.sglang import SGLangSpec
    from rlhpc.rollout.reward_model import reward_rollout_config

    rm = cfg.reward_model
    sg = reward_rollout_config(cfg.rollout, rm).sglang
    spec = SGLangSpec(rm.gpus_per_engine, sg.mem_fraction_static, False, cfg.seed, extra_args=tuple(sg.extra_args))
    return _preview(spec, rm.path or "<run dir>/reward_model")


def teacher_engine_preview(cfg: Config) -> str:
    """The SGLang server command of teacher engine 0."""
    from rlhpc.engine_server.sglang import SGLangSpec
    from rlhpc.rollout.teacher import teacher_rollout_config

    t = cfg.teacher
    sg = teacher_rollout_config(cfg.rollout, t).sglang
    spec = SGLangSpec(t.gpus_per_engine, sg.mem_fraction_static, False, cfg.seed, extra_args=tuple(sg.extra_args))
    return _preview(spec, t.path or "<run dir>/teacher")


def engine_preview(cfg: Config) -> str:
    """The SGLang server command of engine 0, with what is known only on the node as <...>."""
    from rlhpc.engine_server.sglang import SGLangSpec

    c, sg = cfg.cluster, cfg.rollout.sglang
    tp = c.rollout_gpus_per_engine
    nnodes = max(1, tp // (c.rollout_gpus_per_node or c.gpus_per_node))
    spec = SGLangSpec(
        tp, sg.mem_fraction_static, c.colocate or c.offload, cfg.seed, extra_args=tuple(sg.extra_args), nnodes=nnodes
    )
    return _preview(spec, cfg.model.path or "<run dir>/base_model")


def _preview(spec: Any, model: str) -> str:
    """``spec``'s launch line (an ``SGLangSpec``), with what is known only on the node as <...>."""
    from rlhpc.engine_server.sglang import launch_server_command

    nnodes = spec.nnodes
    cmd = launch_server_command(
        "python", model, "<node ip>", 0, 0, spec, "<node rank 0 ip>:<port>" if nnodes > 1 else None,
        Path("<engine tmp dir>/sglang_key.yaml"),
    )  # fmt: skip
    for flag in ("--port", "--nccl-port"):
        cmd[cmd.index(flag) + 1] = "<free port>"
    return shlex.join(cmd).replace("'", "")
