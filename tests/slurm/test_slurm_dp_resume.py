"""Exact resume of multi-rank actors under the real Slurm of the minicluster (issue 34).

One run per layout is stopped and resumed, and must end exactly where the uninterrupted run of
the same config ends (run beside it, on other nodes): same final weights, bit for bit, and the
same per-rollout metrics. The layouts are the ones whose gradient sums can round differently
after a restart: four data-parallel torch ranks (two addends commute; more need not associate:
DDP's rebuilt buckets showed with four), across two nodes, with its uninterrupted run on one
node (the same sums: the layout of the reduction is the model's, not the nodes'), and megatron
with TP=2 x DP=2 and the distributed optimizer (its Adam step was restored as 1 after every load).

The two ways Slurm stops a job: preempted by a high-priority job (SIGUSR2: it saves at the next
safe point and requeues itself) and requeued with ``scontrol requeue`` (SIGTERM to everything,
at an arbitrary moment). The torch run is preempted in its first allocation and requeued in its
second (a resume of a resumed run), the megatron run preempted. Four torch ranks on one node
resumed are tests/integration/test_chaos.py's (layout dp4: a killed rank, a killed driver); a
one-node layout here too, and a third allocation for megatron, cost CI about four minutes (a
start of four ranks is a minute of both cores).
"""

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.jobs import HELD, REPO, Gate, deterministic_config, rollout_logged, submit_slurm

from rlhpc.checkpoint import CheckpointManager
from rlhpc.invariants import comparable
from rlhpc.metrics import read_metrics
from rlhpc.runtime.restarts import read_history

pytestmark = pytest.mark.slurm

NUM_ROLLOUT = 7
# The embedded default's batch (32 prompts x 8 samples) and two optimizer steps a rollout. With
# 8 x 4 samples most groups score all 0 (no advantage, a zero gradient), so rarely more than two
# ranks add non-zero terms and a changed summation order cannot show: DDP passed here then.
CONFIG = [
    *deterministic_config(NUM_ROLLOUT, save_interval=4),
    "rollout.rollout_batch_size=32",
    "rollout.n_samples_per_prompt=8",
    "actor.num_steps_per_rollout=2",
    HELD,  # digit_sum's reward; the interrupted run's is held where each stop must land
]
ENV = {"PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}"}  # support.hold
PREEMPT_AT = 2  # the first allocation is held at this rollout's rewards for the preemption
REQUEUE_AT = 5  # and the second, where requeued, at this one's for the requeue: 2 or 3 trained after its resume


def split(actor: int, rollout: int) -> list[str]:
    return ["--set", f"cluster.actor_num_gpus={actor}", "--set", f"cluster.rollout_num_gpus={rollout}"]


MEGATRON = ["--set", "actor.backend=megatron", "--set", "actor.megatron.use_distributed_optimizer=true"]
# Two engines on one node as across two: a batch goes out as one request per configured engine, and
# how samples are batched may change the tokens (docs/guides/node-loss.md), so the torch layout and
# its one-node uninterrupted run configure two.
TORCH_DP4_ONE_NODE = ["--nodes", "1", "--gpus-per-node", "6", *split(4, 2)]
MEGATRON_TP2_DP2 = ["--nodes", "1", "--gpus-per-node", "5", *split(4, 1), *MEGATRON,
                    "--set", "actor.megatron.tensor_model_parallel_size=2"]  # fmt: skip
# name: (submit options, actor ranks, nodes of the interrupted run, submit options and nodes of its
# uninterrupted run, whether the resumed run is requeued too)
LAYOUTS = {
    # slots 0-2 (actor ranks 0-2) on the first node, slot 3 (rank 3) and the engines on the second
    "torch-dp4-two-nodes": (["--nodes", "2", "--gpus-per-node", "3", *split(4, 2)], 4, "node[0-1]",
                            (TORCH_DP4_ONE_NODE, "node3"), True),
    "megatron-tp2-dp2-distributed-optimizer": (MEGATRON_TP2_DP2, 4, "node0", (MEGATRON_TP2_DP2, "node1"), False),
}  # fmt: skip


def trained(run: Path) -> list[int]:
    try:
        return [r["rollout_id"] for r in read_metrics(run) if r["kind"] == "rollout"]
    except (FileNotFoundError, ValueError):  # not written yet, or a line half-written
        return []


def wait(cond, timeout: float, what: str, run: Path) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}: {job_log(run)[-3000:]}"
        time.sleep(0.2)


