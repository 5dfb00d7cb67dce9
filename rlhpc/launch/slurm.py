"""Everything that talks to Slurm: sbatch options as a user spells them, submitit, and the
one home of every ``sinfo``/``scontrol`` call rlhpc makes (nothing else runs Slurm's commands).

submitit builds the sbatch script (one task per node, ``--signal``, ``--open-mode=append``)
and runs sbatch; we add ``--requeue`` and refuse, before submitting, what the partition
cannot give. ``scontrol`` rather than ``sacct`` answers job states: many sites (and the
minicluster) run no accounting database.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass, field

import submitit

from rlhpc.errors import ConfigError
from rlhpc.run_dir import RunDir

log = logging.getLogger(__name__)


@dataclass
class SlurmOptions:
    nodes: int = 1
    gpus_per_node: int = 8
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time_min: int = 24 * 60
    constraint: str | None = None
    exclusive: bool = False
    job_name: str = "rlhpc"
    cpus_per_task: int | None = None
    signal_grace_s: int = 120  # USR2 this long before the time limit: room for one checkpoint
    extra: dict[str, str | bool] = field(default_factory=dict)  # any other sbatch option

    def check(self) -> None:
        """Refuse what sbatch would take but the job cannot live with (before anything is written)."""
        if self.time_min <= 0:
            raise ConfigError(
                f"--time {self.time_min} asks for no time: Slurm reads 0 as no limit, a local run is killed at once",
                "give a time limit, e.g. --time 24:00:00",
            )
        if self.signal_grace_s < 0:
            raise ConfigError(
                f"--signal-grace {self.signal_grace_s} is negative",
                "give the seconds before the time limit the job is warned, e.g. --signal-grace 120",
            )
        if self.signal_grace_s >= self.time_min * 60:
            raise ConfigError(
                f"--signal-grace {self.signal_grace_s}s is not shorter than the time limit ({self.time_min} min): "
                "the job would be told to stop as it starts",
                f"use a --signal-grace below {self.time_min * 60} seconds, or a longer --time",
            )
        named = {
            f"--{name.replace('_', '-')}": getattr(self, name)
            for name in ("partition", "account", "qos", "constraint", "job_name")
        }
        named.update({f"--sbatch {key}": f"{key}={value}" for key, value in self.extra.items()})
        for option, value in named.items():
            if isinstance(value, str) and _CONTROL.search(value):
                raise ConfigError(
                    f"{option} {value!r} holds a control character (a newline ends the #SBATCH line: "
                    "the options after it would be ignored)",
                    f"write {option} on one line, without control characters",
                )


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def parse_time(text: str) -> int:
    """sbatch time formats -> minutes: ``MM``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        raise ConfigError(
            f"--time {text!r} is not a Slurm time", "write minutes (90), HH:MM:SS (24:00:00) or D-HH:MM (1-12:00)"
        )
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is None and b is None:  # plain minutes
        return a
    if days is None and c is None:  # MM:SS
        return a + (1 if b else 0)
    if days is None:  # HH:MM:SS
        return a * 60 + b + (1 if c else 0)
    return days * 24 * 60 + a * 60 + (b or 0) + (1 if c else 0)


def parse_extra(items: list[str]) -> dict[str, str | bool]:
    """``--sbatch mail-type=END --sbatch hold`` -> {"mail-type": "END", "hold": True}."""
    out: dict[str, str | bool] = {}
    for item in items:
        key, sep, value = item.lstrip("-").partition("=")
        if not key:
            raise ConfigError(f"--sbatch {item!r} has no option name", "write e.g. --sbatch mail-type=END")
        out[key] = value if sep else True
    return out


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: int
    gpus_per_node: int
    states: tuple[str, ...]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _fields(text: str) -> dict[str, str]:
    """``scontrol show ... -o`` output -> {"JobState": "RUNNING", ...}."""
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def slurm_available() -> bool:
    """A working Slurm answers ``sinfo``; the binary alone is not enough (submitit checks only that)."""
    if shutil.which("sinfo") is None:
        return False
    try:
        return _run(["sinfo", "-h", "-o", "%P"], timeout=15).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def query_partitions() -> dict[str, Partition]:
    """Partitions with node counts and the smallest GPU count of their nodes, from ``sinfo``."""
    out = _run(["sinfo", "-h", "-N", "-o", "%P|%N|%G|%t"], timeout=30)
    if out.returncode != 0:
        raise ConfigError(
            f"sinfo failed: {out.stderr.strip()}", "check that Slurm is reachable from this node (SLURM_CONF)"
        )
    nodes: dict[str, dict[str, tuple[int, str]]] = {}
    default = None
    for line in out.stdout.splitlines():
        part, node, gres, state = line.split("|")
        if part.endswith("*"):
            part = default = part[:-1]
        gpus = sum(int(n) for n in re.findall(r"gpu(?::[\w.-]+)?:(\d+)", gres))
        nodes.setdefault(part, {})[node] = (gpus, state)
    parts = {
        name: Partition(name, len(ns), min(g for g, _ in ns.values()), tuple(sorted({s for _, s in ns.values()})))
        for name, ns in nodes.items()
    }
    if default is not None:
        parts[""] = parts[default]  # the default partition, for jobs that name none
    return parts


