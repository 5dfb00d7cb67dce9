"""The asynchronous pipeline (rollout.max_staleness = 1, deterministic) preempted by the real
Slurm of the minicluster ends exactly like the uninterrupted async run: same final weights (bit
for bit), same per-rollout metrics, every rollout trained once with weight version r - 1. Kept
short (the suite runs on 2 cores in CI): one job pair of small batches, a fraction of a second
per rollout, the preempted one held (support.jobs.Gate) where the preemption must land."""

import os
import re
import subprocess
import time
from pathlib import Path

import h5py
import pytest
from support.jobs import HELD, REPO, Gate, rollout_logged, submit_slurm

from rlhpc.invariants import comparable, final_weights
from rlhpc.launch import slurm
from rlhpc.metrics import read_metrics
from rlhpc.runtime.restarts import read_history

pytestmark = pytest.mark.slurm

K = 1
NUM_ROLLOUT = 10
PREEMPT_AFTER = 3  # the preempted run is held at its first reward after this rollout was trained
CONFIG = [
    "data.num_train=64",
    "rollout.rollout_batch_size=8",
    "rollout.n_samples_per_prompt=4",
    f"rollout.num_rollout={NUM_ROLLOUT}",
    f"rollout.max_staleness={K}",
    "eval.interval=null",
    "logging.wandb_mode=disabled",
    "deterministic=true",
    "checkpoint.save_interval=20",
]


def submit(run: Path, *args: str, follow: bool, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return submit_slurm(run, "--nodes", "1", "--gpus-per-node", "2", *args, overrides=CONFIG, follow=follow, env=env)


def trained(run: Path) -> list[int]:
    try:
        return [r["rollout_id"] for r in read_metrics(run) if r["kind"] == "rollout"]
    except (FileNotFoundError, ValueError):  # not written yet, or a line half-written
        return []


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def job_log(run: Path) -> str:
    return " ".join("".join(p.read_text() for p in sorted((run / "logs" / "submitit").glob("*_0_log.*"))).split())


def versions(run: Path, rollout_id: int) -> set[int]:
    with h5py.File(run / "rollouts" / f"rollout_{rollout_id:06d}.h5") as f:
        return set(f["weight_versions"][:].tolist())


@pytest.fixture(scope="module")
def baseline(minicluster, tmp_path_factory) -> Path:
    """The uninterrupted run, not followed: it runs beside the preempted one (node1, which the
    preemption leaves alone); ``finished`` waits for it where it is compared."""
    run = tmp_path_factory.mktemp("async-baseline") / "run"
    p = submit(run, "--sbatch", "nodelist=node1", follow=False)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run


def finished(run: Path) -> Path:
    job = (run / "slurm_job_id").read_text().strip()
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", None)
    wait(lambda: (run / "FINISHED").is_file() or slurm.job_state(job) in ended, 360, f"job {job} to end")
    assert (run / "FINISHED").is_file(), job_log(run)[-3000:]
    return run


def test_async_preempted_by_a_high_priority_job(baseline, minicluster, tmp_path):
    run, gate = tmp_path / "run", Gate(tmp_path / "gate")
    # Held at its first reward after rollout PREEMPT_AFTER was trained (the next rollout is generated
    # beside the training of this one) until Slurm's signal came: the preemption lands mid-run however
    # fast the loop is. The reward's scores are digit_sum's, as the baseline's.
    gate.shut(*rollout_logged(run, PREEMPT_AFTER))
    env = {"PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}", **gate.env}
    held = ["--set", HELD]
    assert submit(run, "--partition", "low", "--sbatch", "nodelist=node0", *held, follow=False, env=env).returncode == 0
    wait(gate.is_held, 240, f"the run to hold after rollout {PREEMPT_AFTER}")
    # A job in the high partition that needs all of node0's GPUs: Slurm preempts ours.
    subprocess.run(
        ["sbatch", "-p", "high", "-w", "node0", "--gpus-per-node=8", "-o", "/dev/null", "--wrap", "sleep 2"],
        check=True,
        capture_output=True,
    )
    wait(lambda: "got SIGUSR2" in job_log(run), 120, "Slurm's signal")
    gate.open()
    wait(lambda: (run / "FINISHED").is_file(), 360, "the preempted run to finish")
    log = job_log(run)
    assert "got SIGUSR2: stopping at the next safe point" in log
    stopped = re.search(r"stopped before rollout (\d+)", log)
    assert stopped, "the preemption came after the last rollout: raise NUM_ROLLOUT\n" + log[-3000:]
    stopped_before = int(stopped.group(1))
    assert stopped_before < NUM_ROLLOUT
    history = read_history(run)
    assert len(history) == 2 and history[1]["next_rollout_id"] == stopped_before  # no trained work lost
    assert trained(run) == list(range(NUM_ROLLOUT))  # each rollout logged exactly once
    for r in range(NUM_ROLLOUT):
        assert versions(run, r) == {max(0, r - K)}  # the fixed lag across the preemption
    assert final_weights(run) == final_weights(finished(baseline))
    assert comparable(run) == comparable(baseline)
