"""One live job per run dir: ``RUN_DIR/owner.json`` names it, and its liveness is checked.

Two jobs on one run dir would resume from one checkpoint, rewrite each other's restart
history and metrics and delete each other's staging directories. So a run dir has an owner:

- a Slurm job (by job id; alive while Slurm lists it pending, running, requeued, held ...);
- a local job (the pid of submitit's controller process, with its host and start time: a
  reused pid is another process; a process on another host cannot be checked from here);
- a ``jobs/submit.py`` between its checks and the job id it gets back (pid, host, start time).

The owner file is claimed with a hard link of a complete file (atomic, and refused when the
name exists, also on NFS), never with flock alone. An owner that is gone (job ended, process
dead) is stale: it is taken over, with a log line. ``jobs/submit.py`` claims before anything
is written or submitted; the job checks again when it starts (two jobs of one run can be
queued by hand) and releases the run dir when it ends for good (not on a requeue).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from rlhpc.errors import RunDirError
from rlhpc.run_dir import RunDir
from rlhpc.util.files import fsync_dir, write_atomic

log = logging.getLogger(__name__)

SLURM, LOCAL, SUBMITTING = "slurm", "local", "submitting"


def process_started(pid: int) -> float:
    """When process ``pid`` started, in seconds since boot where /proc says (Linux). A start time on
    the wall clock (psutil's create_time: boot time read from the clock, plus the ticks since boot)
    moves when the clock is adjusted: measured here, the wall clock drifted 5 ms/s against the
    boot clock, so two processes read the same process's start a whole second apart, and a local
    job restarting took its own claim for another job's. Elsewhere psutil's create_time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        if Path("/proc/self/stat").exists():
            raise psutil.NoSuchProcess(pid) from None
        return psutil.Process(pid).create_time()
    return int(stat.rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime


@dataclass(frozen=True)
class Owner:
    kind: str  # SLURM, LOCAL or SUBMITTING
    job_id: str | None = None  # Slurm's job id, or the local job's id (its controller's pid)
    host: str | None = None  # LOCAL, SUBMITTING: where the process runs
    pid: int | None = None
    started: float | None = None  # the process's start (process_started): tells a reused pid apart

    @classmethod
    def slurm_job(cls, job_id: str) -> Owner:
        return cls(SLURM, job_id=str(job_id))

    @classmethod
    def process(cls, pid: int, kind: str, job_id: str | None = None) -> Owner:
        return cls(kind, job_id=job_id, host=socket.gethostname(), pid=pid, started=process_started(pid))

    @classmethod
    def submitter(cls) -> Owner:
        """This ``jobs/submit.py``, until the job it submits takes over."""
        return cls.process(os.getpid(), SUBMITTING)

    @classmethod
    def local_job(cls, controller_pid: int) -> Owner:
        return cls.process(controller_pid, LOCAL, job_id=str(controller_pid))

    def same_as(self, other: Owner | None) -> bool:
        """The same job (times compared loosely: they went through JSON and another process)."""
        if other is None or (self.kind, self.job_id, self.host, self.pid) != (
            other.kind, other.job_id, other.host, other.pid
        ):  # fmt: skip
            return False
        return self.started is None if other.started is None else abs((self.started or 0) - other.started) < 1

    def describe(self) -> str:
        if self.kind == SLURM:
            return f"Slurm job {self.job_id}"
        what = f"local job {self.job_id}" if self.kind == LOCAL else "a jobs/submit.py submitting it"
        return f"{what} (pid {self.pid} on host {self.host})"

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "since": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Owner:
        """ValueError for anything we did not write: not an object, an unknown kind, wrong types,
        or a pid no job of ours can have (pid 1, init, would lock the run dir for good)."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("kind") not in (SLURM, LOCAL, SUBMITTING):
            raise ValueError(f"not an owner record: {text[:200]!r}")
        owner = cls(d["kind"], d.get("job_id"), d.get("host"), d.get("pid"), d.get("started"))
        if owner.kind == SLURM:
            if not isinstance(owner.job_id, str) or not owner.job_id:
                raise ValueError(f"a Slurm owner record without a job id: {text[:200]!r}")
        elif not (
            isinstance(owner.pid, int) and not isinstance(owner.pid, bool) and owner.pid > 1
            and isinstance(owner.host, str)
            and isinstance(owner.started, (int, float)) and not isinstance(owner.started, bool)
        ):  # fmt: skip
            raise ValueError(f"a process owner record without a valid pid, host and start: {text[:200]!r}")
        return owner


@dataclass(frozen=True)
class Liveness:
    alive: bool | None  # None: cannot be told from here
    state: str  # in words, for messages


def liveness(owner: Owner) -> Liveness:
    if owner.kind == SLURM:
        from rlhpc.launch import slurm

        try:
            state = slurm.job_state(owner.job_id)
        except (FileNotFoundError, OSError) as e:
            return Liveness(None, f"Slurm cannot be asked from here ({e})")
        if state is None:
            return Liveness(False, "no longer known to Slurm")
        return Liveness(state in slurm.SLURM_ACTIVE, state)
    if owner.host != socket.gethostname():
        return Liveness(None, f"its process runs on host {owner.host}, which cannot be checked from here")
    try:
        proc = psutil.Process(owner.pid)
        if abs(process_started(owner.pid) - (owner.started or 0)) > 1 or proc.status() == psutil.STATUS_ZOMBIE:
            return Liveness(False, "its process has ended")
        if proc.uids().real != os.getuid():  # no job of ours runs as another user: a reused or forged pid
            return Liveness(False, f"pid {owner.pid} is another user's process, not this run's job")
    except psutil.NoSuchProcess:
        return Liveness(False, "its process has ended")
    return Liveness(True, "running")


def read(run: RunDir | str | Path) -> Owner | None:
    try:
        return Owner.from_json(RunDir.of(run).owner_file.read_text())
    except (FileNotFoundError, NotADirectoryError):  # no owner (or no run dir: create() says why)
        return None
    except (ValueError, KeyError):  # not ours to interpret: treated as a stale owner
        return Owner("unreadable")


def _refusal(run: RunDir, owner: Owner, live: Liveness) -> RunDirError:
    cancel = f"`scancel {owner.job_id}`" if owner.kind == SLURM else f"stop it (kill {owner.pid})"
    if live.alive is None:
        return RunDirError(
            f"run dir {run} is owned by {owner.describe()}, and whether it still runs is unknown: {live.state}",
            f"wait for it, or {cancel} there; if it has ended, remove {run.owner_file}; or pass another --run-dir",
        )
    return RunDirError(
        f"run dir {run} is in use by {owner.describe()} ({live.state}); a second job on it would mix two runs",
        f"wait until it ends (the same command then resumes), {cancel}, or pass another --run-dir",
    )


def check_free(run: RunDir, me: Owner | None = None) -> None:
    """Refuse (RunDirError) when a live job other than ``me`` owns the run dir. Reads only."""
    owner = read(run)
    if owner is None or owner.same_as(me) or owner.kind == "unreadable":
        return
    live = liveness(owner)
    if live.alive is not False:
        raise _refusal(run, owner, live)


def _link_new(run: RunDir, me: Owner) -> bool:
    """Create the owner file holding ``me``, complete, unless it exists (atomic: link of a finished file)."""
    tmp = run.owner_file.with_name(f".{run.owner_file.name}.new-{socket.gethostname()}-{os.getpid()}")
    tmp.write_text(me.to_json())
    try:
        os.link(tmp, run.owner_file)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
        fsync_dir(run.path)


def claim(run: RunDir, me: Owner) -> None:
    """Make ``me`` the owner: refused when another live job owns the run dir; a stale one is taken over."""
    run.create()
    for _ in range(5):
        if _link_new(run, me):
            return
        owner = read(run)
        if owner is None:  # released in between: try again
            continue
        if owner.same_as(me):
            return
        live = liveness(owner) if owner.kind != "unreadable" else Liveness(False, "its owner file is unreadable")
        if live.alive is not False:
            raise _refusal(run, owner, live)
        # Stale. Move it aside, then make sure what we moved is what we judged (not a fresh claim).
        aside = run.owner_file.with_name(f".{run.owner_file.name}.stale-{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(run.owner_file, aside)
        except FileNotFoundError:
            continue
        if not _read_path(aside).same_as(owner):  # someone claimed in between: put theirs back
            if not _relink(aside, run):
                aside.unlink(missing_ok=True)
            continue
        aside.unlink(missing_ok=True)
        log.warning("run dir %s was owned by %s, which is gone (%s): taking it over", run, owner.describe(), live.state)
    raise RunDirError(
        f"could not take ownership of run dir {run}: its owner file {run.owner_file} keeps changing",
        "another submission of this run is under way: wait for it, or pass another --run-dir",
    )


def _read_path(path: Path) -> Owner:
    try:
        return Owner.from_json(path.read_text())
    except (OSError, ValueError, KeyError):
        return Owner("unreadable")


def _relink(aside: Path, run: RunDir) -> bool:
    try:
        os.link(aside, run.owner_file)
    except FileExistsError:
        return False
    aside.unlink(missing_ok=True)
    return True


def hand_over(run: RunDir, old: Owner, new: Owner) -> None:
    """``old`` (the submitter) passes the run dir to ``new`` (the job it submitted)."""
    current = read(run)
    if not (old.same_as(current) or new.same_as(current)):
        log.warning("run dir %s: the owner changed to %s while submitting", run, current and current.describe())
    write_atomic(run.owner_file, new.to_json())


def release(run: RunDir, me: Owner) -> None:
    """Give the run dir up, if ``me`` still owns it."""
    if me.same_as(read(run)):
        run.owner_file.unlink(missing_ok=True)


def wait_for_submitter(run: RunDir, timeout_s: float = 120, poll_s: float = 0.5) -> None:
    """A job that starts before its ``jobs/submit.py`` wrote the job id waits for that hand-over."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        owner = read(run)
        if owner is None or owner.kind != SUBMITTING or liveness(owner).alive is False:
            return
        time.sleep(poll_s)
