"""A node dies under a running job (tools/minicluster.py kill-node: a power loss).

An engine node: the run goes on with the other engine, a replacement Ray worker rejoins once the
node is back, and the results equal an undisturbed run's (deterministic). A node with actor
ranks, then, in the requeued job, the head node: each time the job requeues itself, resumes from
the newest checkpoint and loses at most checkpoint.save_interval rollouts, and it ends as the
undisturbed run ends. Each test's undisturbed run is submitted as the test starts and runs beside
it, where no node is killed.
"""

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.hold import HOLD_ENV
from support.jobs import HELD, REPO, Gate, rollout_logged, submit_slurm

from rlhpc.invariants import comparable, final_weights
from rlhpc.launch import run_owner, slurm
from rlhpc.metrics import read_metrics
from rlhpc.run_dir import RunDir
from rlhpc.runtime.restarts import read_history

pytestmark = pytest.mark.slurm

# The engine-node test holds the run (support/hold.py) from the engine count's drop until the
# replacement node's Ray worker has joined, so the run cannot end first however long Slurm and Ray
# take; after it, a rollout or two bring the engine back. The actor-then-head test holds its run at
# rollout KILLS[0]'s rewards for the actor node's loss, two checkpoints saved (after 3 and 6
# rollouts), and the requeued job at rollout KILLS[1]'s for the head node's, two more saved (after 6
# and 9): a resume from any but the newest loses more than SAVE_INTERVAL.
NUM_ROLLOUT = 10
SAVE_INTERVAL = 3
KILLS = (2 * SAVE_INTERVAL + 1, 3 * SAVE_INTERVAL + 1)  # rollouts trained when each node dies
REQUEUE_ROLLOUT = KILLS[1] + 2  # the actor-then-head test: after the second resume, two more
CONFIG = [
    "data.num_train=6400",  # no epoch end (which saves) within the run
    "rollout.rollout_batch_size=64",  # 64 prompts x 8 samples: 8 requests a rollout, over the engines
    "rollout.n_samples_per_prompt=8",
    "rollout.max_new_tokens=4",
    "eval.interval=null",
    "logging.wandb_mode=disabled",
    "deterministic=true",
    f"checkpoint.save_interval={SAVE_INTERVAL}",
    "cluster.actor_num_gpus=1",
    "cluster.rollout_num_gpus=2",
    HELD,  # digit_sum's reward, held while a test asks
]


def submit(
    run: Path, nodes: int, gpus: int, *args: str, follow: bool, num_rollout: int = NUM_ROLLOUT
) -> subprocess.CompletedProcess:
    nodes_gpus = ("--nodes", str(nodes), "--gpus-per-node", str(gpus))
    overrides = [*CONFIG, f"rollout.num_rollout={num_rollout}"]
    env = {
        "PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}",
        HOLD_ENV: str(run.parent / "hold"),
        **Gate(run.parent / "gate").env,
    }
    return submit_slurm(run, *nodes_gpus, *args, overrides=overrides, follow=follow, env=env, timeout=900)


def rollouts(run: Path) -> list[dict]:
    return [r for r in read_metrics(run) if r["kind"] == "rollout"] if (run / "metrics.jsonl").exists() else []


def wait(cond, timeout: float, what: str, run: Path | None = None) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}" + (f"\n{job_log(run)[-3000:]}" if run else "")
        time.sleep(0.5)


def job_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs" / "submitit").glob("*_log.*")))


