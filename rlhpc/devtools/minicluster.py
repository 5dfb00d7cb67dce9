#!/usr/bin/env python3
"""A real Slurm cluster on one machine, for tests and demos.

One slurmctld in the root network namespace (on a bridge), N slurmd daemons, each in
its own network namespace with its own IP (`eth0` in the namespace), its own hostname
(`nodeK`, a private UTS namespace) and its own /etc/hosts naming every node (a private
mount namespace), so a job on node K sees what it would see on a real cluster.
Every node declares G GPUs (gres with placeholder device files). Two partitions,
`low` (default) and `high`, with partition-priority preemption by REQUEUE, over every node;
`--partition NAME:NODES[:GPUS]` adds partitions over the next NODES nodes (optionally with
another GPU count on them), e.g. for heterogeneous jobs.

    python tools/minicluster.py up --nodes 4 --gpus-per-node 8   # last line: export SLURM_CONF=...
    python tools/minicluster.py up --nodes 3 --gpus-per-node 4 --partition train:1 --partition gen:2:2
    python tools/minicluster.py status
    python tools/minicluster.py kill-node node2     # power loss; revive-node node2 brings it back
    python tools/minicluster.py down

Everything (config, logs, spool, state) lives in --state-dir; daemons are stopped by the
pids recorded there, never by name. Needs root, iproute2, and Debian's slurm-wlm and munge.

What a job sees (and how it differs from a real cluster):
- Node K's IP: `hostname -I`, or `NodeAddr` in `scontrol show node -o nodeK`; names
  (`nodeK` and the controller's hostname) resolve through /etc/hosts, there is no DNS.
  127.0.0.1 on a node is the node's own loopback; the root namespace (where tests and
  `sbatch` run) is reachable from nodes at the bridge address (.1 of the subnet).
- The file system is the machine's, shared by all nodes, /tmp included (node-local on
  real clusters): put per-node/per-job files under paths naming SLURMD_NODENAME/SLURM_JOB_ID.
- GPUs: CUDA_VISIBLE_DEVICES, SLURM_JOB_GPUS (batch) and SLURM_STEP_GPUS (steps) carry the
  node's absolute GPU indices (a second job on a node may get "2,3"): there is no device
  cgroup to renumber them. There are no real GPUs behind them.
- Jobs share a node only with jobs of the same partition: a `low` job waits (Resources)
  for a node that a `train`, `gen` or `score` job holds, whatever GPUs it leaves free.
- proctrack/linuxproc: a process that daemonizes or is orphaned escapes job cleanup and
  keeps running on its node until `down`. Jobs must stop their own children.
- Preemption: when a `high` job needs a `low` job's resources, the low job's steps get
  SIGTERM at once, or, with `--signal=[B:]SIG@T` (preempt_send_user_signal), SIG. A job
  that exits by itself then ends COMPLETED/FAILED: to be requeued it must call
  `scontrol requeue $SLURM_JOB_ID`. One that keeps running is killed and requeued by Slurm
  after GraceTime (plus up to ~10 s). A requeued job waits ~6 s (cred_expire + 1) before
  it can start again, with SLURM_RESTART_COUNT incremented.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("minicluster")

DEFAULT_STATE_DIR = Path(os.environ.get("RLHPC_MINICLUSTER_DIR", "/tmp/rlhpc-minicluster"))
DEFAULT_SUBNET = os.environ.get("RLHPC_MINICLUSTER_SUBNET", "10.77.0.0/24")
# Not Slurm's default 6817, so a site slurmctld on this machine does not collide. The env vars let
# two clusters (two test sessions) live side by side, each with its own RLHPC_MINICLUSTER_DIR.
DEFAULT_PORT = int(os.environ.get("RLHPC_MINICLUSTER_PORT", "16817"))
NETNS_DIR = Path("/var/run/netns")
MUNGE_KEY = Path("/etc/munge/munge.key")
APT_HINT = "apt-get update && apt-get install -y --no-install-recommends slurm-wlm munge iproute2 (or run .ci/install_slurm.sh)"
REQUIRED_BINARIES = {
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "sinfo": "slurm-wlm",
    "scontrol": "slurm-wlm",
    "srun": "slurm-wlm",
    "munged": "munge",
    "munge": "munge",
    "ip": "iproute2",
    "nsenter": "util-linux",
    "unshare": "util-linux",
}
MARKER = ".rlhpc-minicluster"
# A silent node is DOWN after this (plus up to a ping interval, a third of it). A killed node's
# job waits it out (its step ends, and revive_node waits, only once Slurm marked the node DOWN):
# 15 s rather than 30 s makes each node-loss test 15 s shorter; a live node must still miss about
# three pings in a row (every 5 s, MessageTimeout each) to be taken for dead.
SLURMD_TIMEOUT_S = 15
STATE_FILE = "state.json"
# Node states (flags of `scontrol show node` State=) that make a node unusable.
BAD_NODE_FLAGS = {
    "DOWN",
    "DRAIN",
    "DRAINED",
    "DRAINING",
    "FAIL",
    "FAILING",
    "INVAL",
    "NOT_RESPONDING",
    "UNKNOWN",
    "FUTURE",
    "POWERED_DOWN",
    "POWERING_DOWN",
    "REBOOT_REQUESTED",
}


def _flags(state: str) -> set[str]:
    """``scontrol show node`` State= (e.g. ``IDLE+DRAIN*``) -> its flags, markers stripped."""
    return {f.strip("*~#%$@^!-") for f in state.split("+")}


def _usable(state: str) -> bool:
    """Slurm would give the node to a job: no bad flag, and responding (no trailing ``*``)."""
    return not (BAD_NODE_FLAGS & _flags(state)) and not state.endswith("*")


class MiniClusterError(RuntimeError):
    """Something stopped the cluster from coming up or going down; says what and how to fix it."""

    def __init__(self, problem: str, fix: str = ""):
        super().__init__(f"{problem}\n  fix: {fix}" if fix else problem)
        self.problem = problem
        self.fix = fix


@dataclass(frozen=True)
class Spec:
    """What `up` was asked for; an identical spec on a healthy cluster means `up` is a no-op."""

    nodes: int = 4
    gpus_per_node: int = 8
    cpus_per_node: int = 16
    mem_per_node_mb: int = 262144
    subnet: str = DEFAULT_SUBNET
    port: int = DEFAULT_PORT
    grace_time: int = 30
    # Extra partitions over disjoint slices of the nodes, in order: (name, nodes, GPUs per node
    # of those nodes or None for gpus_per_node), beside low and high over every node.
    partitions: tuple[tuple[str, int, int | None], ...] = ()

    def node_gpus(self) -> list[int]:
        """GPUs declared by node k."""
        gpus = [self.gpus_per_node] * self.nodes
        first = 0
        for _, count, per in self.partitions:
            for k in range(first, first + count):
                gpus[k] = self.gpus_per_node if per is None else per
            first += count
        return gpus

    def partition_nodes(self) -> dict[str, list[int]]:
        """Extra partition -> the node indices it holds."""
        out, first = {}, 0
        for name, count, _ in self.partitions:
            out[name] = list(range(first, first + count))
            first += count
        return out

    def validate(self) -> None:
        net = _network(self.subnet)
        if not 1 <= self.nodes <= net.num_addresses - 12:
            raise MiniClusterError(
                f"--nodes {self.nodes} does not fit in subnet {self.subnet}",
                "use fewer nodes or a larger --subnet",
            )
        if self.gpus_per_node < 0 or self.cpus_per_node < 1 or self.mem_per_node_mb < 1:
            raise MiniClusterError(
                "--gpus-per-node must be >= 0, --cpus-per-node and --mem-per-node >= 1",
                "fix the arguments",
            )
        if self.grace_time < 0:
            raise MiniClusterError("--grace-time must be >= 0", "fix the argument")
        if not 1024 <= self.port <= 65000:
            raise MiniClusterError(f"--port {self.port} out of range", "pick a port in 1024..65000")
        names = [name for name, _, _ in self.partitions]
        for name, count, per in self.partitions:
            if not re.fullmatch(r"[A-Za-z][\w-]*", name) or name in ("low", "high") or names.count(name) > 1:
                raise MiniClusterError(
                    f"--partition {name}: not a new partition name", "use a unique name other than low and high"
                )
            if count < 1 or (per is not None and per < 0):
                raise MiniClusterError(f"--partition {name}: at least one node, GPUs >= 0", "fix the argument")
        if sum(count for _, count, _ in self.partitions) > self.nodes:
            raise MiniClusterError(
                f"the --partition slices hold {sum(c for _, c, _ in self.partitions)} nodes, the cluster {self.nodes}",
                "give them fewer nodes, or more --nodes",
            )


def parse_partition(text: str) -> tuple[str, int, int | None]:
    """``train:1`` -> ("train", 1, None); ``gen:2:4`` -> ("gen", 2, 4)."""
    m = re.fullmatch(r"([^:]+):(\d+)(?::(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:NODES[:GPUS_PER_NODE] (e.g. gen:2:4)")
    return m.group(1), int(m.group(2)), int(m.group(3)) if m.group(3) else None


def _network(subnet: str) -> ipaddress.IPv4Network:
    try:
        net = ipaddress.ip_network(subnet, strict=True)
    except ValueError as e:
        raise MiniClusterError(f"bad --subnet {subnet!r}: {e}", "pass e.g. --subnet 10.77.0.0/24") from e
    if not isinstance(net, ipaddress.IPv4Network) or not net.is_private:
        raise MiniClusterError(f"--subnet {subnet} is not a private IPv4 range", "pass e.g. --subnet 10.77.0.0/24")
    return net


def _spec_of(state: dict) -> Spec | None:
    try:
        fields = dict(state["spec"])
        fields["partitions"] = tuple(tuple(p) for p in fields.get("partitions", ()))  # JSON has lists
        return Spec(**fields)
    except (KeyError, TypeError):
        return None


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log yet)"
    return "\n".join("    " + line for line in text[-lines:]) or "(log is empty)"


def _run(
    argv: Sequence[str], *, check: bool = True, fix: str = "", env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, env=env, timeout=timeout)
    except FileNotFoundError as e:
        raise MiniClusterError(f"{argv[0]} not found", fix or APT_HINT) from e
    except subprocess.TimeoutExpired as e:
        raise MiniClusterError(f"`{' '.join(argv)}` timed out after {timeout}s", fix) from e
    if check and proc.returncode != 0:
        out = (proc.stderr or proc.stdout).strip()
        raise MiniClusterError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {out}", fix)
    return proc


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    """True if pid runs (a zombie does not count; reap it if it is our child)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _stop_pids(pids: Sequence[int], what: str, grace: float = 5.0) -> None:
    """TERM, wait up to `grace` seconds, then KILL."""
    pids = [p for p in pids if _alive(p)]
    if not pids:
        return
    log.info("stopping %s (pids %s)", what, " ".join(map(str, pids)))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _alive(pid):
            log.warning("%s pid %d ignored SIGTERM; sending SIGKILL", what, pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)


