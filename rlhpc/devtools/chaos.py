#!/usr/bin/env python3
"""Fault-injection soak: short deterministic runs, each hit by one fault, checked at the end.

    python tools/chaos.py --trials 30                       # local kinds, round robin
    python tools/chaos.py --trials 6 --cluster slurm        # requeue, preemption, node kill on the minicluster
    python tools/chaos.py --kinds rank_kill --layouts dp4 --seed 1007 --trials 1   # replay one trial

Each trial starts a short deterministic run through jobs/submit.py, waits for a seeded random
moment (after rollout K is logged, plus a share of a step), injects one fault, lets the run finish
(resubmitting where the fault ends the job, as a user or Slurm would), and checks it with
``rlhpc.invariants.violations`` against an undisturbed run of the same config, made once per
config. Every kind is tried on each actor layout (``LAYOUTS``: one training rank, and four
data-parallel ranks, whose gradient sums depend on the order they are added in): trial i takes
kind ``i mod K`` on layout ``(i div K) mod L``. While the job runs, its engines are asked to
generate without the engine key and must refuse. Trial i uses seed ``--seed + i``: ``--seed S --kinds KIND --layouts L --trials 1``
replays it.

The attacker kinds (``ready_swap``, ``stage_plant``, ``conn_flood``, ``bad_pickle``,
``huge_request``: issue 32; ``stage_link``, ``keepalive_flood``, ``header_flood``,
``store_probe``, ``cwd_plant``, ``ray_probe``, ``hostile_dump``: issue 43) are another user of
the node, uid 65534 via ``setpriv`` (``rlhpc.devtools.attacks``), attacking the job once an
engine is up (or, for some, planting before it starts): the run must still end as the
undisturbed one, and no engine key of the job may reach that user (every key the job used is
looked for in all it received or read).
Prints one line per trial, survived / tried per kind, then one JSON line
``{"tried": N, "survived": M, "by_kind": {...}, "by_layout": {...}}``. Needs root for ``full_disk`` (a tmpfs)
and the attacker kinds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from rlhpc.devtools import attacks
from rlhpc.devtools.minicluster import MiniCluster
from rlhpc.invariants import processes_using, violations
from rlhpc.metrics import read_metrics
from rlhpc.run_dir import RunDir
from rlhpc.util.processes import kill_groups, process_groups, python_command

# The checkout this module lies in: the soak submits through its jobs/submit.py.
REPO = Path(__file__).resolve().parents[2]

NUM_ROLLOUT = 8
EVAL_INTERVAL = 4
# A tiny model on CPU, deterministic: an interrupted run must end bit for bit where this ends.
CONFIG = (
    "data.num_train=64",
    "rollout.rollout_batch_size=8",
    "rollout.n_samples_per_prompt=4",
    f"rollout.num_rollout={NUM_ROLLOUT}",
    "logging.wandb_mode=disabled",
    "deterministic=true",
    "checkpoint.save_interval=3",  # a kill loses up to 2 rollouts, recomputed at resume
    f"eval.interval={EVAL_INTERVAL}",
    "eval.max_new_tokens=16",
)
# Evaluation rows (data.num_eval), per kind (Kind.num_eval): long evaluations, for a stop to land
# inside one and for the faults that take seconds to act (an attack, a second submission, Slurm's
# preemption) to find the job still running; fewer where a kill acts at once (256 rows were a
# quarter of such a run; 64 still score some answers right, so equal eval metrics still say something).
LONG_EVAL = 256
SHORT_EVAL = 64
SLURM_NODES = ("node0", "node1", "node2", "node3")
# node_kill: the head (driver, actor rank 0) on node1; where the rest lies is the layout's.
NODE_KILL_NODES = "node[1-3]"


@dataclass(frozen=True)
class ActorLayout:
    """The submit options that give a trial its actor layout, per way of running it."""

    local: tuple[str, ...]
    slurm: tuple[str, ...]  # on one minicluster node
    node_kill: tuple[str, ...]  # over NODE_KILL_NODES, the head (rank 0) on node1


def _split(actor: int, rollout: int) -> tuple[str, ...]:
    return ("--set", f"cluster.actor_num_gpus={actor}", "--set", f"cluster.rollout_num_gpus={rollout}")


# The embedded default's batch: with CONFIG's 8 x 4 samples most groups score all 0 (a zero
# gradient), so rarely more than two ranks add non-zero terms and a summation order cannot show.
_WIDE = ("--set", "rollout.rollout_batch_size=32", "--set", "rollout.n_samples_per_prompt=8")


LAYOUTS = {
    # one rank and one engine (the embedded default's split)
    "1rank": ActorLayout(
        local=(),
        slurm=("--nodes", "1", "--gpus-per-node", "2"),
        node_kill=("--nodes", "3", "--gpus-per-node", "1", *_split(1, 2)),
    ),
    # four data-parallel ranks, on a wider batch; under node_kill ranks 0-1 on the head, 2-3 on
    # node2, both engines on node3
    "dp4": ActorLayout(
        local=("--set", "cluster.gpus_per_node=5", *_split(4, 1), *_WIDE),
        slurm=("--nodes", "1", "--gpus-per-node", "5", *_split(4, 1), *_WIDE),
        node_kill=("--nodes", "3", "--gpus-per-node", "2", *_split(4, 2), *_WIDE),
    ),
}
NODE_KILL_TARGETS = ("node3", "node1")  # an engine node (the run goes on) or the head (the job requeues)
JOB_TIMEOUT_S = 900
DISK_MB = 64  # the tmpfs a full_disk trial runs in: the run needs a few MB


class TrialError(Exception):
    """The trial itself could not be carried out (not a violation by the run)."""


# ---------------------------------------------------------------------------- jobs


def submit_command(
    run: Path, cluster: str, layout: str, *extra: str, num_eval: int = LONG_EVAL, node_kill: bool = False
) -> list[str]:
    cmd = [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", cluster, "--run-dir", str(run)]
    for o in (*CONFIG, f"data.num_eval={num_eval}"):
        cmd += ["--set", o]
    lay = LAYOUTS[layout]  # after CONFIG: its --set values win
    if cluster == "slurm":
        cmd += [*(lay.node_kill if node_kill else lay.slurm), *extra, "--no-follow"]
    else:
        cmd += [*lay.local, *extra]
    return cmd


def env() -> dict[str, str]:
    # no empty entry: one is the working dir, which a trial may make another user's (cwd_plant)
    path = [p for p in (str(REPO), *os.environ.get("PYTHONPATH", "").split(os.pathsep)) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def start(cmd: list[str], log: Path, cwd: Path = REPO) -> subprocess.Popen:
    """A job in a session of its own (as from a terminal), submitted from ``cwd``, output appended to ``log``."""
    with log.open("a") as out:
        return subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env())


def trained(run: Path) -> list[int]:
    try:
        return [r["rollout_id"] for r in read_metrics(run) if r["kind"] == "rollout"]
    except Exception:  # noqa: BLE001 - mid-write or damaged on purpose: not yet
        return []


def wait_for(cond: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise TrialError(f"the job ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise TrialError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.05)


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            except (OSError, IndexError, ValueError):
                continue
            out[int(entry.name)] = (ppid, args)
    return out


def task_pid(run: Path) -> int:
    """The job's task process (where the driver runs; what Slurm signals)."""
    marker = f"submitit.core._submit {run}/logs/submitit"
    pids = [pid for pid, (_, args) in processes().items() if marker in args]
    if len(pids) != 1:
        raise TrialError(f"expected one task process of {run}, found {pids}")
    return pids[0]