def job_id_of(run: Path, p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run_owner.read(run).job_id


def wait_finished(run: Path, job_id: str, timeout: float = 600) -> None:
    wait(lambda: (run / "FINISHED").is_file() or slurm.job_state(job_id) in (None, "FAILED", "COMPLETED"), timeout,
         f"job {job_id} to end", run)  # fmt: skip
    assert (run / "FINISHED").is_file(), f"job {job_id} ended {slurm.job_state(job_id)}:\n" + job_log(run)[-4000:]


def same_results(run: Path, baseline: Path, num_rollout: int = NUM_ROLLOUT) -> None:
    """Every rollout logged once; weights and metrics (bar the engine count) as undisturbed."""
    assert [r["rollout_id"] for r in rollouts(run)] == list(range(num_rollout))
    assert final_weights(run) == final_weights(baseline)
    assert comparable(run) == comparable(baseline)  # the engine count is left out there


# The actor-then-head test's layout: two data-parallel actor ranks and one engine.
REQUEUE_LAYOUT = ["--set", "cluster.actor_num_gpus=2", "--set", "cluster.rollout_num_gpus=1"]


def undisturbed(run: Path, node: str, *args: str, num_rollout: int = NUM_ROLLOUT) -> Iterator[Path]:
    """The same run on one node (``node``), never disturbed, submitted beside a test's; ``finished``
    waits for it. Cancelled at the end if it is still there (a failed test)."""
    p = submit(run, 1, 3, *args, "--sbatch", f"nodelist={node}", follow=False, num_rollout=num_rollout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    yield run
    job = run / "slurm_job_id"
    if job.is_file() and not (run / "FINISHED").is_file():
        slurm.cancel(job.read_text().strip())


def finished(run: Path) -> Path:
    """An undisturbed run, once it ended (beside the test, it may have ended, and left no run
    owner record, before this is asked: the job id written at submission names it)."""
    wait_finished(run, RunDir(run).read_job_id())
    return run


@pytest.fixture
def requeue_baseline(minicluster, tmp_path_factory) -> Iterator[Path]:
    """The actor-then-head test's undisturbed run, on node3 (gloo's two-rank all-reduce gives the same
    sums on one node as across two). That test's run may share node3: it waits for this one to end
    before it kills a node."""
    run = tmp_path_factory.mktemp("requeue-baseline") / "run"
    yield from undisturbed(run, "node3", *REQUEUE_LAYOUT, num_rollout=REQUEUE_ROLLOUT)


@pytest.fixture
def engine_baseline(minicluster, tmp_path_factory) -> Iterator[Path]:
    """The engine-node test's undisturbed run, on node0, which that test's run shares and never loses
    (a replacement worker goes to a node the job does not hold)."""
    yield from undisturbed(tmp_path_factory.mktemp("engine-baseline") / "run", "node0")


def lost_work_within_bound(run: Path, trained_before_kills: list[int]) -> None:
    history = read_history(run)
    assert len(history) == 1 + len(trained_before_kills), history  # requeued once a kill, counted against the caps
    for start, trained in zip(history[1:], trained_before_kills):
        assert start["next_rollout_id"] >= trained - SAVE_INTERVAL, history


@pytest.mark.timeout(1500)
def test_actor_node_then_head_node_lost_requeues_and_resumes(minicluster, requeue_baseline, tmp_path):
    # Actor ranks on the first node (the head, with the driver) and the second; the engine on the
    # third. Not pinned: a requeued job takes any node but a lost one. The actor node stays down
    # until the job has requeued; the head comes back as soon as Slurm marked it DOWN (a quick
    # reboot: back before the worker tasks' Ray gives up on it, and no longer part of the job).
    # The first allocation loses its second node (actor ranks), the requeued one its first (head).
    run, gate = tmp_path / "run", Gate(tmp_path / "gate")
    gate.shut(*rollout_logged(run, KILLS[0] - 1))  # held at rollout KILLS[0]'s rewards, for the kill
    job = job_id_of(run, submit(run, 3, 1, *REQUEUE_LAYOUT, follow=False, num_rollout=REQUEUE_ROLLOUT))
    killed, trained = [], []
    try:
        for index, kill_at in zip((1, 0), KILLS):
            wait(gate.is_held, 300, f"the run to hold at rollout {kill_at}", run)
            if index == 1:  # the undisturbed run ended: on a node of this run's it would die with it
                baseline = finished(requeue_baseline)
            node = slurm.hostnames(slurm.show_job(job)["NodeList"])[index]
            trained.append(len(rollouts(run)))
            assert trained[-1] == kill_at, rollouts(run)
            minicluster.kill_node(node)
            killed.append(node)
            if index == 1:
                gate.shut(*rollout_logged(run, KILLS[1] - 1))  # the next start is held for the next kill
            else:
                gate.open()  # the last start is not held
                minicluster.revive_node(node)
            wait(lambda: len(read_history(run)) > len(killed), 300, "the requeued job to start", run)
            minicluster.revive_node(node)
        wait_finished(run, job)
    finally:
        gate.open()
        for node in killed:
            minicluster.revive_node(node)
    log = job_log(run)
    assert all(node in log for node in killed), killed  # named
    lost_work_within_bound(run, trained)
    # each rollout logged once, and both resumes (weights, optimizer, RNG) end as the run nobody disturbed
    same_results(run, baseline, REQUEUE_ROLLOUT)


@pytest.mark.timeout(1200)
def test_engine_node_lost_and_back(minicluster, engine_baseline, tmp_path):
    # node3 is busy, so the replacement for the lost node can only start on it once it is back.
    blocker = subprocess.run(
        ["sbatch", "--parsable", "--nodelist=node3", "--exclusive", "--output=/dev/null", "--wrap=sleep 900"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    run, hold = tmp_path / "run", tmp_path / "hold"
    try:
        job = job_id_of(run, submit(run, 3, 1, "--sbatch", "nodelist=node[0-2]", follow=False))
        wait(lambda: len(rollouts(run)) >= 3, 300, "3 rollouts", run)
        minicluster.kill_node("node2")  # engine 1's node, mostly mid-generation
        wait(
            lambda: any(r.get("rollout/num_engines") == 1 for r in rollouts(run)), 180, "the engine count to drop", run
        )
        hold.touch()  # the next rollout's rewards wait until the replacement worker is in
        minicluster.revive_node("node2")
        wait(lambda: replacement_joined(run), 300, "the replacement Ray worker to join", run)
        hold.unlink()
        wait(lambda: serving_again(run), 300, "the engine to serve again", run)
        wait_finished(run, job)
    finally:
        hold.unlink(missing_ok=True)
        minicluster.revive_node("node2")
        slurm.cancel(blocker)
    counts = [r["rollout/num_engines"] for r in rollouts(run)]
    dropped = counts.index(1)
    events = "\n".join([line for line in job_log(run).splitlines() if "WARNING" in line][-40:])
    # down to 1, then back to 2
    assert counts[:dropped] == [2] * dropped and 2 in counts[dropped:], f"engines per rollout {counts}\n{events}"
    assert "node2" in job_log(run)  # the warning names the node
    assert len(read_history(run)) == 1  # never requeued
    same_results(run, finished(engine_baseline))


def replacement_joined(run: Path) -> bool:
    """The replacement job's Ray worker started on its node (the log of its first one says)."""
    return any(
        "replacement Ray worker starting" in log.read_text() for log in (run / "ray").glob("job_*/ray_node_1000.log")
    )


def serving_again(run: Path) -> bool:
    """Both engines served the newest rollout (or the run is over: the test then says how it went)."""
    return rollouts(run)[-1]["rollout/num_engines"] == 2 or (run / "FINISHED").is_file()
