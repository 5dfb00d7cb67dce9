"""Stopping a process and everything it started: TERM to its group, a short wait, then KILL;
a process that dies with its parent; and how the job starts a Python process (``python_command``)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import MutableMapping
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


# Python puts the working dir (``-m``, ``-c``) or the script's dir first on sys.path: a job
# submitted from a dir other users can write would import their ``uvloop.py`` (or ``rlhpc/``)
# before ours, in every process it starts (issue 43, item 6). User modules come from PYTHONPATH.
SAFE_PATH_ENV = "PYTHONSAFEPATH"


def python_command(*args: str, python: str = sys.executable) -> list[str]:
    """``python -P ARGS``: the command line of every Python process the job starts (-P: nothing
    from the working dir or a script's dir on its import path; the project needs Python 3.11)."""
    return [python, "-P", *args]


def safe_python_env(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """``env`` (default: this process's) for Python processes that others start from it (submitit's
    task, Ray's processes and workers): PYTHONSAFEPATH set, which is ``-P`` for all of them,
    and PYTHONPATH without empty entries, each of which is the working dir again."""
    env = os.environ if env is None else env
    env[SAFE_PATH_ENV] = "1"
    if "PYTHONPATH" in env:
        parts = [p for p in env["PYTHONPATH"].split(os.pathsep) if p]
        if parts:
            env["PYTHONPATH"] = os.pathsep.join(parts)
        else:
            del env["PYTHONPATH"]
    return env


def ray_job_config() -> Any:
    """The driver's ``ray.init(job_config=...)``: Ray puts the driver's working dir first on
    every worker's sys.path (for a script's modules beside it), except for a Ray Client job, whose
    code travels with it; rlhpc's user code comes from PYTHONPATH, as Ray Client's comes with it,
    so the job says it is one (Ray's private flag: tests/integration/test_submit_dir.py pins it)."""
    from ray.job_config import JobConfig

    config = JobConfig()
    config._client_job = True
    return config


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """``sig`` to this process when the thread that forked it exits (Linux's PR_SET_PDEATHSIG);
    as a ``preexec_fn``, or called by the child itself. Elsewhere a no-op."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    except OSError:
        pass  # not Linux


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group; a group already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0, name: str = "process") -> None:
    """Stop ``proc`` (started with ``start_new_session=True``, so its pid is its group id) and its children.

    KILL always follows the wait: a leader may exit on TERM while children it started linger
    (``ray start --block``'s raylet, SGLang's scheduler), holding ports and GPUs.
    """
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            log.warning("%s %d ignored SIGTERM for %.0f s; killing its process group", name, proc.pid, grace_s)
    signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def process_groups(pid: int) -> list[int]:
    """The process group of ``pid`` and those of its children that lead sessions of their own
    (a local job's controller: ``rlhpc.launch.local_controller.LocalExecutor``), for a test or the soak
    to kill a submission and its job at once, as a crash would."""
    import psutil  # late: only the tests and the soak kill this way

    try:
        groups = [os.getpgid(pid)]
    except ProcessLookupError:
        return []  # gone (and reaped) already
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        children = []
    for child in children:
        try:
            group = os.getpgid(child.pid)
        except ProcessLookupError:
            continue
        if group not in groups:
            groups.append(group)
    return groups


def running(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (ended, not yet reaped) does not."""
    import psutil  # late: the login node's status and submit never ask

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_groups(groups: list[int], timeout: float = 60) -> None:
    """SIGKILL every process of ``groups`` (from ``process_groups``) and wait until none runs: a
    process in the middle of a disk write (an fsync on a loaded machine) dies only when it returns,
    and what comes next (a resubmission) must meet the crash done, not one still under way."""
    import psutil  # late: only the tests and the soak kill this way

    for group in groups:
        signal_group(group, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = []
        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) in groups and p.info["status"] != psutil.STATUS_ZOMBIE:
                    left.append(p.pid)
            except (ProcessLookupError, psutil.Error):
                continue
        if not left:
            return
        time.sleep(0.05)
    raise RuntimeError(f"processes {left} of groups {groups} still run {timeout:.0f} s after SIGKILL")