def descendants(root: int) -> dict[int, str]:
    procs = processes()
    family = {root}
    for _ in range(8):
        family |= {pid for pid, (ppid, _) in procs.items() if ppid in family}
    return {pid: procs[pid][1] for pid in family if pid in procs}


def one_of(run: Path, prefix: str) -> int:
    found = [pid for pid, args in descendants(task_pid(run)).items() if args.startswith(prefix) or prefix in args]
    if not found:
        raise TrialError(f"no process {prefix!r} in the job")
    return found[0]


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the submission and its job (whose controller leads a session of its own)."""
    kill_groups(process_groups(proc.pid))
    proc.wait()


def job_id(run: Path) -> str:
    return RunDir(run).read_job_id() or ""


# ---------------------------------------------------------------------------- engine key probe


def engine_probe(run: Path) -> list[str]:
    """Ask each live engine of the job to generate without the key, and with a wrong one: both must get 401."""
    problems = []
    for pid, args in descendants(task_pid(run)).items():
        if "rlhpc.engine_server.cpu" not in args or "--ready-file" not in args:
            continue
        ready = Path(args.split("--ready-file", 1)[1].split()[0])
        try:
            info = json.loads(ready.read_text())
        except (OSError, ValueError):
            continue  # starting or restarting
        url = f"http://{info['host']}:{info['port']}/generate"
        for headers in ({}, {"Authorization": "Bearer not-the-key"}):
            body = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}).encode()
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **headers})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    problems.append(
                        f"engine pid {pid} at {url} answered {r.status} to a caller {headers or 'without key'}"
                    )
            except urllib.error.HTTPError as e:
                if e.code != 401:
                    problems.append(f"engine pid {pid} at {url} answered {e.code}, not 401, without the key")
            except OSError:
                pass  # it died meanwhile: nobody can call it
    return problems


# ---------------------------------------------------------------------------- trials


@dataclass
class Trial:
    index: int
    kind: str
    seed: int
    after_rollout: int  # the fault lands once this rollout is logged ...
    step_fraction: float  # ... plus this share of the undisturbed run's mean step (so it lands in the run)
    node: str = "node0"  # slurm: where the job runs
    layout: str = "1rank"  # a key of LAYOUTS

    def describe(self) -> str:
        where = f" node={self.node}" if self.kind == "node_kill" else ""
        moment = (
            "an engine up"
            if KINDS[self.kind].attacker
            else f"rollout {self.after_rollout} +{self.step_fraction:.2f} step"
        )
        return f"trial {self.index} kind={self.kind} layout={self.layout}{where} seed={self.seed} moment={moment}"


@dataclass
class Outcome:
    trial: Trial
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what an attack tried, and what it got

    @property
    def survived(self) -> bool:
        return not self.problems


@dataclass
class Context:
    trial: Trial
    run: Path
    cluster: str
    log: Path
    proc: subprocess.Popen | None = None
    problems: list[str] = field(default_factory=list)
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    after: list[Callable[[], None]] = field(default_factory=list)  # once the run finished, before the checks
    stage_dir: Path | None = None  # cluster.stage_dir, shared with other users as /tmp is
    cwd: Path = REPO  # where the job is submitted from
    keys: set[str] = field(default_factory=set)  # every engine key the job used while attacked
    notes: list[str] = field(default_factory=list)
    step_s: float = 0.5  # seconds per rollout of the undisturbed run

    def command(self) -> list[str]:
        layout, rows = self.trial.layout, KINDS[self.trial.kind].num_eval
        if self.cluster == "local":
            extra = ("--set", f"cluster.stage_dir={self.stage_dir}") if self.stage_dir else ()
            return submit_command(self.run, self.cluster, layout, *extra, num_eval=rows)
        if self.trial.kind == "node_kill":
            extra = ("--partition", "low", "--sbatch", f"nodelist={NODE_KILL_NODES}")
            return submit_command(self.run, self.cluster, layout, *extra, num_eval=rows, node_kill=True)
        extra = ("--partition", "low", "--sbatch", f"nodelist={self.trial.node}")
        return submit_command(self.run, self.cluster, layout, *extra, num_eval=rows)


# Each fault acts once the moment has come. It returns True when it ends the job for good
# (the run then has to be submitted again); False when the job must finish by itself.


def kill_engine(c: Context) -> bool:
    os.kill(one_of(c.run, "rlhpc.engine_server.cpu"), signal.SIGKILL)
    return False  # the engine pool restarts it


def kill_rank(c: Context) -> bool:
    os.kill(one_of(c.run, "ray::TrainWorker"), signal.SIGKILL)
    return False  # the job requeues itself


def kill_driver(c: Context) -> bool:
    os.kill(task_pid(c.run), signal.SIGKILL)
    return True  # nothing left to requeue it: a node crash, a kill -9


def stop_in_eval(c: Context) -> bool:
    os.kill(task_pid(c.run), signal.SIGUSR2)  # the moment is right before an evaluation
    return False


def tear_metrics(c: Context) -> bool:
    """Kill the whole job mid-run, and leave half a metrics line behind, as a kill mid-write does."""
    assert c.proc is not None
    kill_session(c.proc)
    metrics = RunDir(c.run).metrics_file
    last = metrics.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    with metrics.open("ab") as f:
        f.write(last[: len(last) // 2])
    return True


def fill_disk(c: Context) -> bool:
    """Fill the file system under the run dir; give the space back once the job tripped over it."""
    ballast = c.run.parent / "ballast"
    restarts = RunDir(c.run).restarts_file
    before = restarts.stat().st_size if restarts.exists() else 0
    with ballast.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    assert c.proc is not None
    try:  # the job fails on its next write (metrics, checkpoint), then ends or restarts
        wait_for(
            lambda: c.proc.poll() is not None or (restarts.exists() and restarts.stat().st_size != before),
            120,
            "the job to notice the full disk",
        )
    except TrialError:
        pass  # it wrote nothing meanwhile: still a full disk it lived through
    ballast.unlink()
    return False  # whether it ends or carries on, the runner resubmits if it ended unfinished


def second_submission(c: Context) -> bool:
    p = subprocess.run(c.command(), cwd=REPO, capture_output=True, text=True, timeout=300, env=env())
    said = " ".join((p.stdout + p.stderr).split())
    if p.returncode == 0:  # refused: the live job named, or (a fast run) the run already finished
        c.problems.append(
            f"a second submission to the live run dir was not refused (exit {p.returncode}): {said[-300:]}"
        )
    return False


def scontrol_requeue(c: Context) -> bool:
    subprocess.run(["scontrol", "requeue", job_id(c.run)], check=True, capture_output=True)
    return False


def preempt(c: Context) -> bool:
    subprocess.run(
        ["sbatch", "-p", "high", "-w", c.trial.node, "--gpus-per-node=8", "-o", "/dev/null", "--wrap", "sleep 2"],
        check=True,
        capture_output=True,
    )
    return False


def minicluster() -> MiniCluster:
    """The minicluster that SLURM_CONF names (its state dir holds slurm.conf)."""
    return MiniCluster.attach(Path(os.environ["SLURM_CONF"]).parent)


def kill_node(c: Context) -> bool:
    """Power loss of one of the job's nodes; it comes back once Slurm has marked it DOWN, as a
    rebooted node would (sooner, Slurm takes it for a slurmd restart and aborts the step)."""
    cluster, node = minicluster(), c.trial.node
    cluster.kill_node(node)
    c.cleanup.append(lambda: cluster.revive_node(node))  # if the revive below is cut short
    cluster.revive_node(node)
    return False  # an engine node: the run goes on; the head: the job requeues itself


# ---------------------------------------------------------------------------- attacker kinds
# Another user of the node (rlhpc.devtools.attacks, run as uid 65534) attacks the live job; the
# run must still end as the undisturbed one, and no engine key may reach that user.


def engine(c: Context) -> tuple[int, Path, str]:
    """A live engine server of the job: its pid, ready file and URL."""
    for pid, args in descendants(task_pid(c.run)).items():
        if "rlhpc.engine_server.cpu" in args and "--ready-file" in args:
            ready = Path(args.split("--ready-file", 1)[1].split()[0])
            try:
                info = json.loads(ready.read_text())
            except (OSError, ValueError):
                continue  # starting
            return pid, ready, f"http://{info['host']}:{info['port']}"
    raise TrialError("no engine of the job is up")


def engine_up(c: Context) -> bool:
    try:
        engine(c)
        return True
    except TrialError:
        return False


def note_key(c: Context) -> str:
    """The job's engine key now (rewritten at every start of the job)."""
    try:
        key = RunDir(c.run).engine_key.read_text().strip()
    except FileNotFoundError:
        return ""
    c.keys.add(key)
    return key


