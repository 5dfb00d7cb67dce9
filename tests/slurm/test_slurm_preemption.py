"""Preemption, requeue and time limits from the real Slurm of the minicluster.

Each interrupted run must end exactly where an uninterrupted run of the same config ends:
same final weights (bit for bit, deterministic CPU run) and the same per-rollout metrics.
"""

import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.guess_envs import HOLD_FOR_STOP_ENV
from support.jobs import HELD, REPO, Gate, deterministic_config, rollout_logged, submit_slurm
from support.slow_reward import slow_allocations

from rlhpc.invariants import comparable, final_weights
from rlhpc.launch import slurm
from rlhpc.metrics import read_metrics
from rlhpc.runtime.restarts import read_history

pytestmark = pytest.mark.slurm

NUM_ROLLOUT = 30  # a time-limited first allocation (slowed, slow_allocations) is cut mid-run
CONFIG = deterministic_config(NUM_ROLLOUT)


def submit(run: Path, *args: str, follow: bool, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return submit_slurm(run, "--nodes", "1", "--gpus-per-node", "2", *args, overrides=CONFIG, follow=follow, env=env)


def trained(run: Path) -> list[int]:
    return [r["rollout_id"] for r in read_metrics(run) if r["kind"] == "rollout"]


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def job_log(run: Path) -> str:
    return " ".join("".join(p.read_text() for p in sorted((run / "logs" / "submitit").glob("*_0_log.*"))).split())


def check_same_as(run: Path, baseline: Path) -> None:
    assert (run / "FINISHED").is_file(), job_log(run)[-3000:]
    assert trained(run) == list(range(NUM_ROLLOUT))  # each rollout logged exactly once
    finished(baseline)
    assert final_weights(run) == final_weights(baseline)
    assert comparable(run) == comparable(baseline)


def finished(run: Path) -> None:
    """Wait for a run submitted beside a test to end; it must have finished."""
    job = (run / "slurm_job_id").read_text().strip()
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", None)
    wait(lambda: (run / "FINISHED").is_file() or slurm.job_state(job) in ended, 360, f"job {job} to end")
    assert (run / "FINISHED").is_file(), job_log(run)[-3000:]


@pytest.fixture(scope="module")
def baseline(minicluster, tmp_path_factory) -> Iterator[Path]:
    """The undisturbed run, not followed: it runs on node1 (which no preemption here touches) beside
    the module's first test; ``check_same_as`` waits for it. Cancelled at the end of the module if
    it is still there (a failed test)."""
    run = tmp_path_factory.mktemp("baseline") / "run"
    p = submit(run, "--sbatch", "nodelist=node1", follow=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    yield run
    job = run / "slurm_job_id"
    if job.is_file() and not (run / "FINISHED").is_file():
        slurm.cancel(job.read_text().strip())


PREEMPT_AT = 4  # the preempted run is held at this rollout's rewards until Slurm's signal came


def test_preempted_by_a_high_priority_job_then_requeued_at_an_arbitrary_moment(baseline, minicluster, tmp_path):
    """Preempted in its first allocation, where it saves at the next safe point (no work lost);
    requeued with ``scontrol requeue`` at an arbitrary moment of its second, where SIGTERM reaches
    Ray and the engines too. With a staged start: each start resumes from its node-local copy."""
    run, stage, gate = tmp_path / "run", tmp_path / "node-local", Gate(tmp_path / "gate")
    # Held at rollout PREEMPT_AT's rewards until the signal came, so the preemption lands mid-run
    # however fast the loop is (the reward's scores are digit_sum's, as the baseline's).
    gate.shut(*rollout_logged(run, PREEMPT_AT - 1))
    env = {"PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}", **gate.env}
    staged = ["--set", f"cluster.stage_dir={stage}", "--set", HELD]
    p = submit(run, "--partition", "low", "--sbatch", "nodelist=node0", *staged, follow=False, env=env)
    assert p.returncode == 0, p.stderr
    job_id = (run / "slurm_job_id").read_text().strip()
    wait(gate.is_held, 240, f"the run to hold at rollout {PREEMPT_AT}")
    # A job in the high partition that needs all of node0's GPUs: Slurm preempts ours.
    subprocess.run(
        ["sbatch", "-p", "high", "-w", "node0", "--gpus-per-node=8", "-o", "/dev/null", "--wrap", "sleep 2"],
        check=True,
        capture_output=True,
    )
    wait(lambda: "got SIGUSR2" in job_log(run), 120, "Slurm's signal")
    gate.open()
    wait(lambda: len(read_history(run)) >= 2, 300, "the preempted run to start again")
    log = job_log(run)
    assert "got SIGUSR2: stopping at the next safe point" in log
    stopped_before = int(re.search(r"stopped before rollout (\d+)", log).group(1))
    assert read_history(run)[1]["next_rollout_id"] == stopped_before  # lost work: 0 rollouts

    wait(lambda: len(trained(run)) >= stopped_before + 2, 240, "2 rollouts trained after the resume")
    done_before = len(trained(run))
    subprocess.run(["scontrol", "requeue", job_id], check=True)  # SIGTERM to everything, then back in the queue
    wait(lambda: (run / "FINISHED").is_file(), 360, "the requeued run to finish")
    history = read_history(run)
    assert len(history) >= 3 and history[1]["next_rollout_id"] == stopped_before
    # SIGTERM reaches Ray and the engines too: if they die before the emergency save, the run
    # falls back to the last periodic checkpoint, recomputing at most checkpoint.save_interval.
    assert history[2]["next_rollout_id"] >= done_before - 3
    check_same_as(run, baseline)
    assert f"staged base_model, rollout_{history[-1]['next_rollout_id'] - 1:06d} in" in job_log(run)


# The guess task as tests/integration/test_multiturn.py runs it, three rollouts; a synchronous save,
# so rollout 1's checkpoint is there before rollout 2's episodes start (where the stop comes).
GUESS_ROLLOUTS = 3
GUESS = [
    *deterministic_config(GUESS_ROLLOUTS, save_interval=2),
    "data.task=guess", "model.tiny.tokenizer=bpe", "rollout.max_turns=3", "rollout.max_new_tokens=4",
    "rollout.max_episode_tokens=48", "rollout.env=support.guess_envs:HeldForStop", "checkpoint.async_save=false",
]  # fmt: skip


def test_preempted_between_two_turns_of_episodes(minicluster, tmp_path):
    """Rollout 2's episodes are held between their first and second turns while Slurm's signal
    comes; released, they reach the stop, which cuts them (rollout 1 is saved). The requeued job
    replays them from their seeds and ends as the uninterrupted run beside it ends."""
    run, baseline, gpus = tmp_path / "run", tmp_path / "baseline", ["--nodes", "1", "--gpus-per-node", "2"]
    p = submit_slurm(baseline, *gpus, "--sbatch", "nodelist=node1", overrides=GUESS, follow=False)
    assert p.returncode == 0, p.stderr
    hold = run / "checkpoints" / "rollout_000001"  # HeldForStop holds once this exists
    p = submit_slurm(
        run, *gpus, "--partition", "low", "--sbatch", "nodelist=node0", overrides=GUESS, follow=False,
        env={HOLD_FOR_STOP_ENV: str(hold)},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    held = Path(f"{hold}.held")
    wait(lambda: held.exists() or (run / "FINISHED").exists(), 240, "the episodes to hold")
    assert held.is_file() and held.read_text() == "rollout 2\n", job_log(run)[-3000:]
    subprocess.run(
        ["sbatch", "-p", "high", "-w", "node0", "--gpus-per-node=8", "-o", "/dev/null", "--wrap", "sleep 2"],
        check=True,
        capture_output=True,
    )
    wait(lambda: "got SIGUSR2" in job_log(run), 60, "Slurm's signal")  # held: the episodes are in flight
    held.unlink()
    wait(lambda: (run / "FINISHED").is_file() and (baseline / "FINISHED").is_file(), 240, "both runs to finish")
    # rollout 2 was cut, not trained (else the stop were before rollout 3), and generated again
    assert "stopped before rollout 2 (SIGUSR2)" in job_log(run)
    history = read_history(run)
    assert len(history) == 2 and history[1]["next_rollout_id"] == 2
    assert trained(run) == trained(baseline) == list(range(GUESS_ROLLOUTS))
    episodes = [m for m in read_metrics(baseline) if m["kind"] == "rollout"]
    assert all(m["episode/turns"] > 1 for m in episodes)  # episodes went on past their first turn
    assert final_weights(run) == final_weights(baseline)
    assert comparable(run) == comparable(baseline)


@pytest.fixture(scope="module", autouse=True)
def time_limited(minicluster, tmp_path_factory) -> Iterator[Path]:
    """test_time_limit_mid_run's job, submitted as this module starts: its first allocation spends
    its minutes waiting for the time limit (a reward that sleeps), so it runs beside the module's
    other tests, alone on node3 (theirs are on node0-2), and the test at the end checks how it
    ended. Cancelled at the end of the module if it is still there (a test run with -k)."""
    # A 3-minute limit with USR2 60 s before it: an allocation has 2 minutes for start-up and
    # training, then is stopped, saved and requeued. In the first allocation the reward sleeps
    # 0.2 s per sample (support/slow_reward.py): the 30 rollouts of 32 samples need over 3 minutes
    # there, so the limit cuts it on any machine; the requeued allocation runs at the machine's
    # pace (here ~0.8 s a rollout: two allocations; a machine twice as slow needs three). The
    # config is the baseline's (the reward's scores are digit_sum's), so the run must end as it.
    run = tmp_path_factory.mktemp("time-limit") / "run"
    slow, env = slow_allocations(seconds=0.2)
    p = submit(
        run,
        "--time", "3", "--signal-grace", "60", "--sbatch", "nodelist=node3", *slow,
        "--set", "checkpoint.save_interval=50",
        follow=False,
        env=env,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    yield run
    job = run / "slurm_job_id"
    if job.is_file() and not (run / "FINISHED").is_file():
        slurm.cancel(job.read_text().strip())


@pytest.mark.timeout(1000)
def test_time_limit_mid_run(time_limited, baseline):
    run = time_limited
    wait(lambda: (run / "FINISHED").is_file(), 960, "the time-limited run to finish")
    history = read_history(run)
    assert len(history) >= 2, job_log(run)[-3000:]
    stops = [int(n) for n in re.findall(r"stopped before rollout (\d+)", job_log(run))]
    assert stops == [h["next_rollout_id"] for h in history[1:]]  # every restart resumed where it stopped: 0 lost
    check_same_as(run, baseline)  # every rollout once, and the undisturbed run's weights and metrics
