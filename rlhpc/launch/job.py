"""What runs inside the allocation: bring up Ray, run the driver, mark the run finished.

``TrainJob`` is the callable submitit pickles. It carries only the run directory: all resume
state is read from disk, so a requeue (or a node-failure rerun of the original pickle)
continues from the newest checkpoint. It is a plain callable, not submitit's
``Checkpointable``: rlhpc requeues itself (rlhpc/launch/requeue.py says why and how).
Running jobs' pickles name ``rlhpc.launch.job.TrainJob``: the class stays here, by that name.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from contextlib import suppress

import submitit
from rich.console import Console

from rlhpc.checkpoint import CheckpointManager
from rlhpc.config import Config
from rlhpc.errors import RlhpcError
from rlhpc.launch import run_owner, slurm
from rlhpc.launch.backend import Backend, backend
from rlhpc.launch.ray_cluster import NodeWatch
from rlhpc.launch.requeue import JobExit
from rlhpc.launch.run_owner import Owner
from rlhpc.launch.slurm_ray import node_counts, wait_until_unusable
from rlhpc.logs import setup_logging
from rlhpc.preflight import config_from_dict as preflight_config_from_dict
from rlhpc.run_dir import RunDir
from rlhpc.runtime import staging
from rlhpc.runtime.restarts import RestartPolicy, read_history, record_start, refuse_reason
from rlhpc.runtime.signals import Stopped, StopRequest, shield_from_user_signal
from rlhpc.runtime.staging import NOT_STAGED, Staged
from rlhpc.runtime.startup import StartupClock
from rlhpc.util.files import apply_access
from rlhpc.util.processes import safe_python_env

log = logging.getLogger(__name__)

ENDED_LINE = "rlhpc: task ended without a result: "


class TrainJob:
    """The job: one call per task. Stops, requeues and restart loops are decided here."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.owner: Owner | None = None  # task 0, once it owns the run dir
        self.job_id = ""

    def __call__(self) -> dict:
        """The process boundary: the one place a ``JobExit`` (requeue, hold) becomes the exit code."""
        # First: submitit's USR2 handler must never act on this job, and Ray and the engines,
        # started from here, inherit an ignored USR2 and live on until the driver has saved.
        shield_from_user_signal()
        try:
            result = self.run()
        except JobExit as e:
            if e.final:
                self._ended("failed", str(e))  # a hold already said so (held)
                self._release()
            # One unwrapped line (the log may wrap): jobs/submit.py --follow quotes it (ENDED_LINE).
            print(f"{ENDED_LINE}{e}", file=sys.stderr, flush=True)
            raise SystemExit(e.code) from None
        except BaseException as e:  # the job ends here for good; a requeue raises JobExit instead
            if not isinstance(e, KeyboardInterrupt | SystemExit):
                self._ended("failed", e.problem if isinstance(e, RlhpcError) else f"{type(e).__name__}: {e}")
            self._release()
            raise
        self._release()
        return result

    def _ended(self, state: str, reason: str) -> None:
        """Task 0 records how the job ended (``RunDir.mark_ended``), unless this start said it already."""
        run = RunDir(self.run_dir)
        if self.owner is not None and not run.ended_file.exists():
            with suppress(OSError):  # the run dir's disk may be what failed
                run.mark_ended(state, self.job_id, reason.splitlines()[0] if reason else "")

    def _release(self) -> None:
        if self.owner is not None:
            run_owner.release(RunDir(self.run_dir), self.owner)

    def run(self) -> dict:
        """Train, or raise ``JobExit`` when this task must end without a result."""
        began = time.monotonic()  # the start-up clock's origin: every start pays what follows
        run = RunDir(self.run_dir)
        # every check again on the job's own node: its reward, data and environment
        cfg = preflight_config_from_dict(run.config_tree())
        apply_access(run.path, cfg.run_dir_access)  # on every node: Slurm's umask is the submitter's shell's
        safe_python_env()  # every Python it starts (Ray's included) imports nothing from the working dir
        console = setup_logging(cfg.logging.level)
        env = submitit.JobEnvironment()
        where = backend(env.cluster)
        # From here a SIGTERM (`kill PID`, a preemption without USR2) stops the job at its first
        # safe point; submitit's own handler would drop one that comes before Ray is up.
        stop = StopRequest().install((signal.SIGTERM,))
        where.attach(env)
        job_id = slurm.own_job_id(str(env.job_id))  # an array task: 77_3, as the run dir's owner names it
        self.job_id = job_id
        if env.global_rank == 0:
            self.owner = self._own_run_dir(run, where.owner(job_id))
            run.ended_file.unlink(missing_ok=True)  # this start is the run's state now
        if run.is_finished():  # a requeue or resubmission of a finished run has nothing to do
            log.info("run %s is already finished", run)
            return {"already_finished": True}
        if env.global_rank == 0:
            self._check_restart_loop(cfg, run, where, job_id)
        startup = StartupClock(run, job_id, origin=began)
        if env.global_rank == 0:
            startup.record("prepare", began)
        staged = self._stage(cfg, run, env, where, job_id, startup) if cfg.cluster.stage_dir else NOT_STAGED
        try:
            return self._run_staged(cfg, run, env, where, job_id, startup, staged, console, stop)
        finally:
            staged.remove()

    def _run_staged(
        self,
        cfg: Config,
        run: RunDir,
        env: submitit.JobEnvironment,
        where: Backend,
        job_id: str,
        startup: StartupClock,
        staged: Staged,
        console: Console,
        stop: StopRequest,
    ) -> dict:
        ray_began = time.monotonic()
        watch: NodeWatch | None = None
        try:
            with where.ray(cfg, run, env, job_id, stop) as head:
                if head is None:  # a Slurm worker task: Ray served, driver done
                    return {"task": env.global_rank}
                startup.record("ray_up", ray_began)
                # Imported here, not at the top: the driver imports ray, which reads its auth
                # settings (RAY_AUTH_*) once, at its first import; they exist only once Ray is up.
                from rlhpc.driver import make_progress, train

                watch = where.node_watch(cfg, run, job_id)
                try:
                    with make_progress(console) as progress:
                        summary = train(cfg, run, progress, stop, startup, staged)
                finally:
                    if watch is not None:
                        with suppress(Exception):
                            watch.check()  # a failure may be the first sign of a lost node
                        watch.close()
        except Stopped as e:  # Ray is down by now, on every node
            log.warning("%s; requeueing", e)
            where.requeue(job_id)
        except Exception as e:
            if watch is not None and watch.lost:  # the ranks' state went with a node: resume elsewhere
                nodes = sorted(set(watch.lost.values()))
                log.error("the run stopped after losing node(s) %s (%s); requeueing", ", ".join(nodes), e)
                wait_until_unusable(nodes)
                where.requeue(job_id, node_counts(cfg.cluster))
            if isinstance(e, RlhpcError) and not e.transient:  # a clear, named problem: a requeue would not fix it
                raise
            if not cfg.checkpoint.requeue_on_failure or env.global_rank != 0:
                raise
            log.exception("the job failed; requeueing (checkpoint.requeue_on_failure)")
            where.requeue(job_id)
        run.mark_finished(summary)
        log.info("run finished: %s", run)
        return summary

    @staticmethod
    def _stage(
        cfg: Config, run: RunDir, env: submitit.JobEnvironment, where: Backend, job_id: str, startup: StartupClock
    ) -> Staged:
        """Copy the model and the checkpoint to be resumed from to this node (``rlhpc.runtime.staging``)."""
        began = time.monotonic()
        latest = None
        if cfg.checkpoint.resume == "auto":  # the driver resumes from it unless its content is damaged
            latest = CheckpointManager(run.checkpoints, cfg.checkpoint.keep_last).latest(content=False)
        root = staging.stage_root(cfg.cluster.stage_dir, job_id)
        if root.parent.is_dir():
            staging.remove_stale(root, where.job_alive)
        engines_only = where.engines_only(env)
        paths = staging.plan(root, run.model_path(cfg), None if engines_only or latest is None else str(latest.path))
        state = where.ray_state(run, job_id)  # this attempt's
        broadcast = None
        if staging.use_sbcast(cfg.cluster, where.kind, env.num_nodes):
            broadcast = staging.Broadcast(job_id, state.root / "staged")
        if broadcast is not None and env.global_rank != 0:
            staged = staging.receive(paths, root, broadcast)
        else:
            staged = staging.stage(paths, root, broadcast if env.global_rank == 0 else None)
        if env.global_rank == 0:
            if where.kind == "slurm":  # for a replacement node (NodeWatch); a local job has none
                staging.write_plan(state.root, root, paths)
            startup.record("stage", began)
        return staged

    @staticmethod
    def _own_run_dir(run: RunDir, me: Owner) -> Owner:
        """Become the run dir's owner, or refuse to run: two jobs of one run can be queued by hand."""
        run_owner.wait_for_submitter(run)  # a job can start before jobs/submit.py wrote its id
        run_owner.claim(run, me)
        return me

    @staticmethod
    def _check_restart_loop(cfg: Config, run: RunDir, where: Backend, job_id: str) -> None:
        """Record this start; hold the job if it keeps restarting without progress."""
        # sizes only: the driver checks the content of the one it resumes from
        latest = CheckpointManager(run.checkpoints, cfg.checkpoint.keep_last).latest(content=False)
        # Counted from the run's own history: Slurm keeps the job id across requeues, and the
        # local executor has no SLURM_RESTART_COUNT.
        restarts = sum(1 for h in read_history(run) if h["job_id"] == job_id)
        history = record_start(run, job_id, restarts, latest.next_rollout_id if latest else 0)
        policy = RestartPolicy(cfg.checkpoint.max_restarts, cfg.checkpoint.max_starts_without_progress)
        reason = refuse_reason(history, policy)
        if reason:
            run.mark_ended("held", job_id, reason)
            where.hold(job_id, reason)