def final_weights(run: Path) -> bytes:
    """The newest checkpoint's weights as an HF safetensors file, byte for byte (a megatron
    checkpoint through tools/convert_checkpoint.py, as a user would read it)."""
    actor = CheckpointManager(run / "checkpoints", 2).latest().path / "actor"
    if not (actor / "model.safetensors").is_file():
        hf = run.parent / f"{run.name}-hf"
        tool = [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), "to-hf", str(actor), str(hf)]
        subprocess.run(tool, check=True, capture_output=True, cwd=REPO, timeout=300)
        actor = hf
    return (actor / "model.safetensors").read_bytes()


def job_log(run: Path) -> str:
    return " ".join("".join(p.read_text() for p in sorted((run / "logs" / "submitit").glob("*_0_log.*"))).split())


def submit_baseline(run: Path, args: list[str], nodes: str) -> Path:
    p = submit_slurm(run, *args, "--sbatch", f"nodelist={nodes}", overrides=CONFIG, follow=False, env=ENV)
    assert p.returncode == 0, p.stderr
    return run


@pytest.fixture
def baseline(minicluster, tmp_path, request) -> Iterator[Path]:
    """The layout's uninterrupted run, submitted as its test starts; cancelled if it is still there
    at the end (a failed test)."""
    args, nodes = LAYOUTS[request.node.callspec.params["layout"]][3]
    run = submit_baseline(tmp_path / "baseline", args, nodes)
    yield run
    job = run / "slurm_job_id"
    if job.is_file() and not (run / "FINISHED").is_file():
        subprocess.run(["scancel", job.read_text().strip()])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_preempted_and_resumed_multi_rank_actor_ends_like_the_uninterrupted_run(
    minicluster, baseline, tmp_path, layout
):
    args, ranks, nodes, _, requeued = LAYOUTS[layout]
    run, gate = tmp_path / "run", Gate(tmp_path / "gate")
    gate.shut(*rollout_logged(run, PREEMPT_AT - 1))  # so each stop lands mid-run however fast the loop is
    p = submit_slurm(
        run,
        *args,
        "--partition",
        "low",
        "--sbatch",
        f"nodelist={nodes}",
        overrides=CONFIG,
        follow=False,
        env={**ENV, **gate.env},
    )
    assert p.returncode == 0, p.stderr
    job_id = (run / "slurm_job_id").read_text().strip()

    wait(gate.is_held, 300, f"the run to hold at rollout {PREEMPT_AT}", run)
    assert f"actor group: {ranks} rank(s)" in job_log(run)  # the layout asked for
    first_node = re.sub(r"\[(\d+).*", r"\1", nodes)  # node[0-1] -> node0
    # a job in the high partition that needs all of one of the run's nodes: Slurm preempts the run
    preempt = ["sbatch", "-p", "high", "-w", first_node, "--gpus-per-node=8", "-o", "/dev/null", "--wrap", "sleep 2"]
    subprocess.run(preempt, check=True, capture_output=True)
    wait(lambda: "got SIGUSR2" in job_log(run), 120, "Slurm's signal", run)
    if requeued:
        gate.shut(*rollout_logged(run, REQUEUE_AT - 1))  # lets the first allocation go on to its stop
    else:
        gate.open()
    wait(lambda: len(read_history(run)) >= 2, 300, "the preempted run to start again", run)
    stopped_before = read_history(run)[1]["next_rollout_id"]
    assert f"stopped before rollout {stopped_before}" in job_log(run)  # saved at the stop: nothing lost
    assert stopped_before <= REQUEUE_AT - 2, stopped_before  # the requeue comes 2 rollouts after the resume or later

    if requeued:
        wait(gate.is_held, 300, f"the resumed run to hold at rollout {REQUEUE_AT}", run)
        subprocess.run(["scontrol", "requeue", job_id], check=True)  # SIGTERM to everything, back in the queue
        gate.open()
    wait(lambda: (run / "FINISHED").is_file(), 420, "the resumed run to finish", run)
    wait(lambda: (baseline / "FINISHED").is_file(), 300, "the uninterrupted run to finish", baseline)

    assert len(read_history(run)) >= 2 + requeued
    assert trained(run) == list(range(NUM_ROLLOUT))  # each rollout logged exactly once
    assert trained(baseline) == list(range(NUM_ROLLOUT))
    assert comparable(run) == comparable(baseline)
    with ThreadPoolExecutor(2) as pool:  # a megatron checkpoint's conversion is a process: both at once
        ours, theirs = pool.map(final_weights, (run, baseline))
    assert ours == theirs
