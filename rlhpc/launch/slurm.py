"""Everything that talks to Slurm: sbatch options as a user spells them, submitit, and the
one home of every ``sinfo``/``scontrol`` call rlhpc makes (nothing else runs Slurm's commands).

submitit builds the sbatch script (one task per node, ``--signal``, ``--open-mode=append``)
and runs sbatch; we add ``--requeue`` and refuse, before submitting, what the partition
cannot give. submitit cannot express a heterogeneous job: ``HetSlurmExecutor`` adds the
rollout component (and the reward model's, when it has one: ``#SBATCH hetjob`` and its lines
each) to the script submitit writes, and ``--het-group=0,1[,2]`` to its srun, so one task per
node of every component runs the same pickle. ``scontrol`` rather than ``sacct`` answers job states: many sites (and the
minicluster) run no accounting database.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import submitit

from rlhpc.errors import ConfigError
from rlhpc.run_dir import RunDir
from rlhpc.util.processes import python_command

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
    # The rollout component of a heterogeneous job (cluster.rollout_*); None: a homogeneous job.
    rollout_nodes: int | None = None
    rollout_gpus_per_node: int | None = None
    rollout_partition: str | None = None
    # The reward model's component, third of a heterogeneous job (cluster.reward_*); None: none.
    reward_nodes: int | None = None
    reward_gpus_per_node: int | None = None
    reward_partition: str | None = None

    @property
    def het_groups(self) -> str | None:
        """srun's ``--het-group`` value for one task per node of every component; None: not a het job."""
        if self.rollout_nodes is None:
            return None
        return "0,1,2" if self.reward_nodes is not None else "0,1"

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
            for name in (
                "partition",
                "account",
                "qos",
                "constraint",
                "job_name",
                "rollout_partition",
                "reward_partition",
            )
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
    """Refuse, before anything is submitted, what the partition (each component's, in a
    heterogeneous job) can never give."""
    parts = query_partitions()
    _check_component(parts, opts.nodes, opts.gpus_per_node, opts.partition, "")
    if opts.rollout_nodes is not None:
        partition = opts.rollout_partition or opts.partition
        _check_component(
            parts, opts.rollout_nodes, opts.rollout_gpus_per_node or opts.gpus_per_node, partition, "rollout-"
        )
    if opts.reward_nodes is not None:
        partition = opts.reward_partition or opts.partition
        _check_component(
            parts, opts.reward_nodes, opts.reward_gpus_per_node or opts.gpus_per_node, partition, "reward-"
        )


def _check_component(parts: dict[str, Partition], nodes: int, gpus: int, partition: str | None, flag: str) -> None:
    """One component's request against its partition; ``flag`` prefixes the options it names."""
    if nodes < 1:
        raise ConfigError(f"--{flag}nodes {nodes} must be at least 1", "ask for one node or more")
    if gpus < 1:
        raise ConfigError(f"--{flag}gpus-per-node {gpus} must be at least 1", "every group's engines need GPUs")
    key = partition or ""
    if key not in parts:
        names = ", ".join(sorted(p for p in parts if p))
        raise ConfigError(
            f"partition {partition!r} does not exist" if partition else "this cluster has no default partition",
            f"pass --{flag}partition with one of: {names}",
        )
    part = parts[key]
    if nodes > part.nodes:
        raise ConfigError(
            f"--{flag}nodes {nodes} but partition {part.name!r} has {part.nodes} nodes",
            f"ask for at most {part.nodes} nodes, or another partition",
        )
    if gpus > part.gpus_per_node:
        raise ConfigError(
            f"--{flag}gpus-per-node {gpus} but nodes in partition {part.name!r} have {part.gpus_per_node} GPUs",
            f"ask for at most {part.gpus_per_node} GPUs per node",
        )


class HetSlurmExecutor(submitit.SlurmExecutor):
    """submitit's SlurmExecutor for a heterogeneous job: the script submitit writes (component 0)
    plus the other components' ``#SBATCH`` lines (``rollout_component``)."""

    rollout: list[str] = []

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return with_component(super()._make_submission_file_text(command, uid), self.rollout)


class PreviewExecutor(HetSlurmExecutor):
    """submitit's SlurmExecutor without its check that ``srun`` exists: a dry run previews the
    sbatch script on a laptop, built by the same executor and parameters as a real submission."""

    @classmethod
    def affinity(cls) -> int:
        return 2  # what submitit's own affinity() answers where srun exists


def rollout_component(opts: SlurmOptions) -> list[str]:
    """The ``#SBATCH`` lines of a heterogeneous job's components after the first (none for a
    homogeneous job): the rollout's, then the reward model's when it has one; for each its nodes,
    GPUs and partition, and what each component needs for itself (one task per node, the time
    limit and its warning, --no-kill, account, QOS)."""
    if opts.rollout_nodes is None:
        return []
    components = [(opts.rollout_nodes, opts.rollout_gpus_per_node, opts.rollout_partition)]
    if opts.reward_nodes is not None:
        components.append((opts.reward_nodes, opts.reward_gpus_per_node, opts.reward_partition))
    return [line for nodes, gpus, partition in components for line in _component(opts, nodes, gpus, partition)]