def judge(c: Context, kind: str, record: dict) -> None:
    note_key(c)
    c.problems += attacks.findings(kind, record, c.keys)
    tried = {**record["steps"], **record.get("answers", {}), **record.get("stores", {}), **record.get("metrics", {})}
    got = f"{len(record['received'])} messages received" if "received" in record else ""
    counts = {
        k: record[k]
        for k in ("opened", "closed_by_engine", "answered", "half_sent_closed", "half_sent_held_s", "accepted_bytes")
        if k in record
    }
    c.notes.append(f"{kind} as uid {attacks.UID}: {tried} {counts or ''} {got}; keys checked: {len(c.keys)}")


def swap_ready_file(c: Context) -> bool:
    """The other user tries to swap the engine's dir for one whose ready file names its own port,
    while the engine restarts (when its ready file is read); it listens there for the key."""
    pid, ready, _ = engine(c)
    note_key(c)
    attack = attacks.Attack.start("ready_swap", str(ready.parent), str(pid))
    c.cleanup.append(lambda: attack.proc.poll() is None and attack.proc.kill())
    time.sleep(0.5)  # at work before the restart
    os.kill(pid, signal.SIGKILL)

    def restarted() -> bool:
        try:
            return engine(c)[0] != pid
        except TrialError:
            return False

    try:
        wait_for(restarted, 300, "the engine's restart", c.proc)
        time.sleep(1.0)  # the job's first calls to the restarted engine
    except TrialError:
        if c.proc is None or c.proc.poll() is None:
            raise
        # the job ended first: it had no more need of that engine
    judge(c, "ready_swap", attack.finish())
    return False


