"""A Slurm job's Ray over its allocation (head on task 0, workers on the others), and what a
task does when the head's node is lost."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from contextlib import contextmanager

import submitit

from rlhpc.config import ClusterConfig, Config
from rlhpc.errors import RlhpcError
from rlhpc.launch import slurm
from rlhpc.launch.ray_cluster import RayNode, wait_for_cluster
from rlhpc.launch.requeue import requeue_slurm
from rlhpc.run_dir import JobRayState, RunDir
from rlhpc.runtime.signals import StopRequest
from rlhpc.util.processes import ray_job_config

log = logging.getLogger(__name__)


def attempt() -> str:
    """This start's attempt of the job: Slurm keeps the job id across requeues and counts them."""
    return os.environ.get("SLURM_RESTART_COUNT", "0")


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
    state = run.ray_state(job_id, attempt())
    node = RayNode(state.root, job_id, env.global_rank, gpus, cpus, group)
    try:
        if env.global_rank != 0:
            node.start_worker(c.ray_start_timeout_s)
            log.info("task %d: Ray worker on %s serving until the driver finishes", env.global_rank, node.ip)
            code = node.wait_until_stopped(lambda: head_lost(node.state, job_id))
            if not node.state.stop.exists():  # Ray ended without the driver's word: the head may be lost
                _requeue_if_head_lost(node.state, job_id, node_counts(c))
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
                ray.init(address=address, _node_ip_address=node.ip, log_to_driver=True, job_config=ray_job_config())
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


def _requeue_if_head_lost(state: JobRayState, job_id: str, num_nodes: tuple[int, ...], timeout_s: float = 60.0) -> None:
    """A worker task whose Ray ended without the driver's stop: if the head's node is lost, the
    driver went with it, and nobody else will requeue the job (Slurm keeps a --no-kill job
    running without its batch host): requeue it from here (raises ``JobExit``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not state.stop.exists():
        if head_lost(state, job_id):
            log.error("the head node %s is lost (the driver ran there); requeueing job %s", _head_name(state), job_id)
            requeue_slurm(job_id, num_nodes)
        time.sleep(2)
