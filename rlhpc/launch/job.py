"""What runs inside the allocation: bring up Ray, run the driver, mark the run finished.

``TrainJob`` is the callable submitit pickles. It carries only the run directory: all resume
state is read from disk, so a requeue (or a node-failure rerun of the original pickle)
continues from the newest checkpoint. It is a plain callable, not submitit's
``Checkpointable``: rlhpc requeues itself (rlhpc/launch/restarts.py says why and how).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import psutil
import submitit
from rich.console import Console

from rlhpc.checkpoint import CheckpointManager
from rlhpc.config import ClusterConfig, Config
from rlhpc.errors import RlhpcError
from rlhpc.launch import run_owner, slurm, staging
from rlhpc.launch.ray_cluster import NodeWatch
from rlhpc.launch.restarts import JobExit, RestartPolicy, hold, read_history, record_start, refuse_reason, requeue
from rlhpc.launch.run_owner import Owner
from rlhpc.launch.signals import Stopped, StopRequest, shield_from_user_signal
from rlhpc.launch.staging import NOT_STAGED, Staged
from rlhpc.launch.startup import StartupClock
from rlhpc.logs import setup_logging
from rlhpc.preflight import check as preflight_check
from rlhpc.run_dir import JobRayState, RunDir
from rlhpc.util.files import NODE_TMP_ENV, apply_access, private_dir, ray_temp_dir
from rlhpc.util.processes import die_with_parent
from rlhpc.util.secrets import write_secret

log = logging.getLogger(__name__)

ENDED_LINE = "rlhpc: task ended without a result: "


# Ray's switch between a cluster-wide node address and loopback (its default off on macOS/Windows).
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def local_ray_temp_dir(run: RunDir) -> Path:
    """Where a local job's Ray keeps its sockets and logs: outside the run dir (Unix socket paths
    must stay short), named after it, so what a killed job left there goes at the next start."""
    digest = hashlib.sha256(str(run.path).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"rlhpc-ray-{digest}"


@contextmanager
def local_ray(
    cluster: ClusterConfig,
    slots: int,
    stop: StopRequest,
    token_file: Path | None = None,
    temp_dir: Path | None = None,
):
    """A private single-node Ray: its own temp dir, no dashboard, GPUs declared if none exist.

    ``stop`` starts listening once Ray's processes exist (they keep USR2 ignored).
    ``token_file``: token authentication as on Slurm, with a new random token in that 0600 file
    (``JobRayState.token``); set before ray is first imported, which reads RAY_AUTH_* then.
    ``temp_dir``: Ray's temp dir (``local_ray_temp_dir``), emptied first: only the run dir's
    owner gets here, so whatever is in it was left by a job of this run that was killed."""
    if token_file is not None:
        write_secret(token_file)
        os.environ.update({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)})
    # Every listener of a one-node Ray on loopback (issue 32, item 12): its node address is then
    # 127.0.0.1 (what Ray does on macOS), and its gRPC servers (GCS, raylet, workers, the
    # dashboard's and its agents) bind there, not on all addresses; ray.init(_node_ip_address=
    # "127.0.0.1") is turned back into the node's IP. Read when ray is first imported.
    os.environ[LOOPBACK_ONLY_ENV] = "0"
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
    if temp_dir is None:
        temp_dir = Path(tempfile.mkdtemp(prefix="rlhpc-ray-"))
    else:
        if temp_dir.exists():
            log.info("removing %s, left by a killed job of this run", temp_dir)
        private_dir(temp_dir, fresh=True)
    os.environ[NODE_TMP_ENV] = str(temp_dir)  # Ray's workers inherit it: engines' files go with the dir
    try:
        ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            _temp_dir=str(ray_temp_dir(temp_dir)),
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
            log_to_driver=True,
        )
        stop.install()
        log.info("local Ray up: %d CPUs, %d GPUs (%s)", num_cpus, num_gpus, "real" if real_gpus else "declared")
        yield "local"
    finally:
        ray.shutdown()
        os.environ.pop(NODE_TMP_ENV, None)
        os.environ.pop(LOOPBACK_ONLY_ENV, None)
        shutil.rmtree(temp_dir, ignore_errors=True)


def node_gpus(c: ClusterConfig) -> dict[int | None, int]:
    """GPUs per node of each group: the component of a heterogeneous job (0, 1[, 2]), or None."""
    return dict(enumerate(c.component_gpus)) if c.heterogeneous else {None: c.gpus_per_node}


def node_counts(c: ClusterConfig) -> tuple[int, ...]:
    """Nodes of each component (one for a homogeneous job): what a requeue after a node loss asks for again."""
    return c.component_nodes


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
    group = slurm.het_group(env.global_rank)
    if c.heterogeneous != (group is not None):
        raise RlhpcError(
            "cluster.rollout_nodes is set but this task is not in a heterogeneous job step"
            if c.heterogeneous
            else "this task runs in a heterogeneous job step but cluster.rollout_nodes is not set",
            "submit with jobs/submit.py (--rollout-nodes makes the het job); in a template, start the tasks "
            "with srun --het-group=0,1 (slurm_templates/hetjob.sbatch)",
        )
    key = ("gpus_per_node", "rollout_gpus_per_node", "reward_gpus_per_node")[group or 0]
    gpus = c.component_gpus[group or 0]
    if granted_gpus() != gpus:
        option = "--" + key.replace("_", "-")
        raise RlhpcError(
            f"task {env.global_rank} on {env.hostname}: Slurm granted {granted_gpus()} GPUs (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '')!r}) but cluster.{key} = {gpus}",
            f"submit with {option} equal to cluster.{key} (jobs/submit.py sets both)",
        )
    if env.num_nodes != c.total_nodes:
        raise RlhpcError(
            f"the job has {env.num_nodes} nodes but the config {c.total_nodes} (cluster.num_nodes"
            + (" + cluster.rollout_nodes" if c.heterogeneous else "")
            + (" + cluster.reward_nodes)" if c.reward_nodes else ")"),
            "submit with --nodes (and --rollout-nodes, --reward-nodes) equal to the config's (jobs/submit.py sets both)",
        )
    job_id = slurm.own_job_id(env.job_id)  # an array task: 77_3
    cpus = max(int(os.environ.get("SLURM_CPUS_ON_NODE", "0")), os.cpu_count() or 1, 2 * gpus + 2)
    state = run.ray_state(job_id, os.environ.get("SLURM_RESTART_COUNT", "0"))  # one per attempt
    node = RayNode(state.root, job_id, env.global_rank, gpus, cpus, group)
    try:
        if env.global_rank != 0:
            node.start_worker(c.ray_start_timeout_s)
            log.info("task %d: Ray worker on %s serving until the driver finishes", env.global_rank, node.ip)
            code = node.wait_until_stopped(lambda: head_lost(node.state, job_id))
            if not node.state.stop.exists():  # Ray ended without the driver's word: the head may be lost
                _requeue_if_head_lost(node.state, env.cluster, job_id, node_counts(c))
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
        wait_for_cluster(node.state, c.total_nodes, c.total_gpus, c.ray_start_timeout_s, started)
        yield address
    finally:
        if env.global_rank == 0:
            node.state.stop.parent.mkdir(parents=True, exist_ok=True)
            node.state.stop.write_text("done\n")  # tells the worker tasks to stop their Ray
            if "ray" in sys.modules:
                sys.modules["ray"].shutdown()
        node.stop()


def job_alive(cluster: str, job_id: str) -> bool | None:
    """Whether job ``job_id`` still runs; None when that cannot be told (Slurm does not answer)."""
    if cluster == "slurm":
        return run_owner.liveness(Owner.slurm_job(job_id)).alive
    # A local job's id is its controller's pid (its start time, which liveness compares, is not kept here).
    return psutil.pid_exists(int(job_id)) if job_id.isdigit() else None


def wait_until_unusable(nodes: list[str], timeout_s: float = 180.0) -> None:
    """Before a requeue after a node loss: wait until Slurm itself no longer gives the lost nodes
    out (DOWN, or not responding), so the requeued job is placed elsewhere (or on them once they
    are back). No exclusion is added: it would outlive the failure and could starve the job."""
    deadline = time.monotonic() + timeout_s
    waiting = list(nodes)
    while waiting and time.monotonic() < deadline:
        waiting = [n for n in waiting if not slurm.node_unusable(slurm.node_state(n))]
        if waiting:
            time.sleep(2)
    if waiting:
        log.warning("Slurm still lists node(s) %s as usable after %.0fs; requeueing anyway", waiting, timeout_s)


def head_lost(state: JobRayState, job_id: str) -> bool:
    """The head's node is gone: its Ray GCS port takes no connection (a node merely slow to answer
    slurmctld still does), and Slurm lists the node as DOWN or not responding, or no longer counts
    it among the job's nodes (a node that was DOWN and is back, e.g. after a quick reboot, stays
    out of the job). The port is asked first: a live head costs Slurm nothing."""
    try:
        head = json.loads(state.node(0).read_text())
        address = json.loads(state.head.read_text())["address"]
    except (OSError, ValueError, KeyError):
        return False
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return False
    except OSError:
        pass
    name = head.get("node") or head.get("host")
    if slurm.node_unusable(slurm.node_state(name)):
        return True
    nodes = slurm.job_nodes(job_id)
    return nodes is not None and name not in nodes


def _head_name(state: JobRayState) -> str:
    try:
        head = json.loads(state.node(0).read_text())
        return f"{head.get('node') or head.get('host')} ({head['ip']})"
    except (OSError, ValueError, KeyError):
        return "of this job"


def _requeue_if_head_lost(
    state: JobRayState, cluster: str, job_id: str, num_nodes: tuple[int, ...], timeout_s: float = 60.0
) -> None:
    """A worker task whose Ray ended without the driver's stop: if the head's node is lost, the
    driver went with it, and nobody else will requeue the job (Slurm keeps a --no-kill job
    running without its batch host): requeue it from here (raises ``JobExit``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not state.stop.exists():
        if head_lost(state, job_id):
            log.error("the head node %s is lost (the driver ran there); requeueing job %s", _head_name(state), job_id)
            requeue(cluster, job_id, num_nodes)
        time.sleep(2)


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
        cfg = run.load_config()
        preflight_check(cfg)  # every check again on the job's own node: its reward, data and environment
        apply_access(run.path, cfg.run_dir_access)  # on every node: Slurm's umask is the submitter's shell's
        console = setup_logging(cfg.logging.level)
        env = submitit.JobEnvironment()
        # From here a SIGTERM (`kill PID`, a preemption without USR2) stops the job at its first
        # safe point; submitit's own handler would drop one that comes before Ray is up.
        stop = StopRequest().install((signal.SIGTERM,))
        if env.cluster == "local":
            # The run dir's owner record names the controller, our parent: if it dies (kill -9),
            # so do we, at once, rather than train on as an orphan in a run dir that looks free
            # (a SIGKILL loses nothing: checkpoints are renamed into place whole).
            die_with_parent(signal.SIGKILL)
            if str(os.getppid()) != str(env.job_id):
                raise RlhpcError(f"the local job's controller (pid {env.job_id}) is gone", "submit the run again")
        job_id = slurm.own_job_id(str(env.job_id))  # an array task: 77_3, as the run dir's owner names it
        self.job_id = job_id
        if env.global_rank == 0:
            self.owner = self._own_run_dir(run, env.cluster, job_id)
            run.ended_file.unlink(missing_ok=True)  # this start is the run's state now
        if run.is_finished():  # a requeue or resubmission of a finished run has nothing to do
            log.info("run %s is already finished", run)
            return {"already_finished": True}
        if env.global_rank == 0:
            self._check_restart_loop(cfg, run, env.cluster, job_id)
        startup = StartupClock(run, job_id, origin=began)
        if env.global_rank == 0:
            startup.record("prepare", began)
        staged = self._stage(cfg, run, env, job_id, startup) if cfg.cluster.stage_dir else NOT_STAGED
        try:
            return self._run_staged(cfg, run, env, job_id, startup, staged, console, stop)
        finally:
            staged.remove()

    def _run_staged(
        self,
        cfg: Config,
        run: RunDir,
        env: submitit.JobEnvironment,
        job_id: str,
        startup: StartupClock,
        staged: Staged,
        console: Console,
        stop: StopRequest,
    ) -> dict:
        from rlhpc.cluster.layout import plan_layout

        ray_began = time.monotonic()
        cluster = (
            slurm_ray(cfg, run, env, stop)
            if env.cluster == "slurm"
            else local_ray(
                cfg.cluster,
                plan_layout(cfg.cluster, cfg.reward_model, cfg.teacher).num_slots,
                stop,
                run.ray_state(job_id, 0).token,
                local_ray_temp_dir(run),
            )
        )
        watch: NodeWatch | None = None
        try:
            with cluster as head:
                if head is None and env.cluster == "slurm":  # a worker task: Ray served, driver done
                    return {"task": env.global_rank}
                startup.record("ray_up", ray_began)
                from rlhpc.driver import make_progress, train  # imports ray: only once Ray's auth is set

                if env.cluster == "slurm":
                    ray_state = run.ray_state(job_id, os.environ.get("SLURM_RESTART_COUNT", "0"))
                    watch = NodeWatch(ray_state, job_id, node_gpus(cfg.cluster), cfg.cluster.replace_lost_nodes)
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
            requeue(env.cluster, job_id)
        except Exception as e:
            if watch is not None and watch.lost:  # the ranks' state went with a node: resume elsewhere
                nodes = sorted(set(watch.lost.values()))
                log.error("the run stopped after losing node(s) %s (%s); requeueing", ", ".join(nodes), e)
                wait_until_unusable(nodes)
                requeue(env.cluster, job_id, node_counts(cfg.cluster))
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
    def _stage(cfg: Config, run: RunDir, env: submitit.JobEnvironment, job_id: str, startup: StartupClock) -> Staged:
        """Copy the model and the checkpoint to be resumed from to this node (``rlhpc.launch.staging``)."""
        began = time.monotonic()
        latest = None
        if cfg.checkpoint.resume == "auto":  # the driver resumes from it unless its content is damaged
            latest = CheckpointManager(run.checkpoints, cfg.checkpoint.keep_last).latest(content=False)
        root = staging.stage_root(cfg.cluster.stage_dir, job_id)
        if root.parent.is_dir():
            staging.remove_stale(root, lambda other: job_alive(env.cluster, other))
        engines_only = env.cluster == "slurm" and (slurm.het_group(env.global_rank) or 0) > 0
        paths = staging.plan(root, run.model_path(cfg), None if engines_only or latest is None else str(latest.path))
        state = run.ray_state(job_id, os.environ.get("SLURM_RESTART_COUNT", "0"))  # this attempt's
        broadcast = None
        if staging.use_sbcast(cfg.cluster, env.cluster, env.num_nodes):
            broadcast = staging.Broadcast(job_id, state.root / "staged")
        if broadcast is not None and env.global_rank != 0:
            staged = staging.receive(paths, root, broadcast)
        else:
            staged = staging.stage(paths, root, broadcast if env.global_rank == 0 else None)
        if env.global_rank == 0:
            if env.cluster == "slurm":
                staging.write_plan(state.root, root, paths)
            startup.record("stage", began)
        return staged

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
            run.mark_ended("held", job_id, reason)
            hold(cluster, job_id, reason)