def plant_stage(c: Context) -> bool:
    """The other user plants a copy where the job stages its model, the moment that name is free
    (a restart of the job removes its copy and stages again under the same job id)."""
    assert c.stage_dir is not None
    roots = [p for p in c.stage_dir.glob("rlhpc-*") if p.is_dir()]
    if len(roots) != 1:
        raise TrialError(f"expected the job's one stage root in {c.stage_dir}, found {roots}")
    note_key(c)
    attack = attacks.Attack.start("stage_plant", str(roots[0]))
    c.cleanup.append(lambda: attack.proc.poll() is None and attack.proc.kill())
    attack.wait_for_first_steps()  # it tried the stage root and waits for the name: free it now
    os.kill(one_of(c.run, "ray::TrainWorker"), signal.SIGKILL)  # the job requeues itself

    def check() -> None:
        record = attack.finish()
        judge(c, "stage_plant", record)
        if record["steps"].get("plant a copy where the job stages") != "done":
            c.problems.append("trial not carried out: the other user never found the stage root free")
        elif "of uid 65534" not in c.log.read_text(errors="replace"):
            c.problems.append("stage_plant: the job's log does not name the planted copy's owner (was it refused?)")

    c.after.append(check)
    return False  # a start that finds the planted copy refuses it and ends: the runner resubmits


def plant_links(c: Context) -> None:
    """Before the job starts: the other user plants links (one dangling, two to a dir and a file
    of the job's user) and a dir of its own, named as other jobs' stage roots, in the shared stage
    dir; the job's sweep of what its user's ended jobs left must neither follow nor fail on them."""
    assert c.stage_dir is not None
    canary = c.run.parent / "canary"
    canary.mkdir(parents=True)
    (canary / "keep").write_text("kept")
    record = attacks.run("stage_link", str(c.stage_dir), str(canary))
    if set(record["steps"].values()) != {"done"}:
        raise TrialError(f"the other user could not plant its names: {record['steps']}")

    def check() -> None:
        left = sorted(p.name for p in c.stage_dir.iterdir() if p.name in attacks.STAGE_LINK_NAMES)
        if left != sorted(attacks.STAGE_LINK_NAMES):
            c.problems.append(f"stage_link: the other user's names were removed: only {left} are left")
        if not (canary / "keep").is_file():
            c.problems.append("stage_link: the job removed its user's file through the other user's link")
        c.notes.append(f"stage_link as uid {attacks.UID}: {record['steps']}")

    c.after.append(check)


def staged_with_links(c: Context) -> bool:
    return False  # planted before the start (plant_links): the job must stage and run past them


def flood_connections(c: Context) -> bool:
    """The other user holds 400 half-sent requests open to an engine for 5 s (the start of the run)."""
    record = _flood(c, "conn_flood", 400, 5.0)
    if record.get("opened", 0) < 400:
        c.problems.append(f"trial not carried out: the flood opened {record.get('opened')} connections, not 400")
    return False


