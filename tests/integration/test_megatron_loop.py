"""The whole loop with the megatron-core actor (actor.backend: megatron) on CPU/gloo: a real job
started by jobs/submit.py (local executor, local Ray, CPU engine server), killed and resumed."""

import subprocess

import pytest
import torch
from support.jobs import HELD, REPO, job_args, kill_job, kill_when, rollouts, submit

from rlhpc.checkpoint import CheckpointManager
from rlhpc.invariants import comparable

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


def test_tp2_loop_killed_and_resumed_ends_like_an_undisturbed_run(tmp_path):
    """Deterministic, TP=2: SIGKILLed once checkpoint 3 is written, resumed from it (megatron's
    torch_dist weights, optimizer and RNG state), it ends with the metrics and final weights of
    the same config run undisturbed, started beside it."""
    run, whole = tmp_path / "run", tmp_path / "whole"
    overrides = [
        *MEGATRON, "actor.megatron.tensor_model_parallel_size=2", "cluster.gpus_per_node=3",
        "cluster.actor_num_gpus=2", "rollout.num_rollout=6", "checkpoint.save_interval=2", "deterministic=true",
        "eval.interval=null", HELD,
    ]  # fmt: skip
    undisturbed = subprocess.Popen(
        job_args(whole, *overrides), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        args = job_args(run, *overrides)
        kill_when(args, run / "checkpoints" / "rollout_000003")
        resumed_from = CheckpointManager(run / "checkpoints", 2).latest().rollout_id
        assert resumed_from >= 3 and not (run / "FINISHED").exists()

        p = subprocess.run(args, capture_output=True, text=True, timeout=400, cwd=REPO)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert f"resuming from rollout_{resumed_from:06d}" in p.stdout
        assert rollouts(run) == list(range(6))  # every rollout exactly once
        out, _ = undisturbed.communicate(timeout=400)
        assert undisturbed.returncode == 0, out[-3000:]
    finally:
        if undisturbed.poll() is None:
            kill_job(undisturbed)
    assert comparable(run) == comparable(whole)
    resumed, reference = torch_dist_weights(run), torch_dist_weights(whole)
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference), [
        k for k in reference if not torch.equal(resumed[k], reference[k])
    ]


def torch_dist_weights(run) -> dict[str, torch.Tensor]:
    """The newest checkpoint's torch_dist state (weights and optimizer, every rank's shards
    gathered), read with torch.distributed.checkpoint's own offline converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ck = CheckpointManager(run / "checkpoints", 2).latest()
    out = run.parent / f"{run.name}-state.pt"
    dcp_to_torch_save(ck.path / "actor" / "dist", out)
    state = torch.load(out, weights_only=False)
    tensors = {k: v for k, v in flat(state) if isinstance(v, torch.Tensor)}
    assert tensors
    return tensors


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), tree
