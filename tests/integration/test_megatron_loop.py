"""The whole loop with the megatron-core actor (actor.backend: megatron) on CPU/gloo: a real job
started by jobs/submit.py (local executor, local Ray, CPU engine server), killed and resumed."""

import subprocess

import pytest
from support.jobs import HELD, REPO, job_args, kill_when, rollouts, submit

from rlhpc.checkpoint import CheckpointManager

pytest.importorskip("megatron.core")

MEGATRON = ["actor.backend=megatron", "logging.wandb_mode=disabled"]


def test_tp1_colocated_loop_trains(tmp_path):
    run = tmp_path / "run"
    p = submit(
        run, *MEGATRON, "rollout.num_rollout=3", "eval.interval=2", "checkpoint.save_interval=null",
        "cluster.colocate=true", "cluster.offload=true", "cluster.gpus_per_node=1",
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert rollouts(run) == [0, 1, 2]
    ck = CheckpointManager(run / "checkpoints", 2).latest()
    assert (ck.path / "actor" / "dist" / "metadata.json").is_file()  # torch_dist, not an HF dir


def test_tp2_loop_killed_and_resumed(tmp_path):
    run = tmp_path / "run"
    overrides = [
        *MEGATRON, "actor.megatron.tensor_model_parallel_size=2", "cluster.gpus_per_node=3",
        "cluster.actor_num_gpus=2", "rollout.num_rollout=8", "checkpoint.save_interval=2", HELD,
    ]  # fmt: skip
    args = job_args(run, *overrides)
    kill_when(args, run / "checkpoints" / "rollout_000003")
    resumed_from = CheckpointManager(run / "checkpoints", 2).latest().rollout_id
    assert resumed_from >= 3 and not (run / "FINISHED").exists()

    p = subprocess.run(args, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"resuming from rollout_{resumed_from:06d}" in p.stdout
    assert rollouts(run) == list(range(8))  # every rollout exactly once