def flood_kept_alive(c: Context) -> bool:
    """The other user holds 600 connections to an engine (past its cap of 512), each after one
    complete keyless GET /health, every other one with half of a second request, for 20 s (past
    the engine's 10 s deadline for a request's headers)."""
    record = _flood(c, "keepalive_flood", 600, 20.0)
    if record.get("answered", 0) < 600:
        c.problems.append(f"trial not carried out: {record.get('answered')} first requests answered, not 600")
    return False


def _flood(c: Context, kind: str, connections: int, hold_s: float) -> dict:
    """Run the other user's ``kind`` attack on an engine with ``connections`` for ``hold_s``
    while the job trains on; judged, and its record returned."""
    _, _, url = engine(c)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    note_key(c)
    attack = attacks.Attack.start(kind, host, port, str(connections))
    c.cleanup.append(lambda: attack.proc.poll() is None and attack.proc.kill())
    time.sleep(hold_s)
    record = attack.finish()
    judge(c, kind, record)
    return record


def flood_headers(c: Context) -> bool:
    """The other user sends header lines without end on four connections to an engine."""
    _, _, url = engine(c)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    note_key(c)
    judge(c, "header_flood", attacks.run("header_flood", host, port))
    return False


def probe_stores(c: Context) -> bool:
    """The other user speaks torch's TCPStore protocol (set a key, read it back; torch has no key)
    to every port the job's training ranks listen on, once they trained (their group formed)."""
    note_key(c)
    wait_for(lambda: bool(trained(c.run)), 300, "the first rollout trained", c.proc)
    ranks = [pid for pid, args in descendants(task_pid(c.run)).items() if args.startswith("ray::TrainWorker")]
    if not ranks:
        raise TrialError("no training rank of the job is up")
    judge(c, "store_probe", attacks.run("store_probe", *attacks.listening(ranks)))
    return False


def plant_modules(c: Context) -> None:
    """Before the job starts: the job is submitted from a dir others can write (as /tmp), where the
    other user planted modules the driver, the engine servers and Ray's workers import; each one
    notes it ran, then hands over to the real module. No process of the job may run one."""
    c.cwd = Path(tempfile.mkdtemp(prefix="rlhpc-chaos-cwd-"))
    c.cwd.chmod(0o1777)
    c.cleanup.append(lambda: shutil.rmtree(c.cwd, ignore_errors=True))
    record = attacks.run("cwd_plant", str(c.cwd), *attacks.CWD_PLANT_NAMES)
    if set(record["steps"].values()) != {"done"}:
        raise TrialError(f"the other user could not plant its modules: {record['steps']}")

    def check() -> None:
        if ran := (c.cwd / "ran").read_text():
            c.problems.append(f"cwd_plant: the job ran the other user's code: {ran[:500]}")
        c.notes.append(f"cwd_plant as uid {attacks.UID}: {record['steps']}")

    c.after.append(check)


def submitted_from_a_shared_dir(c: Context) -> bool:
    return False  # planted before the start (plant_modules): the job must run past them


def squat_ray_dir(c: Context) -> None:
    """Before the job starts: the other user makes the local Ray dir's old name (it was derived
    from the run dir's path, which ``ps`` shows), as a squatter blocking the run would."""
    digest = hashlib.sha256(str(c.run.resolve()).encode()).hexdigest()[:12]
    squat = Path(tempfile.gettempdir()) / f"rlhpc-ray-{digest}"
    record = attacks.run("ray_squat", str(squat))
    c.cleanup.append(lambda: shutil.rmtree(squat, ignore_errors=True))
    if record["steps"].get("make the local Ray dir's old name") != "done":
        raise TrialError(f"the other user could not squat {squat}: {record['steps']}")


# Ray's fixed defaults, which every job on a node would share: the dashboard's and the
# autoscaler's Prometheus ports, the dashboard's, the GCS's and the client server's
RAY_FIXED_PORTS = frozenset({44227, 44217, 8265, 6379, 10001})


def probe_ray(c: Context) -> bool:
    """The other user asks every port the job's Ray listens on for Prometheus metrics (they take
    no token); none may be one of Ray's fixed ports, and nothing it gets may hold a key of the job
    (the engine key, the job's Ray token)."""
    note_key(c)
    ray_procs = [
        pid
        for pid, args in descendants(task_pid(c.run)).items()
        if args.startswith("ray::") or "/ray/" in args or "gcs_server" in args or "raylet" in args
    ]
    ports = attacks.listening(ray_procs)
    token = RunDir(c.run).ray_state(job_id(c.run), 0).token
    if token.is_file():
        c.keys.add(token.read_text().strip())
    if fixed := {int(p.rsplit(":", 1)[1]) for p in ports} & RAY_FIXED_PORTS:
        c.problems.append(f"ray_probe: the job's Ray listens on Ray's fixed ports {sorted(fixed)}")
    judge(c, "ray_probe", attacks.run("ray_probe", *ports))
    return False


