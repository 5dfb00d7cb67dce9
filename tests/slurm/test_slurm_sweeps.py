"""Sweeps as one Slurm job array, and follow-up jobs (--then), on the minicluster."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support.jobs import submit_slurm

from rlhpc.metrics import read_metrics
from rlhpc.runtime.restarts import read_history

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--nodes", "1", "--gpus-per-node", "2", "--time", "15",
    "--set", "data.num_train=64",
    "--set", "rollout.rollout_batch_size=8",
    "--set", "rollout.n_samples_per_prompt=4",
    "--set", "eval.interval=null",
    "--set", "logging.wandb_mode=disabled",
]  # fmt: skip


def submit(run_dir: Path, *args: str, env: dict | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    return submit_slurm(run_dir, *TINY, *args, env=env, timeout=timeout)


def scontrol(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True).stdout


def wait_gone(job_id: str, timeout: float = 600) -> str:
    """Wait until Slurm no longer lists the job (every task of an array) as active; its last state."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = re.findall(r"JobState=(\S+)", scontrol(job_id))
        active = [s for s in states if s in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED")]
        if not active:
            return states[-1] if states else ""
        time.sleep(1)
    raise AssertionError(f"job {job_id} still active after {timeout}s")


def queued() -> set[str]:
    """The ids Slurm lists now. Compared as "none added": a job of an earlier test may still be
    leaving the queue meanwhile."""
    return set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())


def test_a_sweep_is_one_array_and_a_requeued_task_requeues_alone(minicluster, tmp_path):
    sweep = tmp_path / "sweep"
    # Three tasks, two at a time: the third waits for a slot. (The product of two sweeps of several
    # values is tests/unit/test_sweep.py's; a fourth task here was a third wave of job starts.)
    args = ["--sweep", "rollout.temperature=0.7,1.0,1.3", "--sweep", "seed=2", "--max-parallel", "2",
            "--set", "rollout.num_rollout=6", "--no-follow", "--then", 'touch "$RLHPC_RUN_DIR/then"']  # fmt: skip
    p = submit(sweep, *args)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    array = (sweep / "slurm_job_id").read_text().strip()
    tasks = [sweep / f"task_{i:03d}" for i in range(3)]
    assert [(t / "slurm_job_id").read_text().strip() for t in tasks] == [f"{array}_{i}" for i in range(3)]
    assert "ArrayTaskThrottle=2" in scontrol(array)  # --max-parallel 2: one array, two tasks at a time
    # Requeue task 1 once it trained a rollout: it alone goes back to the queue and resumes.
    deadline = time.time() + 600  # two tasks start Ray, the actor and an engine on shared cores
    while not (tasks[1] / "metrics.jsonl").is_file():
        assert time.time() < deadline, "task 1 never trained a rollout"
        time.sleep(0.5)
    subprocess.run(["scontrol", "requeue", f"{array}_1"], check=True)
    followups = re.findall(r"follow-up job (\d+) runs after job", p.stdout + p.stderr)
    assert len(followups) == 3  # one per task
    wait_gone(array)
    for job in followups:  # an early one may be forgotten by Slurm already (""): its file says it ran
        assert wait_gone(job, timeout=180) in ("COMPLETED", "")
    assert all((t / "then").is_file() for t in tasks)
    # the requeued task's follow-up waited for its real end, not its requeue
    assert (tasks[1] / "then").stat().st_mtime >= (tasks[1] / "FINISHED").stat().st_mtime
    for i, task in enumerate(tasks):
        assert (task / "FINISHED").is_file(), f"task {i} unfinished"
        assert [r["rollout_id"] for r in read_metrics(task) if r["kind"] == "rollout"] == list(range(6))
        cfg = yaml.safe_load((task / "config.yaml").read_text())
        assert (cfg["rollout"]["temperature"], cfg["seed"]) == ([0.7, 1.0, 1.3][i], 2)
    starts = {i: [h["job_id"] for h in read_history(t)] for i, t in enumerate(tasks)}
    assert starts[1] == [f"{array}_1"] * 2 and all(starts[i] == [f"{array}_{i}"] for i in (0, 2)), starts
    status = subprocess.run([sys.executable, str(REPO / "jobs" / "status.py"), str(sweep)],
                            capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    rows = [line.split() for line in status.splitlines()[2:]]
    assert [(r[0], r[2], r[3], r[4]) for r in rows] == [(str(i), "FINISHED", str(int(i == 1)), "6") for i in range(3)]
    plot = subprocess.run(
        [sys.executable, str(REPO / "tools" / "plot_metrics.py"), str(sweep)], capture_output=True, text=True
    )
    assert plot.returncode == 0 and (sweep / "metrics.png").stat().st_size > 0, plot.stderr
    # The same sweep again: every task finished, nothing submitted.
    before = queued()
    again = submit(sweep, *args)
    said = " ".join((again.stdout + again.stderr).split())  # unwrap the log lines
    assert again.returncode == 0 and "finished: nothing to submit" in said and not queued() - before, said


@pytest.mark.parametrize(
    "args,message",
    [
        (["--sweep", "actor.lrr=1e-4,3e-4"], "unknown config key 'actor.lrr'"),
        (["--sweep", "actor.lr="], "--sweep 'actor.lr=' has no values"),
        (
            ["--sweep", "rollout.temperature=0.5,-1"],
            "sweep task 1 (rollout.temperature=-1): rollout.temperature = -1.0 must be >= 0",
        ),
    ],
    ids=["unknown-key", "no-values", "invalid-value"],
)
def test_bad_sweeps_are_refused_before_submission(minicluster, tmp_path, args, message):
    run = tmp_path / "sweep"
    before = queued()
    p = submit(run, *args, "--no-follow", timeout=120)
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2 and message in out and "fix:" in out, out[-2000:]
    assert not run.exists() and not queued() - before  # nothing written, nothing submitted


def test_then_runs_after_success_and_not_after_a_failure(minicluster, tmp_path):
    then = 'echo "ran in $RLHPC_RUN_DIR" > "$RLHPC_RUN_DIR/then.txt"'
    good, bad = tmp_path / "good", tmp_path / "bad"
    # A training job that fails (a crashing reward, no requeue on failure): its follow-up never
    # runs. Submitted first, it runs beside the one that succeeds.
    crash = tmp_path / "crash-now"
    crash.write_text("")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}",
           "RLHPC_TEST_CRASH_FILE": str(crash)}  # fmt: skip
    failing = submit(bad, "--set", "data.reward=support.crashy_reward:reward",
                     "--set", "checkpoint.requeue_on_failure=false", "--then", then, "--no-follow", env=env)  # fmt: skip
    assert failing.returncode == 0, failing.stderr[-3000:]
    p = submit(good, "--set", "rollout.num_rollout=1", "--then", then, "--follow")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    followup = re.search(r"follow-up job (\d+) runs after job", p.stdout + p.stderr).group(1)
    assert wait_gone(followup, timeout=180) == "COMPLETED"
    assert (good / "then.txt").read_text() == f"ran in {good}\n"
    followup = re.search(r"follow-up job (\d+) runs after job", failing.stdout + failing.stderr).group(1)
    assert wait_gone((bad / "slurm_job_id").read_text().strip()) == "FAILED"
    assert wait_gone(followup, timeout=120) == "CANCELLED"  # --kill-on-invalid-dep: not left pending forever
    assert not (bad / "then.txt").exists()
