"""What runs inside the allocation: bring up Ray, run the driver, mark the run finished.

``TrainJob`` is the callable submitit pickles. It carries only the run directory: all resume
state is read from disk, so a requeue (or a node-failure rerun of the original pickle)
continues from the newest checkpoint. It is a plain callable, not submitit's
``Checkpointable``: rlhpc requeues itself (rlhpc/launch/restarts.py says why and how).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import submitit

from rlhpc.checkpoint import CheckpointManager
from rlhpc.config import ClusterConfig, Config
from rlhpc.errors import RlhpcError
from rlhpc.launch import run_owner
from rlhpc.launch.restarts import JobExit, RestartPolicy, hold, read_history, record_start, refuse_reason, requeue
from rlhpc.launch.run_owner import Owner
from rlhpc.launch.signals import Stopped, StopRequest, shield_from_user_signal
from rlhpc.logs import setup_logging
from rlhpc.run_dir import RunDir
from rlhpc.util.secrets import write_secret

log = logging.getLogger(__name__)

ENDED_LINE = "rlhpc: task ended without a result: "


@contextmanager
def local_ray(cluster: ClusterConfig, slots: int, stop: StopRequest, token_file: Path | None = None):
    """A private single-node Ray: its own temp dir, no dashboard, GPUs declared if none exist.

    ``stop`` starts listening once Ray's processes exist (they keep USR2 ignored).
    ``token_file``: token authentication as on Slurm, with a new random token in that 0600 file
    (``JobRayState.token``); set before ray is first imported, which reads RAY_AUTH_* then."""
    if token_file is not None:
        write_secret(token_file)
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)})
    import ray
    import torch

    real_gpus = torch.cuda.device_count()
    num_gpus = real_gpus or cluster.num_nodes * cluster.gpus_per_node
    if not real_gpus:
        # submitit's local executor sets CUDA_VISIBLE_DEVICES="" on a GPU-less machine, and Ray
        # then refuses declared GPUs; with no device to hide, the variable carries no meaning.
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    # Every slot is a {GPU:1, CPU:1} bundle; Ray's CPU count is a scheduling token, not a thread.
    num_cpus = max(os.cpu_count() or 1, slots + 2)
    temp_dir = tempfile.mkdtemp(prefix="rlhpc-ray-")
    try:
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _temp_dir=temp_dir,
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
            log_to_driver=True,
        )
        stop.install()
        log.info("local Ray up: %d CPUs, %d GPUs (%s)", num_cpus, num_gpus, "real" if real_gpus else "declared")
        yield "local"
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def granted_gpus() -> int:
    """GPUs Slurm gave this task (gres sets CUDA_VISIBLE_DEVICES), 0 when none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return len([d for d in visible.split(",") if d.strip()])


@contextmanager
def slurm_ray(cfg: Config, run: RunDir, env: submitit.JobEnvironment, stop: StopRequest):
    """Ray over the allocation. Task 0 yields once every node joined; the others serve Ray
    until the driver is done and yield ``None``.

    Ray reads its auth settings when it is first imported, so nothing in this process may
    import ray before the job's token exists and RAY_AUTH_* point at it.
    """
    from rlhpc.launch.ray_cluster import RayNode, wait_for_cluster

    c = cfg.cluster
    gpus = granted_gpus()
    if gpus != c.gpus_per_node:
        raise RlhpcError(
            f"task {env.global_rank} on {env.hostname}: Slurm granted {gpus} GPUs (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}) but cluster.gpus_per_node = {c.gpus_per_node}",
            "submit with --gpus-per-node equal to cluster.gpus_per_node (jobs/submit.py sets both)",
        )
    if env.num_nodes != c.num_nodes:
        raise RlhpcError(
            f"the job has {env.num_nodes} nodes but cluster.num_nodes = {c.num_nodes}",
            "submit with --nodes equal to cluster.num_nodes (jobs/submit.py sets both)",
        )
    job_id = os.environ.get("SLURM_JOB_ID", env.job_id)
    cpus = max(int(os.environ.get("SLURM_CPUS_ON_NODE", "0")), os.cpu_count() or 1, 2 * gpus + 2)
    state = run.ray_state(job_id, os.environ.get("SLURM_RESTART_COUNT", "0"))  # one per attempt
    node = RayNode(state.root, job_id, env.global_rank, gpus, cpus)
    try:
        if env.global_rank != 0:
            node.start_worker(c.ray_start_timeout_s)
            log.info("task %d: Ray worker on %s serving until the driver finishes", env.global_rank, node.ip)
            code = node.wait_until_stopped()
            if code:
                raise RlhpcError(
                    f"task {env.global_rank}: Ray on {node.ip} exited with {code}",
                    f"see {node.state.log(env.global_rank)}",
                )
            yield None
            return
        address = node.start_head()
        stop.install()  # from here a stop request is kept; Ray's processes inherited the ignored USR2
        os.environ.update(node.env())
        import ray  # only now: see the docstring

        log.info("Ray head at %s (job %s, ports %d-%d)", address, job_id, node.ports.gcs, node.ports.max_worker)
        started = time.monotonic()
        deadline = started + c.ray_start_timeout_s
        while True:  # the GCS needs a moment before it accepts a driver
            try:
                ray.init(address=address, _node_ip_address=node.ip, log_to_driver=True)
                break
            except (ConnectionError, RuntimeError) as e:
                if time.monotonic() > deadline:
                    raise RlhpcError(
                        f"could not connect to the Ray head at {address}: {e}", f"see {node.state.log(0)}"
                    ) from e
                time.sleep(0.5)
        wait_for_cluster(node.state, c.num_nodes, c.num_nodes * c.gpus_per_node, c.ray_start_timeout_s, started)
        yield address
    finally:
        if env.global_rank == 0:
            node.state.stop.parent.mkdir(parents=True, exist_ok=True)
            node.state.stop.write_text("done\n")  # tells the worker tasks to stop their Ray
            if "ray" in sys.modules:
                sys.modules["ray"].shutdown()
        node.stop()