def _component(opts: SlurmOptions, nodes: int, gpus: int | None, partition: str | None) -> list[str]:
    from submitit.slurm.slurm import _as_sbatch_flag

    params: dict[str, object] = {
        "nodes": nodes,
        "ntasks_per_node": 1,
        "gpus_per_node": gpus or opts.gpus_per_node,
        "time": opts.time_min,
        "signal": f"USR2@{opts.signal_grace_s}",  # measured: without it a preempted component is killed at once
        "no_kill": True,
    }
    for key in ("account", "qos", "cpus_per_task"):
        if getattr(opts, key) is not None:
            params[key] = getattr(opts, key)
    partition = partition or opts.partition
    if partition:
        params["partition"] = partition
    if opts.exclusive:
        params["exclusive"] = True
    return ["#SBATCH hetjob"] + [_as_sbatch_flag(k, v) for k, v in sorted(params.items())]


def with_component(script: str, lines: list[str]) -> str:
    """``script`` (submitit's) with ``lines`` after its last ``#SBATCH`` line."""
    if not lines:
        return script
    rows = script.split("\n")
    last = max(i for i, row in enumerate(rows) if row.startswith("#SBATCH "))
    return "\n".join([*rows[: last + 1], *lines, *rows[last + 1 :]])


def slurm_executor(
    run: RunDir, opts: SlurmOptions, preview: bool = False, folder: Path | None = None, max_parallel: int | None = None
) -> submitit.SlurmExecutor:
    """``folder``: submitit's files (default: the run dir's); ``max_parallel``: array tasks at once
    when several jobs are submitted together (``submit_array``: one Slurm job array)."""
    het = opts.rollout_nodes is not None
    kind = PreviewExecutor if preview else HetSlurmExecutor if het else submitit.SlurmExecutor
    executor = kind(folder=folder or run.submitit_dir, python=shlex.join(python_command()))  # python -P -u -m ...
    if isinstance(executor, HetSlurmExecutor):
        executor.rollout = rollout_component(opts)
    params = {
        "job_name": opts.job_name,
        "nodes": opts.nodes,
        "ntasks_per_node": 1,  # one task per node: Ray head or worker
        "gpus_per_node": opts.gpus_per_node,
        "time": opts.time_min,
        "signal_delay_s": opts.signal_grace_s,
        # --no-kill on the job and on submitit's srun step: a node that dies takes only its own
        # task with it (Slurm drops it from the allocation); the driver decides what that costs.
        "additional_parameters": {"requeue": True, "no_kill": True, **opts.extra},
        # One task per node of every component (het jobs); srun runs only component 0's otherwise.
        "srun_args": ["--no-kill", *([f"--het-group={opts.het_groups}"] if het else [])],
        "stderr_to_stdout": False,
    }
    for key in ("partition", "account", "qos", "constraint", "cpus_per_task"):
        if getattr(opts, key) is not None:
            params[key] = getattr(opts, key)
    if opts.exclusive:
        params["exclusive"] = True
    if max_parallel is not None:
        params["array_parallelism"] = max_parallel
    executor.update_parameters(**params)
    return executor


def own_job_id(default: str) -> str:
    """This job's id as Slurm's commands take it: ``77_3`` for task 3 of array 77 (its own
    ``SLURM_JOB_ID`` is another number, which submitit's ids never show), else SLURM_JOB_ID."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:
        return f"{array}_{task}"
    return os.environ.get("SLURM_JOB_ID", default)


def het_group(rank: int) -> int | None:
    """This task's component in a heterogeneous job step, None outside one. srun numbers the
    tasks of a het step globally, component 0's first, then 1's, then 2's (measured on Slurm 22.05)."""
    size = os.environ.get("SLURM_HET_SIZE")
    if not size:
        return None
    first = 0
    for group in range(int(size) - 1):
        first += int(os.environ.get(f"SLURM_NTASKS_HET_GROUP_{group}", "0"))
        if rank < first:
            return group
    return int(size) - 1


def sbatch_script(executor: submitit.SlurmExecutor, array: int | None = None) -> str:
    """The script submitit would hand to sbatch (its own builder, so preview and reality agree);
    ``array``: as a job array of that many tasks."""
    from submitit.slurm.slurm import _make_sbatch_string

    params = {**executor.parameters, **({"map_count": array} if array else {})}
    script = _make_sbatch_string(command=executor._submitit_command_str, folder=executor.folder, **params)
    return with_component(script, getattr(executor, "rollout", []))


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