class MiniCluster:
    """A Slurm cluster of network-namespace nodes on this machine.

    `up()` is idempotent; `down()` removes everything `up()` made. Names of the network
    namespaces, bridge and veths carry a tag derived from the state dir, so two clusters
    with different state dirs, subnets and ports can run side by side.
    """

    def __init__(
        self,
        state_dir: str | Path = DEFAULT_STATE_DIR,
        nodes: int = 4,
        gpus_per_node: int = 8,
        cpus_per_node: int = 16,
        mem_per_node_mb: int = 262144,
        subnet: str = DEFAULT_SUBNET,
        port: int = DEFAULT_PORT,
        grace_time: int = 30,
        partitions: Sequence[tuple[str, int, int | None]] = (),
    ):
        self.state_dir = Path(state_dir).absolute()
        self.spec = Spec(
            nodes, gpus_per_node, cpus_per_node, mem_per_node_mb, subnet, port, grace_time,
            tuple(tuple(p) for p in partitions),
        )  # fmt: skip
        self.tag = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:6]
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    @classmethod
    def attach(cls, state_dir: str | Path = DEFAULT_STATE_DIR) -> MiniCluster:
        """The cluster recorded in state_dir, with the spec it was brought up with."""
        mc = cls(state_dir)
        state = mc._load_state()
        if state is None:
            raise MiniClusterError(f"no minicluster in {mc.state_dir}", "run `python tools/minicluster.py up`")
        spec = _spec_of(state)
        if spec is None:
            raise MiniClusterError(
                f"unreadable state in {mc.state_dir}", "run `python tools/minicluster.py up` to rebuild"
            )
        mc.spec = spec
        return mc

    # ---- names and paths -------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return [f"node{k}" for k in range(self.spec.nodes)]

    @property
    def gpus_per_node(self) -> int:
        return self.spec.gpus_per_node

    @property
    def controller_ip(self) -> str:
        return str(_network(self.spec.subnet).network_address + 1)

    @property
    def node_ips(self) -> dict[str, str]:
        """Node name -> the IP its processes see (the namespace's eth0)."""
        base = _network(self.spec.subnet).network_address
        return {name: str(base + 10 + k) for k, name in enumerate(self.nodes)}

    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def controller_name(self) -> str:
        # slurmctld only runs where gethostname() matches SlurmctldHost.
        return socket.gethostname().split(".")[0]

    @property
    def munge_socket(self) -> Path:
        return self.state_dir / "munge" / "munge.socket"

    @property
    def bridge(self) -> str:
        return f"rlb{self.tag}"

    def netns(self, node: str) -> str:
        return f"rlhpc-{self.tag}-{node}"

    def _veth(self, k: int) -> str:
        return f"rlv{self.tag}n{k}"

    def log_file(self, daemon: str) -> Path:
        """Log of `slurmctld`, `munged` or a node name (its slurmd)."""
        if daemon in ("slurmctld", "munged"):
            return self.state_dir / "log" / f"{daemon}.log"
        return self.state_dir / "log" / f"slurmd-{daemon}.log"

    def _stdout_file(self, daemon: str) -> Path:
        """Where a daemon's stdout/stderr go (early failures land here, not in its log)."""
        if daemon == "munged":
            return self.log_file(daemon)
        return self.log_file(daemon).with_suffix(".stdout")

    def env(self) -> dict[str, str]:
        """os.environ plus SLURM_CONF pointing at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.slurm_conf)}

    # ---- state file ----------------------------------------------------------------------
    def _load_state(self) -> dict | None:
        try:
            return json.loads((self.state_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _save_state(self, state: dict) -> None:
        tmp = self.state_dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_dir / STATE_FILE)

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        # Beside the state dir (not in it): `down` removes the dir, the lock must outlive it.
        self.state_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir.parent / f".{self.state_dir.name}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            yield

    # ---- public API ------------------------------------------------------------------
    def up(self, timeout: float = 90.0) -> bool:
        """Bring the cluster up; return False if an identical healthy one was already up.

        A cluster started here is kept by release(): only down() stops it."""
        with self._lock():
            started = self._up_in_lock(timeout)
            if started:
                self._update_state(kept=True)
            return started

    def acquire(self, timeout: float = 90.0) -> bool:
        """up() for one of several processes (e.g. test sessions) sharing the cluster:
        registers this process as a user; release() stops the cluster after its last user,
        unless a plain up() started it. Returns True if this call started it."""
        with self._lock():
            started = self._up_in_lock(timeout)
            state = self._load_state() or {}
            users = {p for p in state.get("users", []) if _alive(p)} | {os.getpid()}
            self._update_state(users=sorted(users), **({"kept": False} if started else {}))
            return started

    def release(self) -> bool:
        """Unregister this process (see acquire); return True if that took the cluster down."""
        with self._lock():
            state = self._load_state()
            if state is None:
                return False
            users = sorted(p for p in state.get("users", []) if _alive(p) and p != os.getpid())
            if users or state.get("kept", True):
                self._update_state(users=users)
                return False
            self._down_locked()
            return True

    def _update_state(self, **fields: object) -> None:
        state = self._load_state()
        if state is not None:
            self._save_state({**state, **fields})

    def _up_in_lock(self, timeout: float) -> bool:
        self.spec.validate()
        preflight()
        state = self._load_state()
        if state is not None:
            if _spec_of(state) == self.spec and not self._problems(state):
                log.info("an identical minicluster is already up and healthy in %s", self.state_dir)
                return False
            log.info("a different or unhealthy minicluster is up in %s; rebuilding it", self.state_dir)
        self._check_subnet()  # before tearing anything down
        self._down_locked()
        start = time.monotonic()
        try:
            self._up_locked(timeout)
        except BaseException:
            # Stop what we started but keep the logs the error points at.
            self._down_locked(keep_dir=True)
            raise
        log.info(
            "minicluster up in %.1fs: %d nodes x %d GPUs",
            time.monotonic() - start,
            self.spec.nodes,
            self.spec.gpus_per_node,
        )
        return True

    def down(self) -> None:
        """Stop every daemon and job process this cluster started; remove namespaces, links, state dir."""
        with self._lock():
            self._down_locked()

    def is_up(self) -> bool:
        state = self._load_state()
        return state is not None and not self._problems(state)

    def status(self) -> str:
        """Human-readable status of the running cluster (whatever its spec); raises
        MiniClusterError if there is none or it is not healthy."""
        mc = MiniCluster.attach(self.state_dir)
        state = mc._load_state() or {}
        problems = mc._problems(state)
        s = mc.spec
        lines = [
            f"minicluster in {mc.state_dir}: {s.nodes} nodes x {s.gpus_per_node} GPUs, {s.cpus_per_node} CPUs per node, GraceTime {s.grace_time}s",
            f"SLURM_CONF={mc.slurm_conf}",
            f"controller {mc.controller_name} {mc.controller_ip}:{s.port} (slurmctld pid {state['pids'].get('slurmctld')})",
            f"{'NODE':8} {'IP':15} {'STATE':20} GRES",
        ]
        nodes = mc._node_info()
        for name, ip in mc.node_ips.items():
            info = nodes.get(name, {})
            lines.append(f"{name:8} {ip:15} {info.get('State', '?'):20} {info.get('Gres', '?')}")
        sinfo = _run(["sinfo", "-o", "%P %a %D %T %N"], check=False, env=mc.env())
        lines.append((sinfo.stdout or sinfo.stderr).rstrip())
        text = "\n".join(lines)
        if problems:
            raise MiniClusterError(
                text + "\nNOT HEALTHY:\n  " + "\n  ".join(problems),
                "run `python tools/minicluster.py up` to rebuild it",
            )
        return text

    def node_pids(self, node: str) -> list[int]:
        """Every process in the node's network namespace: its slurmd, job steps, what they started."""
        try:
            inode = os.stat(NETNS_DIR / self.netns(node)).st_ino
        except OSError:
            return []
        pids = []
        for proc_dir in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if os.stat(proc_dir / "ns" / "net").st_ino == inode:
                    pids.append(int(proc_dir.name))
        return pids

    def kill_node(self, node: str) -> list[int]:
        """Power loss of ``node``: its link goes down (peers see silence, not refused
        connections) and every process in its namespace, slurmd included, gets SIGKILL at
        once. Slurm marks it DOWN after SlurmdTimeout. Returns the pids killed."""
        with self._lock():
            state = self._load_state() or {}
            if node not in state.get("pids", {}).get("slurmd", {}):
                raise MiniClusterError(f"no node {node!r} in {self.state_dir}", f"name one of {', '.join(self.nodes)}")
            k = int(node.removeprefix("node"))
            _run(["ip", "link", "set", self._veth(k), "down"], check=False)
            pids = self.node_pids(node)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(p) for p in pids):
                time.sleep(0.05)
            self._update_state(killed=sorted({*state.get("killed", []), node}))
            log.info("%s killed (%d processes)", node, len(pids))
            return pids

    def revive_node(self, node: str, timeout: float = 60.0) -> None:
        """Power ``node`` back on: link up, a fresh slurmd; returns once Slurm sees it again
        (ReturnToService=2 makes a node that was DOWN for not responding usable at once).

        A killed node boots for longer than SlurmdTimeout, as real nodes do (BIOS, GPUs): this
        first waits until Slurm has marked it DOWN. A slurmd back sooner is, to Slurm, a slurmd
        restart whose job steps vanished, and srun aborts the whole step (measured: "srun: error:
        Cannot communicate with node 2. Aborting job.", exit 137) instead of dropping the node."""
        with self._lock():
            state = self._load_state() or {}
            if node not in state.get("pids", {}).get("slurmd", {}):
                raise MiniClusterError(f"no node {node!r} in {self.state_dir}", f"name one of {', '.join(self.nodes)}")
        if node in state.get("killed", []):
            self._wait_node_state(node, lambda st: "DOWN" in _flags(st), SLURMD_TIMEOUT_S * 3, "DOWN")
        with self._lock():
            state = self._load_state() or {}
            k = int(node.removeprefix("node"))
            _run(["ip", "link", "set", self._veth(k), "up"])
            if not self._ours(state["pids"]["slurmd"][node]):
                self._start_slurmd(state, node)
            self._update_state(killed=[n for n in state.get("killed", []) if n != node])
        st = self._wait_node_state(node, _usable, timeout, "back")
        log.info("%s is back (%s)", node, st)

    def _wait_node_state(self, node: str, ok: Callable[[str], bool], timeout: float, what: str) -> str:
        """Poll Slurm's state of ``node`` until ``ok(state)``; returns the state."""
        deadline = time.monotonic() + timeout
        while True:
            st = self._node_info().get(node, {}).get("State", "?")
            if ok(st):
                return st
            if time.monotonic() > deadline:
                raise MiniClusterError(
                    f"{node} is {st}, not {what}, after {timeout:.0f}s", f"read {self.log_file(node)}"
                )
            time.sleep(0.2)

    # ---- bring-up ----------------------------------------------------------------------
    def _up_locked(self, timeout: float) -> None:
        self._check_port()
        self._make_dirs()
        state: dict = {"spec": asdict(self.spec), "tag": self.tag, "pids": {}, "netns": [], "bridge": self.bridge}
        self._save_state(state)
        self._start_munged(state)
        self._make_network(state)
        self._write_configs()
        self._start_slurmctld(state)
        self._start_slurmds(state)
        self._wait_nodes_idle(state, timeout)

    def _check_subnet(self) -> None:
        net = _network(self.spec.subnet)
        out = _run(["ip", "-4", "-o", "addr", "show"]).stdout
        for line in out.splitlines():
            m = re.search(r"^\d+:\s+(\S+)\s+inet\s+(\S+)", line)
            if m and m.group(1) != self.bridge and ipaddress.ip_interface(m.group(2)).network.overlaps(net):
                raise MiniClusterError(
                    f"subnet {net} overlaps {m.group(2)} on {m.group(1)} (another cluster or a real network)",
                    "pass a free private range with --subnet, e.g. --subnet 10.78.0.0/24",
                )

    def _check_port(self) -> None:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", self.spec.port))
            except OSError as e:
                raise MiniClusterError(
                    f"port {self.spec.port} is in use ({e})", "pass another --port (two clusters need two ports)"
                ) from e

    def _make_dirs(self) -> None:
        if self.state_dir.exists() and any(self.state_dir.iterdir()) and not (self.state_dir / MARKER).exists():
            raise MiniClusterError(
                f"{self.state_dir} exists, is not empty and was not made by minicluster",
                "pass an empty or new --state-dir",
            )
        if len(str(self.munge_socket)) > 100:
            raise MiniClusterError(
                f"state dir path too long for a unix socket: {self.munge_socket}", "use a shorter --state-dir"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        # munged refuses directories writable by others; slurmd and clients only traverse it.
        os.chmod(self.state_dir, 0o755)
        # munged runs as the munge user and must reach its socket dir through every parent.
        for parent in self.state_dir.parents:
            if not parent.stat().st_mode & 0o001:
                raise MiniClusterError(
                    f"{parent} is not searchable by others, so munged (user munge) cannot reach {self.state_dir}",
                    "put --state-dir under a world-searchable directory such as /tmp",
                )
        (self.state_dir / MARKER).touch()
        for sub in ("log", "run", "ctld", "spool"):
            (self.state_dir / sub).mkdir(exist_ok=True)
        for name in self.nodes:
            (self.state_dir / "spool" / name).mkdir(exist_ok=True)
            gpu_dir = self.state_dir / "gpu" / name
            gpu_dir.mkdir(parents=True, exist_ok=True)
            # Slurm drops GPUs without File= and wants a device there: links to /dev/null
            # stand in for /dev/nvidiaN (the number in the name is the GPU index).
            for i in range(self.spec.node_gpus()[int(name.removeprefix("node"))]):
                (gpu_dir / f"nvidia{i}").symlink_to("/dev/null")

    def _spawn(self, argv: list[str], output: Path, *, user: str | None = None) -> int:
        out = open(output, "ab")
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Not the caller's SLURM_JOB_ID & co (e.g. when run inside a Slurm job).
                env={k: v for k, v in self.env().items() if not k.startswith("SLURM_") or k == "SLURM_CONF"},
                start_new_session=True,  # survives this tool and its Ctrl-C
                user=user,
                group=user,
                extra_groups=[] if user else None,
                cwd=self.state_dir,
            )
        finally:
            out.close()
        self._procs[proc.pid] = proc
        return proc.pid

    def _start_munged(self, state: dict) -> None:
        munge_dir = self.munge_socket.parent
        munge_dir.mkdir(exist_ok=True)
        shutil.chown(munge_dir, "munge", "munge")
        os.chmod(munge_dir, 0o755)
        # In the foreground munged logs to stderr, which goes to its log file.
        pid = self._spawn(
            [
                shutil.which("munged") or "munged",
                "--foreground",
                f"--socket={self.munge_socket}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
                f"--key-file={MUNGE_KEY}",
            ],
            self.log_file("munged"),
            user="munge",
        )
        state["pids"]["munged"] = pid
        self._save_state(state)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if not _alive(pid):
                break
            if self.munge_socket.exists():
                cred = _run(["munge", "-n", "-S", str(self.munge_socket)], check=False)
                if cred.returncode == 0:
                    return
            time.sleep(0.1)
        raise MiniClusterError(
            f"munged did not come up (socket {self.munge_socket}); its log {self.log_file('munged')}:\n{_tail(self.log_file('munged'))}",
            f"read {self.log_file('munged')}; check {MUNGE_KEY} exists, owned by munge, mode 0400",
        )

    def _make_network(self, state: dict) -> None:
        fix = "network namespaces need root with CAP_NET_ADMIN/CAP_SYS_ADMIN (in Docker: --privileged) and iproute2"
        prefix = _network(self.spec.subnet).prefixlen
        _run(["ip", "link", "add", self.bridge, "type", "bridge"], fix=fix)
        _run(["ip", "addr", "add", f"{self.controller_ip}/{prefix}", "dev", self.bridge], fix=fix)
        _run(["ip", "link", "set", self.bridge, "up"], fix=fix)
        for k, (name, ip) in enumerate(self.node_ips.items()):
            ns = self.netns(name)
            _run(["ip", "netns", "add", ns], fix=fix)
            state["netns"].append(ns)
            self._save_state(state)
            host_end = self._veth(k)
            _run(["ip", "link", "add", host_end, "type", "veth", "peer", "name", f"{host_end}p", "netns", ns], fix=fix)
            _run(["ip", "link", "set", host_end, "master", self.bridge, "up"], fix=fix)
            # Inside the namespace the node's only NIC is eth0, as on a real node.
            _run(["ip", "-n", ns, "link", "set", f"{host_end}p", "name", "eth0"], fix=fix)
            _run(["ip", "-n", ns, "addr", "add", f"{ip}/{prefix}", "dev", "eth0"], fix=fix)
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"], fix=fix)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"], fix=fix)
            # A default route makes "which IP do I reach the world from" tricks pick eth0.
            _run(["ip", "-n", ns, "route", "add", "default", "via", self.controller_ip], fix=fix)

    def _write_configs(self) -> None:
        s = self.spec
        d = self.state_dir
        ips = self.node_ips
        gpus = dict(zip(self.nodes, s.node_gpus()))
        node_lines = "\n".join(
            f"NodeName={name} NodeAddr={ip} NodeHostname={name} CPUs={s.cpus_per_node} Boards=1 SocketsPerBoard=1 "
            f"CoresPerSocket={s.cpus_per_node} ThreadsPerCore=1 RealMemory={s.mem_per_node_mb}"
            + (f" Gres=gpu:{gpus[name]}" if gpus[name] else "")
            + " State=UNKNOWN"
            for name, ip in ips.items()
        )
        nodelist = f"node[0-{s.nodes - 1}]" if s.nodes > 1 else "node0"
        extra_partitions = "".join(
            f"PartitionName={name} Nodes={','.join(f'node{k}' for k in ks)} Default=NO PriorityTier=1 "
            f"PreemptMode=REQUEUE GraceTime={s.grace_time} OverSubscribe=YES MaxTime=INFINITE State=UP\n"
            for name, ks in s.partition_nodes().items()
        )
        conf = f"""\
# Written by tools/minicluster.py up; rerun `up` to change it, edits are lost.
ClusterName=rlhpc{self.tag}
SlurmctldHost={self.controller_name}({self.controller_ip})
SlurmctldPort={s.port}
SlurmdPort={s.port + 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays the restart of a requeued job by cred_expire + 1 s (default 120 s;
# measured here: 11.2 s at 10, 5.6 s at 5). 5 is Slurm's least: tests/slurm waits out about 16
# requeues a run, and a credential goes from slurmctld to a slurmd on this machine at once.
AuthInfo=socket={self.munge_socket},cred_expire=5
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd-%n.pid
SlurmctldLogFile={self.log_file("slurmctld")}
SlurmdLogFile={d}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Nodes declare more CPUs/GPUs than the machine has; accept the declaration.
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
PropagateResourceLimits=NONE
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
MailProg=/bin/true
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,batch_sched_delay=0,bf_interval=1,sched_min_interval=100000
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
SlurmctldParameters=preempt_send_user_signal
JobRequeue=1
ReturnToService=2
MinJobAge=30
KillWait=5
InactiveLimit=0
MessageTimeout=5
SlurmctldTimeout=10
SlurmdTimeout={SLURMD_TIMEOUT_S}
UnkillableStepTimeout=30

{node_lines}

PartitionName=low Nodes={nodelist} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={s.grace_time} OverSubscribe=YES MaxTime=INFINITE State=UP
PartitionName=high Nodes={nodelist} Default=NO PriorityTier=10 OverSubscribe=YES MaxTime=INFINITE State=UP
{extra_partitions}"""
        self.slurm_conf.write_text(conf)
        gres = "".join(
            f"NodeName={name} Name=gpu File={d}/gpu/{name}/nvidia[0-{n - 1}]\n"
            if n > 1
            else f"NodeName={name} Name=gpu File={d}/gpu/{name}/nvidia0\n"
            for name, n in gpus.items()
            if n
        )
        (d / "gres.conf").write_text(gres)
        # Each node gets its own /etc/hosts, nsswitch.conf and resolv.conf (see _start_slurmds).
        hosts = [
            "127.0.0.1\tlocalhost",
            "::1\tlocalhost ip6-localhost ip6-loopback",
            f"{self.controller_ip}\t{self.controller_name}",
        ]
        hosts += [f"{ip}\t{name}" for name, ip in ips.items()]
        (d / "hosts").write_text("\n".join(hosts) + "\n")
        # Nodes have no DNS: the machine's nameserver is not reachable from a namespace, and
        # each miss (e.g. the AAAA lookup `getent hosts node0` does first) would stall 10 s.
        # /etc/hosts alone answers; any resolver that still asks DNS is refused at once.
        try:
            nsswitch = Path("/etc/nsswitch.conf").read_text()
        except OSError:
            nsswitch = "passwd: files\ngroup: files\nshadow: files\n"
        nsswitch = re.sub(r"(?m)^hosts:.*$", "", nsswitch) + "hosts: files\n"
        (d / "nsswitch.conf").write_text(nsswitch)
        (d / "resolv.conf").write_text("# minicluster node: no DNS, names are in /etc/hosts\nnameserver 127.0.0.1\n")

    def _start_slurmctld(self, state: dict) -> None:
        pid = self._spawn(
            [shutil.which("slurmctld") or "slurmctld", "-D", "-f", str(self.slurm_conf)], self._stdout_file("slurmctld")
        )
        state["pids"]["slurmctld"] = pid
        self._save_state(state)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(pid):
            ping = _run(["scontrol", "ping"], check=False, env=self.env(), timeout=15)
            if "is UP" in ping.stdout:
                return
            time.sleep(0.2)
        raise self._daemon_error("slurmctld", pid)

    def _start_slurmds(self, state: dict) -> None:
        state["pids"]["slurmd"] = {}
        for name in self.nodes:
            self._start_slurmd(state, name)

    def _start_slurmd(self, state: dict, name: str) -> None:
        # nsenter, not `ip netns exec`: the latter remounts /sys and slurmd then finds
        # no cgroup filesystem. unshare gives the node its own hostname and name files;
        # slave propagation keeps later unmounts (e.g. `ip netns del`) reaching the node.
        argv = [
            "nsenter",
            f"--net={NETNS_DIR / self.netns(name)}",
            "--",
            "unshare",
            "--mount",
            "--uts",
            "--propagation",
            "slave",
            "--",
            "/bin/sh",
            "-c",
            "set -e; for f in hosts nsswitch.conf resolv.conf; do"
            ' if [ -e "/etc/$f" ]; then mount --bind "$1/$f" "/etc/$f"; fi; done;'
            ' hostname "$2"; exec "$3" -D -N "$2" -f "$4"',
            "sh",
            str(self.state_dir),
            name,
            shutil.which("slurmd") or "slurmd",
            str(self.slurm_conf),
        ]
        state["pids"]["slurmd"][name] = self._spawn(argv, self._stdout_file(name))
        self._save_state(state)

    def _wait_nodes_idle(self, state: dict, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for daemon, pid in self._daemon_pids(state):
                if not _alive(pid):
                    raise self._daemon_error(daemon, pid)
            info = self._node_info()
            states = {n: info.get(n, {}).get("State", "?") for n in self.nodes}
            if all(st == "IDLE" for st in states.values()):
                return
            if time.monotonic() > deadline:
                detail = "\n".join(
                    f"  {n}: {st} {info.get(n, {}).get('Reason', '')} (log {self.log_file(n)})"
                    for n, st in states.items()
                )
                raise MiniClusterError(
                    f"nodes not idle after {timeout:.0f}s:\n{detail}\nslurmctld log {self.log_file('slurmctld')}:\n{_tail(self.log_file('slurmctld'))}",
                    "read the slurmd logs named above",
                )
            time.sleep(0.2)

    def _daemon_error(self, daemon: str, pid: int) -> MiniClusterError:
        logf = self.log_file(daemon)
        what = "slurmd" if daemon.startswith("node") else daemon
        stdout = self._stdout_file(daemon)
        code = ""
        if pid in self._procs and self._procs[pid].poll() is not None:
            code = f" (exit {self._procs[pid].returncode})"
        return MiniClusterError(
            f"{what} {'for ' + daemon + ' ' if what == 'slurmd' else ''}did not come up{code}; its log {logf}:\n{_tail(logf)}\nand {stdout}:\n{_tail(stdout, 5)}",
            f"read {logf}",
        )

    # ---- health --------------------------------------------------------------------------
    def _daemon_pids(self, state: dict) -> list[tuple[str, int]]:
        pids = state.get("pids", {})
        out = [(name, pid) for name, pid in pids.get("slurmd", {}).items()]
        out += [(d, pids[d]) for d in ("slurmctld", "munged") if d in pids]
        return out

    def _ours(self, pid: int) -> bool:
        """The pid runs one of our daemons (its command line names our state dir)."""
        return _alive(pid) and str(self.state_dir) in _cmdline(pid)

    def _problems(self, state: dict) -> list[str]:
        problems = [
            f"{d} (pid {pid}) is not running; see {self.log_file(d)}"
            for d, pid in self._daemon_pids(state)
            if not self._ours(pid)
        ]
        if len(state.get("pids", {}).get("slurmd", {})) != state["spec"]["nodes"]:
            problems.append("not every slurmd was started")
        if problems:
            return problems
        info = self._node_info()
        for node in [f"node{k}" for k in range(state["spec"]["nodes"])]:
            st = info.get(node, {}).get("State")
            if st is None:
                problems.append(f"{node} unknown to slurmctld")
            elif not _usable(st):
                problems.append(f"{node} is {st}: {info[node].get('Reason', '')}")
        return problems

    def _node_info(self) -> dict[str, dict[str, str]]:
        proc = _run(["scontrol", "show", "node", "-o"], check=False, env=self.env(), timeout=15)
        info: dict[str, dict[str, str]] = {}
        for line in proc.stdout.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            reason = re.search(r"Reason=(.+?)(?=\s+\w+=|$)", line)
            if reason:
                fields["Reason"] = reason.group(1)
            if "NodeName" in fields:
                info[fields["NodeName"]] = fields
        return info

    # ---- tear-down -----------------------------------------------------------------------
    def _down_locked(self, keep_dir: bool = False) -> None:
        state = self._load_state() or {}
        did = False
        # Daemons first (slurmd before slurmctld so no node is marked down needlessly).
        pids = state.get("pids", {})
        slurmds = [p for p in pids.get("slurmd", {}).values() if self._ours(p)]
        ctld, munged = [pids.get("slurmctld")], [pids.get("munged")]
        if not state:
            # State file lost (crash, manual rm): find our daemons by the paths only they use.
            conf, sock = f"-f {self.slurm_conf}", f"--socket={self.munge_socket}"
            for proc_dir in Path("/proc").glob("[0-9]*"):
                cmd = _cmdline(int(proc_dir.name))
                if cmd.endswith(conf) or conf + " " in cmd:
                    (ctld if "slurmctld" in cmd.split()[0] else slurmds).append(int(proc_dir.name))
                elif sock in cmd.split():
                    munged.append(int(proc_dir.name))
        for what, group in (("slurmd", slurmds), ("slurmctld", ctld), ("munged", munged)):
            group = [p for p in group if p and self._ours(p)]
            if group:
                did = True
                _stop_pids(group, what)
        # Job steps and anything a job left behind still live in the node namespaces.
        namespaces = sorted({*state.get("netns", []), *(p.name for p in NETNS_DIR.glob(f"rlhpc-{self.tag}-*"))})
        inodes = {}
        for ns in namespaces:
            with contextlib.suppress(OSError):
                inodes[os.stat(NETNS_DIR / ns).st_ino] = ns
        leftovers = []
        for proc_dir in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if os.stat(proc_dir / "ns" / "net").st_ino in inodes:
                    leftovers.append(int(proc_dir.name))
        if leftovers:
            _stop_pids(leftovers, "processes left in the node namespaces", grace=3)
        for ns in namespaces:
            did = True
            _run(["ip", "netns", "del", ns], check=False)
        links = _run(["ip", "-o", "link", "show"], check=False).stdout
        for link in re.findall(rf"^\d+:\s+(rl[bv]{self.tag}[^:@\s]*)", links, flags=re.M):
            did = True
            _run(["ip", "link", "del", link], check=False)
        for pid, proc in list(self._procs.items()):
            with contextlib.suppress(Exception):
                proc.wait(timeout=1)
            self._procs.pop(pid, None)
        if self.state_dir.exists() and (self.state_dir / MARKER).exists():
            if keep_dir:
                with contextlib.suppress(OSError):
                    (self.state_dir / STATE_FILE).unlink()
            else:
                did = True
                shutil.rmtree(self.state_dir, ignore_errors=True)
        if did:
            log.info("minicluster in %s is down", self.state_dir)


def preflight() -> None:
    """Fail early, with the fix, when this machine cannot run the cluster."""
    if os.geteuid() != 0:
        raise MiniClusterError(
            "minicluster must run as root (it creates network namespaces and runs munged/slurmd)",
            "rerun as root, e.g. `sudo python tools/minicluster.py up`",
        )
    missing = sorted(b for b in REQUIRED_BINARIES if shutil.which(b) is None)
    if missing:
        pkgs = sorted({REQUIRED_BINARIES[b] for b in missing})
        raise MiniClusterError(f"missing {', '.join(missing)} (packages {', '.join(pkgs)})", APT_HINT)
    if not MUNGE_KEY.exists():
        raise MiniClusterError(
            f"{MUNGE_KEY} is missing",
            "reinstall munge (`apt-get install --reinstall munge`) or run `mungekey --create` as the munge user",
        )
    netns = _run(["ip", "netns", "list"], check=False)
    if netns.returncode != 0:
        raise MiniClusterError(
            f"`ip netns` is unavailable: {netns.stderr.strip()}",
            "install iproute2 and run where network namespaces are allowed (root with CAP_SYS_ADMIN; in Docker --privileged)",
        )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--state-dir",
        type=Path,
        default=DEFAULT_STATE_DIR,
        help="all config, logs, spool and pids (default %(default)s; env RLHPC_MINICLUSTER_DIR)",
    )
    p.add_argument("-v", "--verbose", action="store_true")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="bring the cluster up (idempotent); last line: export SLURM_CONF=...")
    _add_common(up)
    up.add_argument("--nodes", type=int, default=4)
    up.add_argument("--gpus-per-node", type=int, default=8)
    up.add_argument("--cpus-per-node", type=int, default=16)
    up.add_argument(
        "--mem-per-node", type=int, default=262144, help="RealMemory in MB (memory is not a consumable resource)"
    )
    up.add_argument(
        "--subnet",
        default=DEFAULT_SUBNET,
        help="private range for the bridge (.1) and nodes (.10+k) (default %(default)s)",
    )
    up.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="SlurmctldPort; SlurmdPort is port+1 (default %(default)s)"
    )
    up.add_argument(
        "--grace-time",
        type=int,
        default=30,
        help="GraceTime of the low partition: seconds a preempted job gets before SIGKILL+requeue (default %(default)s)",
    )
    up.add_argument(
        "--partition",
        dest="partitions",
        type=parse_partition,
        action="append",
        default=[],
        metavar="NAME:NODES[:GPUS_PER_NODE]",
        help="an extra partition over the next NODES nodes (in order, disjoint), optionally with another "
        "GPU count on them; repeatable, e.g. --partition train:1 --partition gen:2:2",
    )
    up.add_argument("--timeout", type=float, default=90.0, help="seconds to wait for all nodes to be idle")
    for name, text in (
        ("status", "show nodes, partitions, state; exit 1 if not up"),
        ("down", "stop everything up made"),
        ("env", "print export SLURM_CONF=... if up"),
    ):
        _add_common(sub.add_parser(name, help=text))
    for name, text in (
        ("kill-node", "power loss of NODE: link down, SIGKILL to its slurmd and every process in its namespace"),
        ("revive-node", "power NODE back on: link up, a fresh slurmd; returns once Slurm sees it"),
    ):
        p = sub.add_parser(name, help=text)
        _add_common(p)
        p.add_argument("node", metavar="NODE")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="minicluster: %(message)s", stream=sys.stderr
    )
    try:
        if args.cmd == "up":
            mc = MiniCluster(
                args.state_dir,
                args.nodes,
                args.gpus_per_node,
                args.cpus_per_node,
                args.mem_per_node,
                args.subnet,
                args.port,
                args.grace_time,
                args.partitions,
            )
            if not mc.up(args.timeout):
                print(f"minicluster already up in {mc.state_dir}: {mc.spec.nodes} nodes x {mc.spec.gpus_per_node} GPUs")
            print(f"export SLURM_CONF={mc.slurm_conf}")
        elif args.cmd == "down":
            if os.geteuid() != 0:
                preflight()
            MiniCluster(args.state_dir).down()
        elif args.cmd == "kill-node":
            pids = MiniCluster.attach(args.state_dir).kill_node(args.node)
            print(f"{args.node}: killed {len(pids)} processes")
        elif args.cmd == "revive-node":
            MiniCluster.attach(args.state_dir).revive_node(args.node)
            print(f"{args.node}: back")
        elif args.cmd in ("status", "env"):
            mc = MiniCluster(args.state_dir)
            text = mc.status()
            print(text if args.cmd == "status" else f"export SLURM_CONF={mc.slurm_conf}")
    except MiniClusterError as e:
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