class TrainJob:
    """The job: one call per task. Stops, requeues and restart loops are decided here."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.owner: Owner | None = None  # task 0, once it owns the run dir

    def __call__(self) -> dict:
        """The process boundary: the one place a ``JobExit`` (requeue, hold) becomes the exit code."""
        # First: submitit's USR2 handler must never act on this job, and Ray and the engines,
        # started from here, inherit an ignored USR2 and live on until the driver has saved.
        shield_from_user_signal()
        try:
            result = self.run()
        except JobExit as e:
            if e.final:
                self._release()
            # One unwrapped line (the log may wrap): jobs/submit.py --follow quotes it (ENDED_LINE).
            print(f"{ENDED_LINE}{e}", file=sys.stderr, flush=True)
            raise SystemExit(e.code) from None
        except BaseException:  # the job ends here for good; a requeue raises JobExit instead
            self._release()
            raise
        self._release()
        return result

    def _release(self) -> None:
        if self.owner is not None:
            run_owner.release(RunDir(self.run_dir), self.owner)

    def run(self) -> dict:
        """Train, or raise ``JobExit`` when this task must end without a result."""
        from rlhpc.cluster.layout import plan_layout

        run = RunDir(self.run_dir)
        cfg = run.load_config()
        console = setup_logging(cfg.logging.level)
        env = submitit.JobEnvironment()
        job_id = os.environ.get("SLURM_JOB_ID", str(env.job_id))
        if env.global_rank == 0:
            self.owner = self._own_run_dir(run, env.cluster, job_id)
        if run.is_finished():  # a requeue or resubmission of a finished run has nothing to do
            log.info("run %s is already finished", run)
            return {"already_finished": True}
        if env.global_rank == 0:
            self._check_restart_loop(cfg, run, env.cluster, job_id)
        stop = StopRequest()
        cluster = (
            slurm_ray(cfg, run, env, stop)
            if env.cluster == "slurm"
            else local_ray(cfg.cluster, plan_layout(cfg.cluster).num_slots, stop, run.ray_state(job_id, 0).token)
        )
        try:
            with cluster as head:
                if head is None and env.cluster == "slurm":  # a worker task: Ray served, driver done
                    return {"task": env.global_rank}
                from rlhpc.driver import make_progress, train  # imports ray: only once Ray's auth is set

                with make_progress(console) as progress:
                    summary = train(cfg, run, progress, stop)
        except Stopped as e:  # Ray is down by now, on every node
            log.warning("%s; requeueing", e)
            requeue(env.cluster, job_id)
        except Exception as e:
            if isinstance(e, RlhpcError) and not e.transient:  # a clear, named problem: a requeue would not fix it
                raise
            if not cfg.checkpoint.requeue_on_failure or env.global_rank != 0:
                raise
            log.exception("the job failed; requeueing (checkpoint.requeue_on_failure)")
            requeue(env.cluster, job_id)
        run.mark_finished(summary)
        log.info("run finished: %s", run)
        return summary

    @staticmethod
    def _own_run_dir(run: RunDir, cluster: str, job_id: str) -> Owner:
        """Become the run dir's owner, or refuse to run: two jobs of one run can be queued by hand."""
        # Locally the job id is the pid of submitit's controller, this task's parent.
        me = Owner.slurm_job(job_id) if cluster == "slurm" else Owner.local_job(int(job_id))
        run_owner.wait_for_submitter(run)  # a job can start before jobs/submit.py wrote its id
        run_owner.claim(run, me)
        return me

    @staticmethod
    def _check_restart_loop(cfg: Config, run: RunDir, cluster: str, job_id: str) -> None:
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
            hold(cluster, job_id, reason)
