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
- each task stops only its own Ray processes: the process group of its own ``ray start``.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from rlhpc.errors import RlhpcError
from rlhpc.launch import slurm
from rlhpc.run_dir import JobRayState
from rlhpc.util.files import write_atomic
from rlhpc.util.processes import stop_group

log = logging.getLogger(__name__)

PORT_BLOCK = 100  # ports reserved per job
FIRST_PORT = 10000  # blocks live in 10000..31999, below Linux's ephemeral range (32768+)
NUM_BLOCKS = 220
MAX_BLOCK_TRIES = 16  # blocks a node tries, from its first choice on, before giving up


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
    min_worker: int
    max_worker: int

    @classmethod
    def block(cls, index: int) -> RayPorts:
        base = FIRST_PORT + (index % NUM_BLOCKS) * PORT_BLOCK
        # The GCS port must lie outside the worker port range, or ray start refuses it.
        return cls(
            base, base + 1, base + 2, base + 3, base + 4, base + 5, base + 6, base + 7, base + 10, base + PORT_BLOCK - 1
        )

    @classmethod
    def for_job(cls, job_id: str) -> RayPorts:
        """The job's first-choice block (``choose_ports`` moves on when it is taken)."""
        return cls.block(block_index(job_id))

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
    """This task's Ray: ``start_head`` on task 0 or ``start_worker`` elsewhere, then ``stop``."""

    def __init__(self, state_dir: Path, job_id: str, rank: int, num_gpus: int, num_cpus: int):
        self.state = JobRayState(state_dir)
        self.job_id = job_id
        self.rank = rank
        self.num_gpus = num_gpus
        self.num_cpus = num_cpus
        self.ports: RayPorts | None = None  # chosen when Ray starts (choose_ports)
        self.ip = node_ip_address()
        # Node-local and per job and task: unix socket paths must stay short (< 108 bytes).
        self.temp_dir = Path("/tmp") / f"rlhpc-{job_id}-{rank}"
        self.proc: subprocess.Popen | None = None

    def env(self) -> dict[str, str]:
        """Environment for anything that talks to this job's Ray (ray start, the driver)."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.state.token)}

    def _publish(self) -> None:
        """This node's file: who it is, where its log is, and (once chosen) its ports."""
        info = {"rank": self.rank, "ip": self.ip, "host": socket.gethostname(), "log": str(self.state.log(self.rank))}
        if self.ports is not None:
            info["ports"] = self.ports.to_dict()
        write_atomic(self.state.node(self.rank), json.dumps(info))

    def _start(self, first_block: int, extra: Callable[[RayPorts], list[str]]) -> None:
        self._publish()  # first: a node that cannot start is still named, with its log
        self.ports = choose_ports(first_block)
        self._publish()
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--block",
            f"--node-ip-address={self.ip}",
            f"--num-gpus={self.num_gpus}",
            f"--num-cpus={self.num_cpus}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            *self.ports.args(),
            *extra(self.ports),
        ]  # fmt: skip
        logf = open(self.state.log(self.rank), "ab")
        # Own session: the whole Ray tree of this task is one process group we can stop.
        self.proc = subprocess.Popen(
            cmd, stdout=logf, stderr=subprocess.STDOUT, env={**os.environ, **self.env()}, start_new_session=True
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
        self._start(first, lambda ports: [f"--address={head['address']}"])

    def wait_until_stopped(self, poll_s: float = 0.5) -> int:
        """Worker tasks: block until the driver says stop (or our Ray dies), then stop."""
        while not self.state.stop.exists() and self.proc.poll() is None:
            time.sleep(poll_s)
        code = self.proc.poll()
        self.stop()
        return 0 if code is None or self.state.stop.exists() else code

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop this task's Ray only: TERM to our process group, a short wait, then KILL; then
        remove its node-local temp dir.

        KILL always follows: ``ray start --block`` may exit on TERM while raylet & co. linger.
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