def show_hostile_dumps(c: Context) -> bool:
    """While the run goes on, the job's user runs rlhpc-show-rollout on dumps the other user
    planted (``attacks.plant_dumps``): an external dataset, a virtual one and an external link
    onto a 0600 file of the job's user, 10^8 values declared in a few KB, a compressed dataset,
    and escapes in every text. Each is refused (escapes: shown escaped), nothing of that file or
    a control character reaches the terminal, and no reader grows 200 MB past the plain one."""
    where = Path(tempfile.mkdtemp(prefix="rlhpc-chaos-dumps-"))
    c.cleanup.append(lambda: shutil.rmtree(where, ignore_errors=True))
    secret = where / "secret"
    secret.write_text(f"secret of {c.run}".ljust(64))
    secret.chmod(0o600)
    codes, peaks = {}, {}
    for kind, dump in attacks.plant_dumps(where, secret).items():
        proc = subprocess.Popen(
            python_command(str(REPO / "tools" / "show_rollout.py"), str(dump)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
        )  # fmt: skip
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        codes[kind], peaks[kind] = os.waitstatus_to_exitcode(status), usage.ru_maxrss / 1024
        if codes[kind] != (0 if kind == "escapes" else 1):
            c.problems.append(f"hostile_dump: rlhpc-show-rollout on the {kind} dump exited {codes[kind]}: {out[-300:]}")
        if secret.read_text().strip() in out or not all(ch.isprintable() for ch in out.replace("\n", "")):
            c.problems.append(f"hostile_dump: the {kind} dump put the job user's file or escapes out: {out[-300:]!r}")
    c.problems += [
        f"hostile_dump: reading the {kind} dump took {mb:.0f} MB, the plain one {peaks['escapes']:.0f} MB"
        for kind, mb in peaks.items()
        if mb > peaks["escapes"] + 200
    ]
    c.notes.append(f"hostile_dump planted as uid {attacks.UID}: exit codes {codes}")
    return False


def send_bad_pickle(c: Context) -> bool:
    """The other user sends pickles that would set state on, or call, what they name to the
    weight-update routes (the key holder's variant: tests/integration/test_attacks.py)."""
    _, _, url = engine(c)
    judge(c, "bad_pickle", attacks.run("bad_pickle", url))
    return False


def send_huge_requests(c: Context) -> bool:
    """Generations no engine could serve, and bodies none could parse: from the other user
    (401), and from a holder of the key (400); the engine serves on."""
    pid, _, url = engine(c)
    keyed = attacks.keyed_bad_requests(url, note_key(c))  # first: the run may end within seconds
    if keyed and not psutil.pid_exists(pid) and c.proc is not None:
        try:  # the run may have finished meanwhile and stopped its engine (SIGTERM): no finding
            c.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        if c.proc.poll() is not None and RunDir(c.run).is_finished():
            raise TrialError(f"the run finished before the bad bodies were all sent: {keyed[0]}")
    c.problems += keyed
    judge(c, "huge_request", attacks.run("huge_request", url))
    return False


@dataclass(frozen=True)
class Kind:
    inject: Callable[[Context], bool]
    cluster: str  # local or slurm
    must_finish_alone: bool  # the job itself must reach FINISHED (no resubmission)
    needs_eval_moment: bool = False
    needs_tmpfs: bool = False
    attacker: bool = False  # needs the second user (root, setpriv); acts once an engine is up
    needs_stage_dir: bool = False
    before_start: Callable[[Context], None] | None = None  # acts before the job is submitted
    instant: bool = False  # a kill: it acts the moment it is injected

    @property
    def num_eval(self) -> int:
        return SHORT_EVAL if self.instant else LONG_EVAL


KINDS: dict[str, Kind] = {
    "engine_kill": Kind(kill_engine, "local", True, instant=True),
    "rank_kill": Kind(kill_rank, "local", True, instant=True),
    "driver_kill": Kind(kill_driver, "local", False, instant=True),
    "eval_stop": Kind(stop_in_eval, "local", True, needs_eval_moment=True),
    "full_disk": Kind(fill_disk, "local", False, needs_tmpfs=True),
    "torn_metrics": Kind(tear_metrics, "local", False, instant=True),
    "second_submission": Kind(second_submission, "local", True),
    "ready_swap": Kind(swap_ready_file, "local", True, attacker=True),
    "stage_plant": Kind(plant_stage, "local", False, attacker=True, needs_stage_dir=True),
    "stage_link": Kind(staged_with_links, "local", True, attacker=True, needs_stage_dir=True, before_start=plant_links),
    "conn_flood": Kind(flood_connections, "local", True, attacker=True),
    "keepalive_flood": Kind(flood_kept_alive, "local", True, attacker=True),
    "header_flood": Kind(flood_headers, "local", True, attacker=True),
    "store_probe": Kind(probe_stores, "local", True, attacker=True),
    "cwd_plant": Kind(submitted_from_a_shared_dir, "local", True, attacker=True, before_start=plant_modules),
    "ray_probe": Kind(probe_ray, "local", True, attacker=True, before_start=squat_ray_dir),
    "hostile_dump": Kind(show_hostile_dumps, "local", True, attacker=True),
    "bad_pickle": Kind(send_bad_pickle, "local", True, attacker=True),
    "huge_request": Kind(send_huge_requests, "local", True, attacker=True),
    "scontrol_requeue": Kind(scontrol_requeue, "slurm", True),
    "preemption": Kind(preempt, "slurm", True),
    "node_kill": Kind(kill_node, "slurm", True),
}
LOCAL_KINDS = [k for k, v in KINDS.items() if v.cluster == "local"]
SLURM_KINDS = [k for k, v in KINDS.items() if v.cluster == "slurm"]


def plan(index: int, kind: str, seed: int, layout: str = "1rank") -> Trial:
    """The trial's moment, a pure function of its seed."""
    rng = random.Random(seed)
    if KINDS[kind].needs_eval_moment:  # right after a rollout that an evaluation follows
        after = rng.choice([r for r in range(EVAL_INTERVAL - 1, NUM_ROLLOUT - 1, EVAL_INTERVAL)])
        fraction = 0.0
    else:
        after, fraction = rng.randint(0, NUM_ROLLOUT - 3), round(rng.uniform(0, 1.5), 2)
    node = rng.choice(NODE_KILL_TARGETS) if kind == "node_kill" else SLURM_NODES[index % len(SLURM_NODES)]
    return Trial(index, kind, seed, after, fraction, node=node, layout=layout)


def mean_step_s(reference: Path) -> float:
    """Seconds per rollout of the undisturbed run: a moment is placed in steps, not seconds, so
    it lands inside the run on a fast machine as on a slow one."""
    steps = [r["time/step"] for r in read_metrics(reference) if r["kind"] == "rollout" and "time/step" in r]
    return sum(steps) / len(steps) if steps else 0.5


def mount_tmpfs(where: Path, mb: int) -> Callable[[], None]:
    where.mkdir(parents=True, exist_ok=True)
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(where)], capture_output=True, text=True
    )
    if p.returncode != 0:
        raise TrialError(f"full_disk needs a tmpfs (root): mount said {p.stderr.strip()}")
    return lambda: subprocess.run(["umount", "-l", str(where)], check=False)


