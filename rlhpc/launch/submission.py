"""Submission: validate everything, prepare the run dir, hand the job to submitit, follow it.

``submit`` is ``jobs/submit.py`` once its command line is parsed (rlhpc/cli/submit.py): a run or
a sweep, on Slurm or locally (the backend kind, ``--cluster``), with its follow-up jobs.
Every refusal comes before anything is written or submitted.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import submitit

from rlhpc.cluster.layout import idle_note
from rlhpc.config import Config
from rlhpc.errors import ConfigError, RlhpcError
from rlhpc.launch import run_owner, slurm
from rlhpc.launch.fleet import run_shared
from rlhpc.launch.follow import follow
from rlhpc.launch.followup import run_now, submit_after
from rlhpc.launch.job import TrainJob
from rlhpc.launch.local_controller import local_executor
from rlhpc.launch.preview import dry_run
from rlhpc.launch.run_owner import Owner
from rlhpc.launch.slurm import SlurmOptions, parse_extra, parse_time, preflight, slurm_executor
from rlhpc.launch.sweep import SweepTask, parse_sweeps, plan_sweep, run_locally, submit_array
from rlhpc.logs import FORCE_TERMINAL_ENV
from rlhpc.preflight import load_config
from rlhpc.run_dir import RunDir, SweepDir

log = logging.getLogger("rlhpc.submit")

# Config keys that fix the allocation's shape: the tasks of one job array share it.
ALLOCATION_KEYS = (
    "cluster.num_nodes",
    "cluster.gpus_per_node",
    "cluster.rollout_nodes",
    "cluster.rollout_gpus_per_node",
    "cluster.reward_nodes",
    "cluster.reward_gpus_per_node",
)


@dataclass(frozen=True)
class SbatchArgs:
    """The sbatch options given at submission; the node and GPU counts come from the config."""

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"
    constraint: str | None = None
    exclusive: bool = False
    job_name: str = "rlhpc"
    cpus_per_task: int | None = None
    signal_grace_s: int = 120
    extra: tuple[str, ...] = ()  # OPTION[=VALUE]

    def options(self, cfg: Config) -> SlurmOptions:
        c = cfg.cluster
        opts = SlurmOptions(
            nodes=c.num_nodes,
            gpus_per_node=c.gpus_per_node,
            partition=self.partition,
            account=self.account,
            qos=self.qos,
            time_min=parse_time(self.time),
            constraint=self.constraint,
            exclusive=self.exclusive,
            job_name=self.job_name,
            cpus_per_task=self.cpus_per_task,
            signal_grace_s=self.signal_grace_s,
            extra=parse_extra(list(self.extra)),
            rollout_nodes=c.rollout_nodes,
            rollout_gpus_per_node=c.rollout_gpus_per_node,
            rollout_partition=c.rollout_partition,
            reward_nodes=c.reward_nodes,
            reward_gpus_per_node=c.reward_gpus_per_node,
            reward_partition=c.reward_partition,
        )
        opts.check()
        return opts


@dataclass(frozen=True)
class Submission:
    """What to submit: ``jobs/submit.py``'s options, the allocation's already as config overrides."""

    config: Path
    run_dir: Path
    overrides: tuple[str, ...] = ()
    kind: str = "auto"  # the backend: auto, local or slurm (--cluster)
    force: bool = False
    dry_run: bool = False
    prepare_only: bool = False
    follow: bool | None = None  # None: follow a local run, not a Slurm one
    sweeps: tuple[str, ...] = ()  # KEY=V1,V2,...
    max_parallel: int | None = None
    shared_fleet: bool = False  # the sweep's LoRA tasks share one engine fleet (rlhpc.launch.fleet)
    then: tuple[str, ...] = ()  # follow-up commands
    sbatch: SbatchArgs = field(default_factory=SbatchArgs)


def choose_kind(requested: str) -> str:
    """The backend kind: ``requested``, or for auto Slurm where ``sinfo`` answers, else local."""
    if requested != "auto":
        return requested
    if slurm.slurm_available():
        return "slurm"
    log.info("no working Slurm here (sinfo does not answer): running the job locally (--cluster local)")
    return "local"


def submit(s: Submission) -> int:
    """Submit (or preview, or prepare) ``s``; the exit code of ``jobs/submit.py``."""
    sweeps = parse_sweeps(list(s.sweeps))
    check_options(s, sweeps)
    cfg = load_config(s.config, list(s.overrides))
    opts = s.sbatch.options(cfg)
    idle = idle_note(cfg.cluster, cfg.reward_model, cfg.teacher)
    if idle and not s.dry_run:  # the dry run prints it with the plan
        log.warning("%s", idle)
    if sweeps:
        return submit_sweep(s, sweeps, opts)
    run = RunDir(s.run_dir)
    if s.dry_run:  # the run dir's checks too: a preview of a submission that would be refused is none
        run.check(cfg, force=s.force)
        run_owner.check_free(run)
        print(dry_run(cfg, Path(s.run_dir).resolve(), opts), end="")
        return 0
    kind = choose_kind(s.kind)
    if kind == "slurm":
        if not s.prepare_only:  # inside an allocation (templates) there is nothing to check
            preflight(opts)
    else:
        check_local(cfg, s)
    run.check(cfg, force=s.force)  # every refusal before anything is written
    # Inside an allocation (a template's --prepare-only) this job may own the run dir already.
    in_job = os.environ.get("SLURM_JOB_ID")
    run_owner.check_free(run, Owner.slurm_job(in_job) if in_job else None)
    if s.prepare_only:  # the job claims the run dir when it starts
        run.prepare(cfg, force=s.force)
        log.info("run dir %s is ready; start every task with: srun python -P -m rlhpc.launch.task %s", run, run)
        return 0
    if kind == "slurm":
        return _submit_slurm(s, cfg, opts, run)
    return _submit_local(s, cfg, opts, run)


def check_options(s: Submission, sweeps: list) -> None:
    """Options that do not go together, refused before anything is read or written."""
    if s.shared_fleet and not sweeps:
        raise ConfigError("--shared-fleet without --sweep", "add --sweep KEY=V1,V2,... or drop --shared-fleet")
    if s.shared_fleet and s.max_parallel is not None:
        raise ConfigError(
            "--shared-fleet with --max-parallel: the tasks of a shared fleet run all at once",
            "drop --max-parallel, or --shared-fleet",
        )
    if s.max_parallel is not None and not sweeps:
        raise ConfigError("--max-parallel without --sweep", "add --sweep KEY=V1,V2,... or drop --max-parallel")
    if s.max_parallel is not None and s.max_parallel < 1:
        raise ConfigError(f"--max-parallel {s.max_parallel} must be at least 1", "give the tasks to run at once")
    shape = [k for k, _ in sweeps if k in ALLOCATION_KEYS]
    if shape:
        raise ConfigError(
            f"--sweep {shape[0]}: the tasks of a job array share one allocation shape",
            "submit one sweep per --nodes/--gpus-per-node",
        )
    if s.prepare_only and (sweeps or s.then):
        raise ConfigError(
            "--prepare-only prepares one run dir for a template", "drop --sweep/--then, or submit without it"
        )
    if any(not c.strip() for c in s.then):
        raise ConfigError("--then with an empty command", 'write e.g. --then "python my_eval.py"')


def check_local(cfg: Config, s: Submission) -> None:
    """What a local run cannot do: more than one node, follow-ups without following."""
    if cfg.cluster.num_nodes != 1 or cfg.cluster.heterogeneous:
        raise RlhpcError(
            f"a local run has one node, but cluster.num_nodes = {cfg.cluster.num_nodes}"
            + (f" and cluster.rollout_nodes = {cfg.cluster.rollout_nodes}" if cfg.cluster.heterogeneous else ""),
            "submit to Slurm, or set --nodes 1 (and no --rollout-nodes)",
        )
    if s.then and s.follow is False:
        raise RlhpcError("--then with --no-follow on a local run", "drop --no-follow: the follow-ups run when it ends")


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


def _submit_slurm(s: Submission, cfg: Config, opts: SlurmOptions, run: RunDir) -> int:
    def start():
        run.prepare(cfg, force=s.force)
        return start_slurm(run, opts)

    job = submit_owned(run, start, lambda j: Owner.slurm_job(j.job_id))
    submit_after(run, job.job_id, list(s.then), opts)
    return follow(job) if s.follow else 0


def _local_gpus(driver: Path = Path("/proc/driver/nvidia/gpus")) -> int:
    """This machine's NVIDIA GPUs that CUDA_VISIBLE_DEVICES leaves visible, as CUDA counts them
    (up to the first entry that is not a device), without importing torch (seconds, each job):
    the NVIDIA driver lists each GPU as a dir under ``driver``."""
    installed = len(list(driver.iterdir())) if driver.is_dir() else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    named = []
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break  # CUDA stops at an invalid index: "-1" hides every GPU
        named.append(entry)
    return min(len(named), installed)


def _start_local_owned(s: Submission, cfg: Config, run: RunDir, time_min: int) -> submitit.Job:
    def start():
        run.prepare(cfg, force=s.force)
        return start_local(run, time_min, _local_gpus(), cfg.checkpoint.max_restarts)

    return submit_owned(run, start, lambda j: Owner.local_job(int(j.job_id)))


def _submit_local(s: Submission, cfg: Config, opts: SlurmOptions, run: RunDir) -> int:
    if s.follow is not False and sys.stdout.isatty():
        os.environ[FORCE_TERMINAL_ENV] = "1"  # the job writes to a file we stream to this terminal
    job = _start_local_owned(s, cfg, run, opts.time_min)
    if s.follow is False:
        log.info("follow it with: tail -f %s", job.paths.stdout)
        return 0
    code = follow(job)
    run_now(run, list(s.then))
    return code


def submit_sweep(s: Submission, sweeps: list, opts: SlurmOptions) -> int:
    """``--sweep``: every task checked, then ONE job array (Slurm) or the tasks in turn (local)."""
    if opts.rollout_nodes is not None:
        raise RlhpcError(
            "--sweep with --rollout-nodes: a sweep is one Slurm job array, and Slurm has no arrays of "
            "heterogeneous jobs",
            "submit each configuration as a job of its own, or sweep without --rollout-nodes",
        )
    sweep = SweepDir(s.run_dir)
    tasks = plan_sweep(s.config, list(s.overrides), sweeps, sweep, s.force, s.shared_fleet)
    if s.dry_run:
        print(dry_run(tasks[0].cfg, sweep.path, opts, array=len(tasks), max_parallel=s.max_parallel), end="")
        for t in tasks:
            print(f"  task {t.index}: {t.describe()} -> {t.run}")
        return 0
    if choose_kind(s.kind) == "slurm":
        if s.shared_fleet:
            raise RlhpcError(
                "--shared-fleet on Slurm: a job array gives each task its own allocation, and one allocation "
                "running every task beside one fleet is not built yet",
                "run the shared-fleet sweep locally (--cluster local), or drop --shared-fleet",
            )
        preflight(opts)
        submitted = submit_array(sweep, tasks, opts, s.max_parallel, s.force)
        for t, job in submitted:
            submit_after(t.run, job.job_id, list(s.then), opts)
        return 0
    return _sweep_locally(s, sweep, tasks, opts)


def _sweep_locally(s: Submission, sweep: SweepDir, tasks: list[SweepTask], opts: SlurmOptions) -> int:
    """The sweep's tasks one after another on this machine, each followed to its end."""
    if opts.nodes != 1:
        raise RlhpcError(
            f"a local run has one node, but cluster.num_nodes = {opts.nodes}", "submit to Slurm, or set --nodes 1"
        )
    if s.follow is not False and sys.stdout.isatty():
        os.environ[FORCE_TERMINAL_ENV] = "1"

    def follow_then(t: SweepTask, job: submitit.Job) -> int:
        code = follow(job)
        run_now(t.run, list(s.then))
        return code

    run = run_shared if s.shared_fleet else run_locally
    failed = run(sweep, tasks, lambda t: _start_local_owned(s, t.cfg, t.run, opts.time_min), follow_then)
    if failed:
        raise RlhpcError(
            f"{len(failed)} of {len(tasks)} sweep task(s) failed: "
            + "; ".join(f"task {t.index} ({t.describe()}): {why}" for t, why in failed),
            f"see each task's log under its run dir; run the same command again to resume them ({sweep})",
        )
    return 0
