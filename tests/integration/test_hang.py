"""A training rank that hangs (its process SIGSTOPped, for real) in a local job: the call waiting on
it fails within actor.call_timeout_s, or soon after a stop request, naming the call, the rank and
its node; the rank is killed and the job requeues and finishes with every rollout logged once.
A rank that dies (SIGKILL) requeues the job the same way, and a rollout engine that dies (SIGKILL)
costs nothing: it is restarted within the start. One job holds all four faults (one a start each for
the ranks'; the engine's in the last start)."""

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from support.jobs import HELD, REPO, Gate, job_args, kill_job, rollout_logged, rollouts

from rlhpc.runtime.restarts import read_history

# Rollouts take ~0.1 s here: each fault is dealt while the job is held at a gate (support.jobs),
# so a fast run cannot outrun it.
NUM_ROLLOUT = 12
OVERRIDES = (
    f"rollout.num_rollout={NUM_ROLLOUT}", "checkpoint.save_interval=2", "eval.interval=null", HELD,
    "cluster.gpus_per_node=3", "cluster.rollout_num_gpus=2",  # two engines: one is killed, the other serves on
)  # fmt: skip
STOP_WAIT_S = 5  # actor.stop_wait_s: the default 60 s would be waited out in full
# actor.call_timeout_s, waited out once (the hang): a rank's start, tens of seconds on a loaded
# machine, has actor.start_timeout_s (the default) instead; a train step or save here takes < 1 s.
CALL_TIMEOUT_S = 15


def start(run: Path, gate: Gate, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        job_args(run, *OVERRIDES, *overrides), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, **gate.env},
    )  # fmt: skip


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line as the process shows it)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    rows = (line.split(None, 2) for line in out.splitlines())
    return {int(r[0]): (int(r[1]), r[2] if len(r) > 2 else "") for r in rows}


def task_pid(run: Path) -> int:
    """The job's task process (what Slurm would signal), not submit.py or the local controller."""
    cmd = f"submitit.core._submit {run}/logs/submitit"
    pids = [pid for pid, (_, args) in processes().items() if cmd in args and "pgrep" not in args]
    assert len(pids) == 1, pids
    return pids[0]


def rank_pid(run: Path) -> int:
    """The training rank's Ray worker: a descendant of this job's task named ray::TrainWorker."""
    procs = processes()
    family = {task_pid(run)}
    for _ in range(6):  # task -> raylet -> worker, a few levels at most
        family |= {pid for pid, (ppid, _) in procs.items() if ppid in family}
    ranks = [pid for pid in family if procs[pid][1].startswith("ray::TrainWorker")]
    assert len(ranks) == 1, [procs[p] for p in family]
    return ranks[0]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def hang_a_rank(run: Path, proc: subprocess.Popen, gate: Gate, trained: int, sig: int = signal.SIGSTOP) -> int:
    """Once rollout ``trained`` is trained (a line of the metrics), hold the job at its next
    reward and stop (or kill) the rank: it answers nothing from now on. The gate stays shut:
    the caller opens it (or shuts it on a later rollout) to let the job go on."""
    gate.shut(*rollout_logged(run, trained))
    gate.wait_held(proc)
    pid = rank_pid(run)
    os.kill(pid, sig)
    return pid


def finish(proc: subprocess.Popen, *hung: int | None) -> str:
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            kill_job(proc)
        for pid in hung:
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
    return out


def check_requeued_and_finished(run: Path, proc: subprocess.Popen, out: str, *hung: int, requeues: int = 1) -> str:
    assert proc.returncode == 0, out[-4000:]
    said = " ".join(out.split())  # unwrap rich lines
    assert said.count("the job failed; requeueing (checkpoint.requeue_on_failure)") >= requeues, out[-4000:]
    history = read_history(run)
    assert [h["restart_count"] for h in history] == list(range(requeues + 1)), history
    assert rollouts(run) == list(range(NUM_ROLLOUT))  # every rollout logged exactly once
    assert not any(alive(pid) for pid in hung)  # killed with its group, not left stopped holding its GPU
    assert not list((run / "checkpoints").glob(".staging-*"))
    return said