def wait_finished(c: Context, timeout: float) -> None:
    """Local: the job process ends; Slurm: FINISHED appears (the job requeues itself meanwhile)."""
    assert c.proc is not None
    if c.cluster == "local":
        try:
            c.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise TrialError(f"the job did not end within {timeout:.0f} s") from e
    else:
        c.proc.wait(timeout=300)  # sbatch returns at once
        wait_for(lambda: RunDir(c.run).is_finished(), timeout, "FINISHED")
        # FINISHED is written before the job's processes exit: give Slurm time to end them
        wait_for(lambda: not processes_using(c.run), 120, "the job's processes to exit")


def run_trial(trial: Trial, workdir: Path, reference: Path, keep: bool = False) -> Outcome:
    kind = KINDS[trial.kind]
    home = workdir / f"trial-{trial.index:03d}-{trial.kind}"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    c = Context(trial, home / "disk" / "run", kind.cluster, home / "job.log")
    started = time.monotonic()
    try:
        if kind.needs_tmpfs:
            c.cleanup.append(mount_tmpfs(c.run.parent, DISK_MB))
        if kind.attacker and (why := attacks.available()):
            raise TrialError(why)
        if kind.needs_stage_dir:  # as /tmp: anyone may make a name in it
            c.stage_dir = Path(tempfile.mkdtemp(prefix="rlhpc-chaos-stage-"))
            c.stage_dir.chmod(0o1777)
            c.cleanup.append(lambda: shutil.rmtree(c.stage_dir, ignore_errors=True))
        c.step_s = mean_step_s(reference)
        c.run.parent.mkdir(parents=True, exist_ok=True)
        if kind.before_start is not None:
            kind.before_start(c)
        c.proc = start(c.command(), c.log, c.cwd)
        timeout = 300 if kind.cluster == "local" else 600
        if kind.attacker:
            # the moment an engine is up: a run of the tiny model trains for seconds after minutes of start-up
            wait_for(lambda: engine_up(c), timeout, "an engine up", c.proc)
        else:
            target = trial.after_rollout
            wait_for(
                lambda: target in trained(c.run), timeout, f"rollout {target}", c.proc if c.cluster == "local" else None
            )
            time.sleep(trial.step_fraction * c.step_s)
        if c.cluster == "local":
            c.problems += engine_probe(c.run)
            ray_dir = RunDir(c.run).local_ray_dir
            if ray_dir is None or not ray_dir.is_dir():  # else a kill leaves it in /tmp for good
                c.problems.append(f"the job's Ray does not keep its files where the run dir records: {ray_dir}")
        ended = kind.inject(c)
        if ended:
            c.proc.wait()
        wait_finished(c, JOB_TIMEOUT_S)
        if kind.must_finish_alone and not RunDir(c.run).is_finished():
            c.problems.append(f"the job ended (exit {c.proc.returncode}) without finishing the run")
        for _ in range(3):  # what a user does after a crash: submit the same command again
            if RunDir(c.run).is_finished():
                break
            c.proc = start(c.command(), c.log, c.cwd)
            wait_finished(c, JOB_TIMEOUT_S)
        for check in c.after:
            check()
        c.problems += violations(c.run, reference)
    except (TrialError, attacks.AttackError) as e:
        c.problems.append(f"trial not carried out: {e}")
    finally:
        if c.proc is not None and c.proc.poll() is None:
            kill_session(c.proc)
        for pid_line in processes_using(c.run):  # counted as debris above; do not leave them running
            pid = int(pid_line.split()[1].rstrip(":"))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for undo in reversed(c.cleanup):
            undo()
    if c.problems:
        c.problems.append(f"log: {c.log}; run dir: {c.run}")
    elif not keep:
        shutil.rmtree(home, ignore_errors=True)
    return Outcome(trial, c.problems, time.monotonic() - started, c.notes)


