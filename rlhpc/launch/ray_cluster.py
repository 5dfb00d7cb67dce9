"""Ray across a Slurm allocation: task 0 starts the head, every other task a worker.

Public recipes (see ../shared/anchors.md) sleep a fixed time, use port 6379, share /tmp/ray,
guess the head IP from the hostname and leave Ray open to anyone on the network. Here:

- the head's address goes through the job's own state dir (shared run dir), never guessed;
- every node passes ``--node-ip-address``: the address Slurm itself uses for the node;
- all ports come from a block of 100: the job's own block (derived from the whole job id, so
  array task ``77_3`` is not job ``773``), or, when any of its ports is taken on this node
  (another job's block, anything else listening), the next free one; the head publishes its
  block in head.json and the workers start from it (each node checks its own ports);
- every node has its own temp dir, named after job and task (never ``/tmp/ray``), removed
  when the task stops;
- token authentication with a random per-job token in a 0600 file;
- readiness is polled (all nodes and GPUs registered) against a deadline; nodes that never
  joined are named, with their log files;
- each task stops only its own Ray processes: the process group of its own ``ray start``;
- at scale (docs/guides/scale.md): every task raises its open-file limit to the hard limit (Slurm
  propagates the login shell's soft limit, often 1024), and jobs of ``LARGE_JOB_NODES`` nodes or
  more give the GCS and its clients longer timeouts (``scale_env``; a site's own RAY_* values win).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhpc.cluster.layout import GROUP_RESOURCES
from rlhpc.errors import RlhpcError
from rlhpc.launch import slurm
from rlhpc.run_dir import JobRayState
from rlhpc.util.files import NODE_TMP_ENV, private_dir, ray_temp_dir, write_atomic
from rlhpc.util.processes import python_command, stop_group

log = logging.getLogger(__name__)

PORT_BLOCK = 100  # ports reserved per job
# The GCS declares a node dead after this many missed health checks (Ray's defaults take ~50 s
# with a silent node): a lost engine node's requests move to the others within ~10-20 s. Set
# RAY_health_check_* in the job's environment to override.
HEALTH_CHECK_ENV = {
    "RAY_health_check_period_ms": "2000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}
FIRST_PORT = 10000  # blocks live in 10000..31999, below Linux's ephemeral range (32768+)
NUM_BLOCKS = 220
MAX_BLOCK_TRIES = 16  # blocks a node tries, from its first choice on, before giving up
REPLACEMENT_RANK = 1000  # replacement workers (NodeWatch) count from here: their own files


LARGE_JOB_NODES = 64  # from here on, scale_env relaxes Ray's timeouts
WANTED_OPEN_FILES = 65536  # the head holds a few connections per node and per worker process


def scale_env(num_nodes: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Ray settings a job of ``num_nodes`` nodes needs, less those already set in ``environ``.

    Small jobs keep Ray's defaults (a lost node is noticed in about 15 s). From
    ``LARGE_JOB_NODES`` on, hundreds of raylets start and report at once: the GCS answers
    slower, and a node that misses a few health checks while the head is busy is not lost.
    """
    if num_nodes < LARGE_JOB_NODES:
        return {}
    wanted = {
        "RAY_gcs_rpc_server_reconnect_timeout_s": "300",  # clients wait this long for a busy/restarting GCS
        "RAY_gcs_server_request_timeout_seconds": "120",
        "RAY_raylet_start_wait_time_s": "300",  # a raylet's registration with a busy GCS
        "RAY_health_check_timeout_ms": "30000",  # one health-check answer may take this long
        "RAY_health_check_failure_threshold": "10",  # missed checks before a node is declared dead
    }
    environ = os.environ if environ is None else environ
    return {k: v for k, v in wanted.items() if k not in environ}