def preflight(opts: SlurmOptions) -> None:
    """Refuse, before anything is submitted, what the partition can never give."""
    if opts.nodes < 1:
        raise ConfigError(f"--nodes {opts.nodes} must be at least 1", "ask for one node or more")
    if opts.gpus_per_node < 1:
        raise ConfigError(
            f"--gpus-per-node {opts.gpus_per_node} must be at least 1", "the actor and the engines need GPUs"
        )
    parts = query_partitions()
    key = opts.partition or ""
    if key not in parts:
        names = ", ".join(sorted(p for p in parts if p))
        raise ConfigError(
            f"partition {opts.partition!r} does not exist"
            if opts.partition
            else "this cluster has no default partition",
            f"pass --partition with one of: {names}",
        )
    part = parts[key]
    if opts.nodes > part.nodes:
        raise ConfigError(
            f"--nodes {opts.nodes} but partition {part.name!r} has {part.nodes} nodes",
            f"ask for at most {part.nodes} nodes, or another partition",
        )
    if opts.gpus_per_node > part.gpus_per_node:
        raise ConfigError(
            f"--gpus-per-node {opts.gpus_per_node} but nodes in partition {part.name!r} have {part.gpus_per_node} GPUs",
            f"ask for at most {part.gpus_per_node} GPUs per node",
        )


class PreviewExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor without its check that ``srun`` exists: a dry run previews the
    sbatch script on a laptop, built by the same executor and parameters as a real submission."""

    @classmethod
    def affinity(cls) -> int:
        return 2  # what submitit's own affinity() answers where srun exists


def slurm_executor(run: RunDir, opts: SlurmOptions, preview: bool = False) -> submitit.SlurmExecutor:
    executor = (PreviewExecutor if preview else submitit.SlurmExecutor)(folder=run.submitit_dir)
    params = {
        "job_name": opts.job_name,
        "nodes": opts.nodes,
        "ntasks_per_node": 1,  # one task per node: Ray head or worker
        "gpus_per_node": opts.gpus_per_node,
        "time": opts.time_min,
        "signal_delay_s": opts.signal_grace_s,
        "additional_parameters": {"requeue": True, **opts.extra},
        "stderr_to_stdout": False,
    }
    for key in ("partition", "account", "qos", "constraint", "cpus_per_task"):
        if getattr(opts, key) is not None:
            params[key] = getattr(opts, key)
    if opts.exclusive:
        params["exclusive"] = True
    executor.update_parameters(**params)
    return executor


def sbatch_script(executor: submitit.SlurmExecutor) -> str:
    """The script submitit would hand to sbatch (its own builder, so preview and reality agree)."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=executor._submitit_command_str, folder=executor.folder, **executor.parameters)


# ---------------------------------------------------------------- jobs and nodes

SLURM_ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SUSPENDED",
    "STAGE_OUT",
    "SIGNALING",
    "PREEMPTED",
}


def job_state(job_id: str) -> str | None:
    """The job's state from ``scontrol`` (which needs no accounting database), None once forgotten."""
    return _fields(_run(["scontrol", "show", "job", job_id, "-o"], timeout=30).stdout).get("JobState")


def show_job(job_id: str) -> dict[str, str] | None:
    """Every field ``scontrol show job`` gives; None when Slurm does not know the job or cannot be asked."""
    try:
        out = _run(["scontrol", "show", "job", job_id, "-o"], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return _fields(out.stdout)


def node_addr(node: str) -> str | None:
    """The NodeAddr Slurm is configured to reach ``node`` by; None when scontrol cannot say."""
    try:
        out = _run(["scontrol", "show", "node", node, "-o"], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:  # e.g. a container without Slurm tools
        log.warning("scontrol unavailable (%s): no NodeAddr for node %s", e, node)
        return None
    return _fields(out.stdout).get("NodeAddr")


def requeue(job_id: str) -> str | None:
    """``scontrol requeue``; Slurm's refusal as text (e.g. already requeueing), None when it accepted."""
    out = _run(["scontrol", "requeue", job_id], timeout=60)
    return (out.stderr.strip() or f"exit status {out.returncode}") if out.returncode else None


def requeue_hold(job_id: str) -> str | None:
    """``scontrol requeuehold``: requeue the job held, for a person to release. Slurm's refusal
    as text, None when it accepted."""
    out = _run(["scontrol", "requeuehold", job_id], timeout=60)
    return (out.stderr.strip() or f"exit status {out.returncode}") if out.returncode else None


def hold_reason(info: dict[str, str] | None) -> str | None:
    """Why the job is held (REQUEUE_HOLD, or pending with a hold reason), None when it is not."""
    if not info:
        return None
    state, reason = info.get("JobState", ""), info.get("Reason", "")
    if state == "REQUEUE_HOLD" or (state in ("PENDING", "REQUEUED") and "held" in reason.lower()):
        return reason or state
    return None