def make_reference(workdir: Path, cluster: str, layout: str = "1rank", num_eval: int = LONG_EVAL) -> Path:
    """The undisturbed run of the config on ``layout`` with ``num_eval`` evaluation rows, made
    once per config and workdir."""
    run = workdir / f"reference-{cluster}-{layout}-eval{num_eval}" / "run"
    if RunDir(run).is_finished():
        return run
    shutil.rmtree(run.parent, ignore_errors=True)
    run.parent.mkdir(parents=True)
    extra = ("--sbatch", "nodelist=node0") if cluster == "slurm" else ()
    proc = start(submit_command(run, cluster, layout, *extra, num_eval=num_eval), run.parent / "job.log")
    c = Context(plan(0, LOCAL_KINDS[0], 0, layout), run, cluster, run.parent / "job.log", proc)
    wait_finished(c, JOB_TIMEOUT_S)
    if not RunDir(run).is_finished():
        raise TrialError(f"the undisturbed {cluster} run did not finish: see {run.parent / 'job.log'}")
    return run


# ---------------------------------------------------------------------------- the soak


def soak(
    trials: int,
    kinds: list[str],
    seed: int,
    workdir: Path,
    keep: bool = False,
    echo=print,
    layouts: list[str] | None = None,
) -> dict:
    """Run ``trials`` trials, kinds round robin, each round on the next layout; the summary dict
    (the tool's last line), tries counted per kind and per layout."""
    layouts = layouts or list(LAYOUTS)
    workdir.mkdir(parents=True, exist_ok=True)
    references = {}
    by_kind = {k: {"tried": 0, "survived": 0} for k in kinds}
    by_layout = {name: {"tried": 0, "survived": 0} for name in layouts}
    for i in range(trials):
        trial = plan(i, kinds[i % len(kinds)], seed + i, layouts[(i // len(kinds)) % len(layouts)])
        where = (KINDS[trial.kind].cluster, trial.layout, KINDS[trial.kind].num_eval)
        if where not in references:
            t0 = time.monotonic()
            references[where] = make_reference(workdir, *where)
            echo(
                f"undisturbed {where[0]} run on {where[1]}, {where[2]} eval rows: {references[where]}"
                f" ({time.monotonic() - t0:.0f} s)"
            )
        out = run_trial(trial, workdir, references[where], keep)
        for counts in (by_kind[trial.kind], by_layout[trial.layout]):
            counts["tried"] += 1
            counts["survived"] += out.survived
        verdict = "survived" if out.survived else "FAILED"
        echo(f"{trial.describe()}: {verdict} ({out.seconds:.0f} s)")
        for p in out.problems:
            echo(f"    {p}")
        for note in out.notes:
            echo(f"    attack: {note}")
    survived = sum(v["survived"] for v in by_kind.values())
    echo("")
    echo(f"{'fault':<20} survived / tried")
    for k, v in by_kind.items():
        echo(f"{k:<20} {v['survived']:>8} / {v['tried']}")
    for name, v in by_layout.items():
        echo(f"{'layout ' + name:<20} {v['survived']:>8} / {v['tried']}")
    return {"tried": trials, "survived": survived, "by_kind": by_kind, "by_layout": by_layout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=len(LOCAL_KINDS), help="number of trials (default %(default)s)")
    parser.add_argument("--cluster", choices=["local", "slurm", "both"], default="local")
    parser.add_argument("--kinds", help=f"comma-separated fault kinds (default: all of --cluster): {', '.join(KINDS)}")
    parser.add_argument("--layouts", help=f"comma-separated actor layouts (default: all): {', '.join(LAYOUTS)}")
    parser.add_argument("--seed", type=int, default=0, help="trial i uses seed SEED + i (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/rlhpc-chaos"), help="default %(default)s")
    parser.add_argument("--keep", action="store_true", help="keep the run dirs of survived trials too")
    args = parser.parse_args(argv)
    if args.kinds:
        kinds = args.kinds.split(",")
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            parser.error(f"unknown fault kinds {unknown}; known: {', '.join(KINDS)}")
    else:
        kinds = {"local": LOCAL_KINDS, "slurm": SLURM_KINDS, "both": LOCAL_KINDS + SLURM_KINDS}[args.cluster]
    layouts = args.layouts.split(",") if args.layouts else list(LAYOUTS)
    if unknown := [name for name in layouts if name not in LAYOUTS]:
        parser.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if any(KINDS[k].cluster == "slurm" for k in kinds) and "SLURM_CONF" not in os.environ:
        parser.error("Slurm kinds need a cluster: export SLURM_CONF (tools/minicluster.py up prints it)")
    summary = soak(args.trials, kinds, args.seed, args.workdir.resolve(), args.keep, layouts=layouts)
    print(json.dumps(summary), flush=True)
    return 0 if summary["survived"] == summary["tried"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
