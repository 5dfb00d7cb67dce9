"""A heterogeneous job on the minicluster: the actor on partition `train` (node0), the engines on
partition `gen` (node1-2), a tiny reward model on partition `score` (node3), one Ray cluster over
the three components. Trained to the end, and preempted by a high-priority job on an engine node:
it saves, requeues and ends identical to the undisturbed run. Requests a component's partition
cannot give are refused before anything is submitted."""

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from support.jobs import HELD, REPO, Gate, deterministic_config, rollout_logged, submit_slurm

from rlhpc.invariants import comparable, final_weights
from rlhpc.metrics import read_metrics
from rlhpc.runtime.restarts import read_history

pytestmark = pytest.mark.slurm

NUM_ROLLOUT = 8
PREEMPT_AT = 4  # the interrupted run is held at this rollout's rewards for the preemption
# the reward model's score is half of each sample's reward (its scores are in the metrics compared)
CONFIG = [*deterministic_config(NUM_ROLLOUT), "reward_model.tiny.seed=3", "reward_model.weight=0.5"]
# 2 actor ranks on node0, one single-GPU engine on each of node1 and node2, one reward engine on node3
HET = ["--nodes", "1", "--gpus-per-node", "2", "--partition", "train",
       "--rollout-nodes", "2", "--rollout-gpus-per-node", "1", "--rollout-partition", "gen",
       "--reward-nodes", "1", "--reward-gpus-per-node", "1", "--reward-partition", "score"]  # fmt: skip


def submit(
    run: Path, *args: str, follow: bool, het: list[str] = HET, config: list[str] = CONFIG, env: dict | None = None
) -> subprocess.CompletedProcess:
    return submit_slurm(run, *het, *args, overrides=config, follow=follow, env=env)


def queued() -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()


def trained(run: Path) -> list[int]:
    return [r["rollout_id"] for r in read_metrics(run) if r["kind"] == "rollout"]


def job_log(run: Path) -> str:
    return " ".join("".join(p.read_text() for p in sorted((run / "logs" / "submitit").glob("*_log.*"))).split())


def wait(cond, timeout: float, what: str, run: Path) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}\n{job_log(run)[-3000:]}"
        time.sleep(0.3)


def placed(run: Path) -> tuple[set[str], set[str], set[str]]:
    """IPs of the actor's, the engines' and the reward engine's slots, from the driver's placement line."""
    line = re.search(r"placement: (.*?) start-up", job_log(run)).group(1)
    slots = dict(re.findall(r"slot(\d+)=([\d.]+):gpu\d+", line))
    return {slots["0"], slots["1"]}, {slots["2"], slots["3"]}, {slots["4"]}


def test_each_group_on_its_partition_and_a_preemption_resumes_identically(minicluster, tmp_path):
    ip = minicluster.node_ips
    baseline, run, gate = tmp_path / "baseline", tmp_path / "run", Gate(tmp_path / "gate")
    # The undisturbed run beside the interrupted one, on the same nodes: it must have ended before
    # the preemption, which would stop it too (it has a GPU of node1).
    assert submit(baseline, follow=False).returncode == 0
    # Held at rollout PREEMPT_AT's rewards until Slurm's signal came, so the preemption lands mid-run
    # however fast the loop is; the reward's scores are digit_sum's, as the baseline's.
    gate.shut(*rollout_logged(run, PREEMPT_AT - 1))
    env = {"PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}", **gate.env}
    assert submit(run, "--set", HELD, follow=False, env=env).returncode == 0
    wait(lambda: (baseline / "FINISHED").is_file(), 420, "the undisturbed run to finish", baseline)
    said = job_log(baseline)
    assert "Ray cluster ready: 4 nodes, 5 GPUs" in said
    actor, engines, reward = placed(baseline)
    assert actor == {ip["node0"]} and engines == {ip["node1"], ip["node2"]} and reward == {ip["node3"]}
    assert "reward engine 0   (tp=1) -> node3:gpu0" in (baseline / "layout.txt").read_text()
    assert trained(baseline) == list(range(NUM_ROLLOUT))
    scored = [r["reward/reward_model"] for r in read_metrics(baseline) if r["kind"] == "rollout"]
    assert len(set(scored)) > 1  # the reward model scored every rollout

    wait(gate.is_held, 240, f"the run to hold at rollout {PREEMPT_AT}", run)
    # A high job that needs all of node1's GPUs: Slurm preempts the het job (every component).
    subprocess.run(
        ["sbatch", "-p", "high", "-w", "node1", "--gpus-per-node=8", "-o", "/dev/null", "--wrap", "sleep 2"],
        check=True, capture_output=True,
    )  # fmt: skip
    wait(lambda: "got SIGUSR2" in job_log(run), 120, "Slurm's signal", run)
    gate.open()
    wait(lambda: (run / "FINISHED").is_file(), 360, "the preempted run to finish", run)
    said = job_log(run)
    assert "got SIGUSR2: stopping at the next safe point" in said
    stopped_before = int(re.search(r"stopped before rollout (\d+)", said).group(1))
    history = read_history(run)
    assert len(history) == 2 and history[1]["next_rollout_id"] == stopped_before  # lost work: 0 rollouts
    assert trained(run) == list(range(NUM_ROLLOUT))  # each rollout logged exactly once
    assert final_weights(run) == final_weights(baseline)
    assert comparable(run) == comparable(baseline)


@pytest.mark.parametrize(
    "het,message",
    [
        (["--rollout-nodes", "1", "--rollout-partition", "nope"], "partition 'nope' does not exist"),
        (["--rollout-nodes", "3", "--rollout-partition", "gen"], "--rollout-nodes 3 but partition 'gen' has 2 nodes"),
        (
            ["--rollout-nodes", "1", "--rollout-gpus-per-node", "9", "--rollout-partition", "gen"],
            "--rollout-gpus-per-node 9 but nodes in partition 'gen' have 8 GPUs",
        ),
        (
            [
                "--rollout-nodes",
                "1",
                "--rollout-partition",
                "gen",
                "--reward-nodes",
                "2",
                "--reward-partition",
                "score",
                "--set",
                "reward_model.tiny.seed=3",
            ],
            "--reward-nodes 2 but partition 'score' has 1 nodes",
        ),  # fmt: skip
    ],
    ids=["no-such-partition", "too-many-nodes", "too-many-gpus", "too-many-reward-nodes"],
)
def test_what_a_components_partition_cannot_give_is_refused_before_submission(minicluster, tmp_path, het, message):
    run = tmp_path / "run"
    before = set(queued())
    het = ["--nodes", "1", "--gpus-per-node", "2", "--partition", "train", *het]
    p = submit(run, follow=False, het=het, config=deterministic_config(NUM_ROLLOUT))  # a reward model only where named
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2 and message in out and "fix:" in out, out[-2000:]
    assert not run.exists()  # nothing written
    assert not set(queued()) - before  # nothing submitted (a job of the test before may still be ending)