def raise_open_file_limit(wanted: int = WANTED_OPEN_FILES) -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit (Ray's processes inherit it); (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < wanted:
        log.warning(
            "open-file limit %d (hard limit %d) is below %d: a large Ray cluster can run out of file "
            "descriptors on its head node; ask the site to raise the hard limit (slurmd's LimitNOFILE)",
            soft, hard, wanted,
        )  # fmt: skip
    return soft, hard


def block_index(job_id: str) -> int:
    """The job's first-choice block. Plain ids: consecutive jobs get consecutive blocks. Any
    other id (an array task ``77_3``) is hashed whole, so it never aliases a plain id's digits."""
    return int(job_id) % NUM_BLOCKS if job_id.isdigit() else zlib.crc32(job_id.encode()) % NUM_BLOCKS


@dataclass(frozen=True)
class RayPorts:
    gcs: int
    node_manager: int
    object_manager: int
    client_server: int
    dashboard_agent_grpc: int
    dashboard_agent_listen: int
    runtime_env_agent: int
    metrics_export: int
    dashboard_metrics: int
    autoscaler_metrics: int
    min_worker: int
    max_worker: int

    @classmethod
    def block(cls, index: int) -> RayPorts:
        base = FIRST_PORT + (index % NUM_BLOCKS) * PORT_BLOCK
        # The GCS port must lie outside the worker port range, or ray start refuses it.
        return cls(*range(base, base + 10), base + 10, base + PORT_BLOCK - 1)

    @classmethod
    def candidates(cls, first_index: int) -> list[RayPorts]:
        """The blocks a node tries, in order."""
        return [cls.block(first_index + i) for i in range(MAX_BLOCK_TRIES)]

    @property
    def index(self) -> int:
        return (self.gcs - FIRST_PORT) // PORT_BLOCK

    def all(self) -> range:
        return range(self.gcs, self.gcs + PORT_BLOCK)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def env(self) -> dict[str, str]:
        """Ray's Prometheus endpoints, which answer whoever reaches them without the token (issue 43,
        item 12): the agent's per-node exporter off (Ray's switch), the dashboard's and the
        autoscaler's (on the head; Ray has no switch for them) on the job's ports, not on their
        fixed defaults (44227, 44217), which every job on a node would share."""
        return {
            "RAY_enable_metrics_collection": "0",
            "DASHBOARD_METRIC_PORT": str(self.dashboard_metrics),
            "AUTOSCALER_METRIC_PORT": str(self.autoscaler_metrics),
        }

    def args(self) -> list[str]:
        return [
            f"--node-manager-port={self.node_manager}",
            f"--object-manager-port={self.object_manager}",
            f"--dashboard-agent-grpc-port={self.dashboard_agent_grpc}",
            f"--dashboard-agent-listen-port={self.dashboard_agent_listen}",
            f"--runtime-env-agent-port={self.runtime_env_agent}",
            f"--metrics-export-port={self.metrics_export}",
            f"--min-worker-port={self.min_worker}",
            f"--max-worker-port={self.max_worker}",
        ]


def port_free(port: int) -> bool:
    """Nothing on this node listens on ``port`` (any address): a bind test.

    SO_REUSEADDR so that connections of a finished job in TIME_WAIT do not count as taken; a
    listener (with or without SO_REUSEPORT, as gRPC sets it) still refuses the bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def choose_ports(first_index: int, is_free: Callable[[int], bool] = port_free) -> RayPorts:
    """The first block, from ``first_index`` on, whose ports are all free on this node."""
    tried = []
    for ports in RayPorts.candidates(first_index):
        taken = next((p for p in ports.all() if not is_free(p)), None)
        if taken is None:
            if tried:
                log.info("Ray ports %s taken on this node: using %d-%d", ", ".join(tried), ports.gcs, ports.max_worker)
            return ports
        tried.append(f"{ports.gcs}-{ports.max_worker} (port {taken} in use)")
    raise RlhpcError(
        f"no free block of Ray ports on {socket.gethostname()}: tried {', '.join(tried)}",
        "see what listens there (ss -ltnp); other jobs on this node may hold them: resubmit, or exclude the node "
        "(--sbatch exclude=NODE)",
    )


def node_ip_address() -> str:
    """The address Slurm uses for this node (its NodeAddr), resolved to an IP.

    Hostnames mislead on multi-NIC nodes and in containers; NodeAddr is what the site
    configured for reaching the node.
    """
    name = os.environ.get("SLURMD_NODENAME")
    if name:
        return socket.gethostbyname(slurm.node_addr(name) or name)
    return socket.gethostbyname(socket.gethostname())


class RayNode:
    """This task's Ray: ``start_head`` on task 0 or ``start_worker`` elsewhere, then ``stop``.
    ``group``: its component in a heterogeneous job (the node offers that group's resource), else None."""

    def __init__(self, state_dir: Path, job_id: str, rank: int, num_gpus: int, num_cpus: int, group: int | None = None):
        self.state = JobRayState(state_dir)
        self.job_id = job_id
        self.rank = rank
        self.num_gpus = num_gpus
        self.num_cpus = num_cpus
        self.group = group
        self.ports: RayPorts | None = None  # chosen when Ray starts (choose_ports)
        self.ip = node_ip_address()
        # Node-local and per job and task: unix socket paths must stay short (< 108 bytes).
        self.temp_dir = Path("/tmp") / f"rlhpc-{job_id}-{rank}"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """Environment for anything that talks to this job's Ray (ray start, the driver)."""
        num_nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.state.token), **scale_env(num_nodes)}

    def _publish(self) -> None:
        """This node's file: who it is, where its log is, and (once chosen) its ports."""
        info = {
            "rank": self.rank,
            "ip": self.ip,
            "host": socket.gethostname(),
            "node": os.environ.get("SLURMD_NODENAME", socket.gethostname()),
            "log": str(self.state.log(self.rank)),
            "group": self.group,
            "temp_dir": str(self.temp_dir),  # node-local, removed at the end (what a check looks for)
        }
        if self.ports is not None:
            info["ports"] = self.ports.to_dict()
        write_atomic(self.state.node(self.rank), json.dumps(info))

    def _start(
        self, first_block: int, extra: Callable[[RayPorts], list[str]], env: dict[str, str] | None = None
    ) -> None:
        self._publish()  # first: a node that cannot start is still named, with its log
        self.ports = choose_ports(first_block)
        self._publish()
        # Private, and fresh: another user may have made this predictable path first (refused), or
        # an earlier start of this job on this node left it (ours: emptied).
        private_dir(self.temp_dir, fresh=True)
        raise_open_file_limit()
        cmd = [
            *python_command("-m", "ray.scripts.scripts"), "start", "--block",
            f"--node-ip-address={self.ip}",
            f"--num-gpus={self.num_gpus}",
            f"--num-cpus={self.num_cpus}",
            f"--temp-dir={ray_temp_dir(self.temp_dir)}",
            "--disable-usage-stats",
            *([f"--resources={json.dumps({GROUP_RESOURCES[self.group]: self.num_gpus})}"] if self.group is not None else []),
            *self.ports.args(),
            *extra(self.ports),
        ]  # fmt: skip
        logf = open(self.state.log(self.rank), "ab")
        # Own session: the whole Ray tree of this task is one process group we can stop.
        self.proc = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            env={**(env or {}), **os.environ, **self.env(), **self.ports.env(), NODE_TMP_ENV: str(self.temp_dir)},
            start_new_session=True,
        )
        logf.close()

    def start_head(self) -> str:
        self.state.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state.token, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        for stale in (self.state.head, self.state.stop):
            stale.unlink(missing_ok=True)
        self._start(
            block_index(self.job_id),
            lambda ports: [
                "--head",
                f"--port={ports.gcs}",
                "--include-dashboard=false",
                f"--ray-client-server-port={ports.client_server}",
            ],
            HEALTH_CHECK_ENV,  # what the environment sets wins
        )
        address = f"{self.ip}:{self.ports.gcs}"
        # The workers read the head's choice from here, never from the job id.
        write_atomic(
            self.state.head, json.dumps({"address": address, "job_id": self.job_id, "ports": self.ports.to_dict()})
        )
        return address

    def start_worker(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:  # the head writes its address only after its ray start was launched
            if self.state.head.is_file():
                head = json.loads(self.state.head.read_text())
                if head.get("job_id") == self.job_id:
                    break
            if time.monotonic() > deadline:
                raise RlhpcError(
                    f"task {self.rank}: the Ray head of job {self.job_id} did not publish its address within {timeout_s:.0f}s",
                    f"see task 0's log and {self.state.log(0)}",
                )
            time.sleep(0.2)
        # Start from the head's block; each node moves on if a port is taken on it.
        first = RayPorts(**head["ports"]).index if "ports" in head else block_index(self.job_id)
        if self.rank >= REPLACEMENT_RANK:
            # Not the lost node's ports: the GCS still holds a channel to that address, in gRPC's
            # reconnect backoff after the silent loss, and a raylet there again fails its health
            # checks until it ends (measured: marked dead ~20 s after it started).
            first += 1 + self.rank - REPLACEMENT_RANK
        self._start(first, lambda ports: [f"--address={head['address']}"])

    def wait_until_stopped(
        self, give_up: Callable[[], bool] | None = None, poll_s: float = 0.5, give_up_every_s: float = 15.0
    ) -> int:
        """Worker tasks: block until the driver says stop (or our Ray dies, or ``give_up``, asked
        every ``give_up_every_s``, says the head is gone: a raylet may wait on a silent head for
        good), then stop."""
        asked = time.monotonic()
        while not self.state.stop.exists() and self.proc.poll() is None:
            if give_up is not None and time.monotonic() - asked >= give_up_every_s:
                asked = time.monotonic()
                if give_up():
                    break
            time.sleep(poll_s)
        code = self.proc.poll()
        self.stop()
        return 0 if code is None or self.state.stop.exists() else code

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop this task's Ray only: TERM to our process group, a short wait, then KILL; then
        remove its node-local temp dir.

        KILL always follows: ``ray start --block`` may exit on TERM while raylet & co. linger.
        The wait is short: ``ray start --block`` was seen to outlast 5 s of TERM at every stop,
        and nothing of this job's Ray is kept after it (each start brings up a fresh one).
        """
        if self.proc is not None:
            stop_group(self.proc, grace_s, name=f"task {self.rank}'s ray start")
            self.proc = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # node-local: nobody else cleans it up


def wait_for_cluster(
    state: JobRayState, num_nodes: int, num_gpus: int, timeout_s: float, started: float | None = None
) -> None:
    """Poll until every node and all GPUs registered; past the deadline name who is missing.

    ``started`` (``time.monotonic()``) is when the clock began, e.g. the head's start.
    """
    import ray

    deadline = (started if started is not None else time.monotonic()) + timeout_s
    while True:
        alive = [n for n in ray.nodes() if n.get("Alive")]
        gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in alive)
        if len(alive) >= num_nodes and gpus >= num_gpus:
            log.info("Ray cluster ready: %d nodes, %d GPUs", len(alive), int(gpus))
            return
        if time.monotonic() > deadline:
            joined = {n["NodeManagerAddress"] for n in alive}
            missing = []
            for rank in range(num_nodes):
                f = state.node(rank)
                info = (
                    json.loads(f.read_text()) if f.is_file() else {"rank": rank, "ip": "?", "log": str(state.log(rank))}
                )
                if info["ip"] not in joined:
                    missing.append(f"task {rank} ({info['ip']}; log {info['log']})")
            raise RlhpcError(
                f"Ray cluster not ready after {timeout_s:.0f}s: {len(alive)}/{num_nodes} nodes, {int(gpus)}/{num_gpus} GPUs; "
                f"never joined: {', '.join(missing) or 'none (GPUs missing)'}",
                "read those nodes' Ray logs; raise cluster.ray_start_timeout_s if the nodes are just slow",
            )
        time.sleep(0.25)


def dead_nodes(state: JobRayState) -> dict[str, str]:
    """IP -> Slurm node name of every node of this job's Ray that died (no live Ray node on
    that IP): the node files name them (``node_<rank>.json``)."""
    import ray

    nodes = ray.nodes()
    alive = {n["NodeManagerAddress"] for n in nodes if n.get("Alive")}
    dead = {n["NodeManagerAddress"] for n in nodes if not n.get("Alive")} - alive
    names = {}
    for f in state.nodes():
        with contextlib.suppress(OSError, ValueError):
            info = json.loads(f.read_text())
            names[info["ip"]] = info.get("node", info.get("host", "?"))
    return {ip: names.get(ip, ip) for ip in sorted(dead)}


class NodeWatch:
    """Task 0: watches the job's Ray nodes; for every node that dies, warns naming it and (with
    ``replace``) submits a one-node Slurm job whose Ray worker joins this cluster in its place,
    once Slurm has a node for it (the same one back, or another). The engine pool starts engines
    there again; ``close`` cancels the replacement jobs (a pending one, or one that is running)."""

    def __init__(
        self, state: JobRayState, job_id: str, node_gpus: dict[int | None, int], replace: bool, poll_s: float = 2.0
    ):
        """``node_gpus``: GPUs per node of each group (None: a homogeneous job's one group)."""
        self.state, self.job_id, self.node_gpus, self.replace = state, job_id, node_gpus, replace
        self.lost: dict[str, str] = {}  # IP -> node name, every node lost so far
        self.replacements: list[str] = []  # their job ids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(poll_s,), name="node-watch", daemon=True)
        self._thread.start()

    def _run(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            try:
                self.check()
            except Exception as e:  # never let the watch take the driver down
                log.warning("node watch: %s", e)

    def check(self) -> None:
        for ip, node in dead_nodes(self.state).items():
            if ip in self.lost:
                continue
            self.lost[ip] = node
            log.warning("node %s (%s) of job %s is lost: Ray declared it dead", node, ip, self.job_id)
            if self.replace:
                self._submit_replacement(node)

    def _group_of(self, node: str) -> int | None:
        """The component the lost node belonged to (its node file says), None in a homogeneous job."""
        for f in self.state.nodes():
            with contextlib.suppress(OSError, ValueError):
                info = json.loads(f.read_text())
                if info.get("node") == node:
                    return info.get("group")
        return None

    def _submit_replacement(self, node: str) -> None:
        rank = REPLACEMENT_RANK + len(self.replacements)  # its own node file, log, temp dir and ports
        group = self._group_of(node)
        gpus = self.node_gpus.get(group, next(iter(self.node_gpus.values())))
        command = [
            *python_command("-m", "rlhpc.launch.ray_cluster"), "worker",
            str(self.state.root), self.job_id, str(rank), str(gpus), *([str(group)] if group is not None else []),
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env.update({k: v for k, v in os.environ.items() if k == "SLURM_CONF"})
        try:
            job = slurm.submit_worker(
                self.job_id, node, f"rlhpc-{self.job_id}-replace", gpus, command, str(self.state.log(rank)), env, group
            )
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            log.warning("no replacement for node %s: %s; the run goes on without it", node, e)
            return
        self.replacements.append(job)
        log.warning("replacement for node %s: Slurm job %s (its Ray worker joins this run once it starts)", node, job)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for job in self.replacements:
            with contextlib.suppress(Exception):
                slurm.cancel(job)


def _worker_main(argv: list[str]) -> int:
    """``python -m rlhpc.launch.ray_cluster worker STATE_DIR JOB_ID RANK GPUS [GROUP]``: a replacement
    node's Ray worker (see ``NodeWatch``), serving until the job's driver stops or its Ray ends."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state_dir, job_id, rank, gpus = argv[0], argv[1], int(argv[2]), int(argv[3])
    group = int(argv[4]) if len(argv) > 4 else None
    cpus = max(int(os.environ.get("SLURM_CPUS_ON_NODE", "0")), os.cpu_count() or 1, 2 * gpus + 2)
    from rlhpc.runtime import staging

    staged = staging.stage_replacement(Path(state_dir))  # the model, where the job stages it (cluster.stage_dir)
    node = RayNode(Path(state_dir), job_id, rank, gpus, cpus, group)
    try:
        node.start_worker(timeout_s=60)
        log.info("replacement Ray worker starting on %s: it joins job %s once its raylet registers", node.ip, job_id)
        return node.wait_until_stopped()
    finally:
        node.stop()
        staged.remove()


if __name__ == "__main__":
    if sys.argv[1:2] != ["worker"]:
        sys.exit("usage: python -m rlhpc.launch.ray_cluster worker STATE_DIR JOB_ID RANK GPUS [GROUP]")
    sys.exit(_worker_main(sys.argv[2:]))