@pytest.fixture(scope="module")
def faults(tmp_path_factory) -> tuple[Path, str, str]:
    """One job for four faults, three of which requeue it: its rank SIGKILLed in the first start, the new
    rank SIGSTOPped in the second (a hang, found by actor.call_timeout_s = CALL_TIMEOUT_S: a
    rank's start, tens of seconds on a loaded machine, counts against actor.start_timeout_s), and in the third
    the rank SIGSTOPped and a stop request sent (the stop shortens the wait to actor.stop_wait_s,
    set short here so that the test waits out 5 s, not the default 60). In the fourth start an
    engine's server is SIGKILLed, and that start finishes. The run dir, what the job printed,
    unwrapped, and its tail as printed."""
    tmp = tmp_path_factory.mktemp("hang")
    run, gate = tmp / "run", Gate(tmp / "gate")
    proc = start(run, gate, f"actor.call_timeout_s={CALL_TIMEOUT_S}", f"actor.stop_wait_s={STOP_WAIT_S}")
    killed = hung = stopped = None
    try:
        # killed while held at rollout 3 (checkpoint 1 saved); the job goes on (the gate now
        # waits for rollout 6, which only the next start reaches), fails and resumes at rollout 2
        killed = hang_a_rank(run, proc, gate, trained=2, sig=signal.SIGKILL)
        hung = hang_a_rank(run, proc, gate, trained=6)  # in the second start, checkpoint 5 saved
        # in the third start, held at rollout 9 with rollout 8 trained and not saved (checkpoint
        # 7): the stop must save it, or train rollout 9 first, either way asking the stopped rank
        stopped = hang_a_rank(run, proc, gate, trained=8)
        os.kill(task_pid(run), signal.SIGUSR2)  # a preemption warning, the rank hung
        # the fourth start resumes at rollout 8 (checkpoint 7): held at rollout 10, engine 1's
        # server is killed; rollout 10's push and rollout 11 meet it dead
        gate.shut(*rollout_logged(run, 9))
        gate.wait_held(proc)
        assert len(read_history(run)) == 4
        os.kill(int(re.findall(r"cpu_server\[(\d+)\]", engine_log(run).read_text())[-1]), signal.SIGKILL)
        gate.open()
    finally:
        out = finish(proc, killed, hung, stopped)
    said = check_requeued_and_finished(run, proc, out, killed, hung, stopped, requeues=3)
    return run, said, out[-4000:]


def engine_log(run: Path) -> Path:
    return run / "logs" / "engines" / "engine_1.log"


def test_a_hung_rank_fails_the_call_naming_it_and_the_job_requeues(faults):
    _, said, tail = faults
    # Which call hangs depends on when the signal landed (train, save, weight push); it is named.
    assert re.search(
        r"actor call \w+ got no answer from rank 0 on [\d.]+ \(GPU \d+\) within (1[5-9]|2\d) s "
        rf"\(actor\.call_timeout_s = {CALL_TIMEOUT_S}\)",
        said,
    ), tail


def test_a_stop_request_is_honoured_while_a_rank_hangs(faults):
    """The default call_timeout_s (an hour) would outlast Slurm's warning: the stop shortens the wait."""
    _, said, tail = faults
    assert "got SIGUSR2: stopping at the next safe point" in said
    assert re.search(
        r"actor call \w+ got no answer from rank 0 on [\d.]+ \(GPU \d+\) within \d+ s "
        rf"\(SIGUSR2 asked the job to stop; waited {STOP_WAIT_S} s more\)",
        said,
    ), tail


def test_a_killed_rank_requeues_the_job_which_resumes(faults):
    """A dead rank process is gone at the next start, like a dead engine: not a reason to fail the job."""
    _, said, tail = faults
    assert re.search(r"actor rank 0 died during \w+", said), tail


def test_a_killed_engine_is_restarted_within_the_start(faults):
    """Through jobs/submit.py and rlhpc.driver.train: an engine killed mid-run costs nothing: no
    requeue for it (the fixture checks three, the ranks'), every rollout logged once."""
    run, said, tail = faults
    assert engine_log(run).read_text().count("starting at") == 5  # a start in each of 4 job starts, and its restart
    assert "rollout engine 1" in said and "restart 1 of at most 3" in said, tail