class SlurmUnreachable(OSError):
    """slurmctld did not answer (busy, restarting, network): the job's state is unknown, not gone."""


def job_state(job_id: str, attempts: int = 4) -> str | None:
    """The job's state from ``scontrol`` (which needs no accounting database), None once Slurm
    has forgotten it ("Invalid job id"). A controller that does not answer is asked again, then
    raises ``SlurmUnreachable``: taking "could not ask" for "gone" would let a second job take
    over a live run dir."""
    for attempt in range(attempts):
        try:
            out = _run(["scontrol", "show", "job", job_id, "-o"], timeout=30)
        except subprocess.TimeoutExpired:
            problem = "scontrol timed out"
        else:
            if out.returncode == 0 and out.stdout.strip():
                return _fields(out.stdout).get("JobState")
            if "invalid job id" in out.stderr.lower():
                return None
            problem = out.stderr.strip() or f"scontrol exit status {out.returncode}"
        if attempt + 1 < attempts:
            time.sleep(2**attempt)
    raise SlurmUnreachable(f"state of job {job_id} unknown: {problem}")


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


# ---------------------------------------------------------------- node loss


def node_state(node: str) -> str | None:
    """``State=`` of a node (e.g. ``IDLE``, ``MIXED``, ``DOWN*``), None when scontrol cannot say."""
    try:
        out = _run(["scontrol", "show", "node", node, "-o"], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    return _fields(out.stdout).get("State") if out.returncode == 0 else None


def node_unusable(state: str | None) -> bool:
    """Slurm will not give this node to a job: DOWN/DRAIN/FAIL, or not responding (``*``)."""
    if not state:
        return False
    flags = set(state.rstrip("*~#%$@^!-").split("+"))
    return state.endswith("*") or bool(flags & {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING"})


def hostnames(nodelist: str) -> list[str]:
    """``node[0-2]`` -> ["node0", "node1", "node2"] (``scontrol show hostnames``)."""
    if not nodelist or nodelist == "(null)":
        return []
    out = _run(["scontrol", "show", "hostnames", nodelist], timeout=30)
    return out.stdout.split() if out.returncode == 0 else []


def job_components(job_id: str) -> list[dict[str, str]]:
    """``scontrol show job`` of a heterogeneous job, one dict per component (one for any other job)."""
    try:
        out = _run(["scontrol", "show", "job", job_id, "-o"], timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    return [_fields(line) for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def job_nodes(job_id: str) -> set[str] | None:
    """The nodes the job holds now, of every component; None when Slurm cannot say. Slurm drops a
    node that went DOWN from a ``--no-kill`` job, and it stays out when it comes back."""
    parts = job_components(job_id)
    if not parts:
        return None
    return {host for part in parts for host in hostnames(part.get("NodeList", ""))}


def submit_worker(
    job_id: str,
    lost: str,
    name: str,
    gpus_per_node: int,
    command: list[str],
    log_file: str,
    env: dict[str, str],
    group: int | None = None,
) -> str:
    """A one-node job that runs ``command`` (a Ray worker joining job ``job_id``'s cluster) in the
    partition, account and QOS of job ``job_id`` (of its component ``group``, in a heterogeneous
    job), on a node it does not hold: a replacement for the node ``lost``. Its job id."""

    components = job_components(job_id)
    info = components[group or 0] if len(components) > (group or 0) else {}
    cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks=1", f"--job-name={name}", f"--output={log_file}"]
    cmd += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    for key, option in (("Partition", "partition"), ("Account", "account"), ("QOS", "qos")):
        if info.get(key) and info[key] != "(null)":
            cmd.append(f"--{option}={info[key]}")
    # Not on a node the job still holds (its GPUs are taken, and one Ray node per host); the lost
    # node may still be listed until Slurm marks it DOWN, and is welcome back.
    held = [n for c in components for n in hostnames(c.get("NodeList", "")) if n != lost]
    if held:
        cmd.append(f"--exclude={','.join(held)}")
    cmd.append("--wrap=exec " + shlex.join(command))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"sbatch of a replacement worker failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0]


def set_num_nodes(job_id: str, num_nodes: int) -> str | None:
    """``scontrol update NumNodes``: Slurm shrinks a --no-kill job that lost a node (measured: a
    3-node job requeued after a loss pends as a 2-node job); once requeued it must ask for all its
    nodes again. Slurm's refusal as text, None when it accepted."""
    out = _run(["scontrol", "update", f"JobId={job_id}", f"NumNodes={num_nodes}"], timeout=60)
    return (out.stderr.strip() or f"exit status {out.returncode}") if out.returncode else None


def cancel(job_id: str) -> None:
    """``scancel``; a job that is already gone is not an error."""
    _run(["scancel", job_id], timeout=60)
