"""The asynchronous pipeline (rollout.max_staleness >= 1) as whole local jobs: staleness bounded
(read from the versions each sample recorded, never from timings), the fixed-lag schedule with
dynamic sampling reproducible bit for bit, and a stop signal, a SIGKILL or a killed engine at any
moment ending exactly like the uninterrupted run."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import h5py
import pytest
from support.hold import HOLD_ENV
from support.jobs import REPO, Gate, job_args, kill_job, rollout_logged, rollouts, routed

from rlhpc.checkpoint import CheckpointManager
from rlhpc.invariants import comparable, final_weights
from rlhpc.metrics import read_metrics
from rlhpc.runtime.restarts import read_history

K = 1
N = 8
# The module's runs over-sample (dynamic sampling): a resume must then also draw the same extra
# prompts, a pure function of the rollout. One config for the fixed lag, the filter's counts and
# every disturbed run: each of those checks reads the uninterrupted run, made once.
ASYNC = (
    f"rollout.max_staleness={K}", f"rollout.num_rollout={N}", "deterministic=true", "checkpoint.save_interval=2",
    "eval.interval=4", "data.num_eval=16", "rollout.dynamic_sampling.filter=nonzero_std",
    "rollout.dynamic_sampling.over_sampling_batch_size=12", "rollout.dynamic_sampling.max_rounds=2",
)  # fmt: skip
REWARD = "data.reward=support.filters:length_parity"  # some groups of a prompt differ, some do not
HELD = "data.reward=support.hold:length_parity"  # the same reward, held where a test acts (support.hold)


def run_job(run: Path, *overrides: str) -> subprocess.CompletedProcess:
    p = subprocess.run(job_args(run, *overrides), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def versions(run: Path, rollout_id: int) -> list[int]:
    with h5py.File(run / "rollouts" / f"rollout_{rollout_id:06d}.h5") as f:
        return f["weight_versions"][:].tolist()


def task_pid(run: Path) -> int:
    """The job's task process (what Slurm would signal), not submit.py or the local controller."""
    out = subprocess.run(["pgrep", "-f", f"submitit.core._submit {run}/logs/submitit"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, out.stdout
    return pids[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("async") / "run"
    run_job(run, *ASYNC, REWARD)
    assert routed(run)  # generated through the real router
    return run


def test_fixed_lag_generates_rollout_r_with_version_r_minus_k(uninterrupted):
    assert rollouts(uninterrupted) == list(range(N))
    for r in range(N):
        assert set(versions(uninterrupted, r)) == {max(0, r - K)}  # every sample, as the engine reported it
    records = [m for m in read_metrics(uninterrupted) if m["kind"] == "rollout"]
    assert [m["staleness/max"] for m in records] == [float(min(r, K)) for r in range(N)]
    for m in records:
        assert 0.0 <= m["time/actor_idle"] <= 1.0 and 0.0 <= m["time/rollout_idle"] <= 1.0
    evals = [m["rollout_id"] for m in read_metrics(uninterrupted) if m["kind"] == "eval"]
    assert evals == [-1, 3, 7]


def test_dynamic_sampling_counts(uninterrupted):
    """Each round over-samples 12 prompts; the batch is 8 groups, kept or filled up with dropped
    ones; the filter did drop some. (That the extra prompts are a pure function of the rollout:
    the resumes below, which end like this run.)"""
    records = [m for m in read_metrics(uninterrupted) if m["kind"] == "rollout"]
    for m in records:
        assert m["dynamic_sampling/kept"] + m["dynamic_sampling/dropped"] == 12 * m["dynamic_sampling/rounds"]
        assert m["samples"] == 8 * 4  # rollout_batch_size x n_samples_per_prompt, kept or filled up
    assert sum(m["dynamic_sampling/dropped"] for m in records) > 0  # the filter did drop groups


def test_a_stop_signal_then_a_sigkill_end_like_the_uninterrupted_async_run(uninterrupted, tmp_path):
    """One run disturbed twice, each a resume that must end bit for bit like the uninterrupted
    run (no second undisturbed run is made: this run's first start is the config again, the same
    reward held, so this is also the fixed lag's reproduction). A stop signal mid-run: the job
    saves and requeues itself. Then, in that second start, a SIGKILL once the checkpoint of
    rollout 5 is written (its rollout 6 generated with version 5): the next submission resumes
    from it with that rollout pending, its over-sampled prompts drawn again. One run for both: a
    job start fewer than one run each (and the dynamic-sampling resume, once a run of its own)."""
    run, gate, log = tmp_path / "run", Gate(tmp_path / "gate"), tmp_path / "first.log"
    args, kill_at = job_args(run, *ASYNC, HELD), run / "checkpoints" / "rollout_000005"
    gate.shut(*rollout_logged(run, 2))  # mid-run: held while a later rollout is generated
    with log.open("w") as out:
        proc = subprocess.Popen(
            args, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            env={**os.environ, **gate.env, HOLD_ENV: str(kill_at)},
        )  # fmt: skip
    try:
        gate.wait_held(proc)
        os.kill(task_pid(run), signal.SIGUSR2)
        gate.open()
        while not kill_at.exists():  # then held there (support.hold) until the kill
            assert proc.poll() is None, f"the job ended (exit {proc.returncode}) first:\n{log.read_text()[-4000:]}"
            time.sleep(0.2)
    finally:
        kill_job(proc)
    stopped = read_history(run)
    assert len(stopped) == 2 and 3 <= stopped[1]["next_rollout_id"] <= 5, log.read_text()[-4000:]
    ck = CheckpointManager(run / "checkpoints", 2).latest()
    assert ck is not None and ck.rollout_id == 5 and ck.state["pending_rollouts"] == [6]
    p = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"resuming from {ck.path.name}" in p.stdout
    assert [h["next_rollout_id"] for h in read_history(run)][2:] == [6]
    assert rollouts(run) == list(range(N))  # nothing logged twice, nothing skipped
    assert comparable(run) == comparable(uninterrupted)
    assert final_weights(run) == final_weights(uninterrupted)


def test_engine_killed_mid_run_ends_like_the_uninterrupted_async_run(uninterrupted, tmp_path):
    """Two engines; engine 0 (which serves every request of these small rollouts) is SIGKILLed
    while generation runs beside training: its requests go to engine 1 (same weights), and it is
    restarted between rollouts on the main thread, never behind training with stale labels. A
    request's tokens do not depend on the engine, so the run is the one-engine run exactly."""
    run, gate = tmp_path / "run", Gate(tmp_path / "gate")
    gate.shut(*rollout_logged(run, 2))  # mid-run: held while rollout 3 or 4 is generated
    proc = subprocess.Popen(
        job_args(run, *ASYNC, "cluster.gpus_per_node=3", "cluster.rollout_num_gpus=2", HELD), cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, **gate.env},
    )  # fmt: skip
    engine_log = run / "logs" / "engines" / "engine_0.log"
    try:
        gate.wait_held(proc)
        os.kill(int(re.findall(r"cpu_server\[(\d+)\]", engine_log.read_text())[-1]), signal.SIGKILL)
        gate.open()
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    assert proc.returncode == 0, out[-4000:]
    assert "rollout engine 0" in out and "restart 1 of at most" in out, out[-4000:]  # the recorded restart
    assert engine_log.read_text().count("starting at") == 2
    assert len(read_history(run)) == 1  # the job itself never restarted
    assert rollouts(run) == list(range(N))  # every rollout once
    for r in range(N):
        assert set(versions(run, r)) == {max(0, r - K)}
    assert comparable(run) == comparable(uninterrupted)
    assert final_weights(run) == final_weights(uninterrupted)


def test_freshest_weights_stay_within_the_staleness_bound_and_tis_weighs_the_loss(tmp_path):
    """Staleness 2 with partial rollouts, and TIS truncating at 1.0 with one optimizer step per
    rollout. A push does not wait for the rollout in flight: its requests pause, the weights
    change and they go on. Whether a push lands inside a generation is timing; what is asserted
    is that every token records a version, within the bound, in order, and the sample its
    oldest. The last rollout's reported TIS weights and loss are those worked out here from its
    dump (the engine's logprobs, of whichever weights made each token) and the checkpoint it was
    trained from (transformers' log-softmax). One job for both (two before)."""
    run = tmp_path / "run"
    run_job(
        run, "rollout.max_staleness=2", "rollout.partial_rollout=true", "rollout.num_rollout=6",
        "rollout.max_new_tokens=24", "checkpoint.save_interval=1", "algo.tis=true", "algo.tis_clip=1.0",
        "actor.num_steps_per_rollout=1", "data.reward=support.rewards:spread",
    )  # fmt: skip
    assert rollouts(run) == list(range(6))
    for r in range(6):
        with h5py.File(run / "rollouts" / f"rollout_{r:06d}.h5") as f:
            per_token = [t.tolist() for t in f["token_versions"][:]]
            lengths = [len(x) for x in f["response_ids"][:]]
            per_sample = f["weight_versions"][:].tolist()
        assert [len(t) for t in per_token] == lengths
        for tokens, version in zip(per_token, per_sample):
            assert tokens == sorted(tokens) and all(0 <= r - v <= 2 for v in tokens), (r, tokens)
            assert not tokens or min(tokens) == version
            assert 0 <= r - version <= 2, (r, version)
    records = [m for m in read_metrics(run) if m["kind"] == "rollout"]
    assert all(0.0 <= m["staleness/straddling"] <= 1.0 for m in records)
    record = records[5]
    assert record["rollout_id"] == 5
    expected = tis_by_hand(
        run / "rollouts" / "rollout_000005.h5", run / "checkpoints" / "rollout_000004" / "actor", 1.0
    )
    assert 0 < expected["tis_clipfrac"] < 1  # some tokens truncated, some not
    # the weights change the loss by more than the tolerance it is compared with below
    tolerance = 1e-5 * abs(expected["pg_loss"]) + 1e-6
    assert abs(expected["pg_loss"] - expected["pg_loss_unweighted"]) > 10 * tolerance
    del expected["pg_loss_unweighted"]
    # a token whose ratio is the clip to rounding (the same weights made it: ratio 1) falls on
    # either side of it between the actor's forward and transformers': counted either way
    low, high = expected.pop("tis_clipfrac_range")
    del expected["tis_clipfrac"]
    assert low - 1e-6 <= record["tis_clipfrac"] <= high + 1e-6, (record["tis_clipfrac"], low, high)
    for k, v in expected.items():
        assert record[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (k, record[k], v)


def tis_by_hand(dump: Path, policy: Path, clip: float) -> dict[str, float]:
    """A rollout's TIS metrics and policy loss (one step: ratio 1, token mean) from its dump and
    the weights it was trained from: w = min(pi_old / pi_engine, clip) per response token,
    pg_loss = mean(-advantage * w)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32).eval()
    weights, pg, plain, above, near = [], [], [], 0, 0
    with h5py.File(dump) as f, torch.no_grad():
        rows = zip(f["prompt_ids"][:], f["response_ids"][:], f["rollout_logprobs"][:], f["advantages"][:])
        for prompt, response, engine_lps, advantage in rows:
            prompt, response = prompt.tolist(), response.tolist()
            lp = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0], -1)
            old = torch.tensor([lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)])
            raw = torch.exp(old - torch.tensor(engine_lps.tolist()))
            weights += [(float(min(w, clip)), bool(w > clip)) for w in raw]
            above += int((raw > clip + 1e-5).sum())
            near += int((raw - clip).abs().le(1e-5).sum())
            pg += [-float(advantage) * min(float(w), clip) for w in raw]
            plain += [-float(advantage)] * len(raw)
    n = len(weights)
    return {
        "tis_weight": sum(w for w, _ in weights) / n,
        "tis_clipfrac": sum(c for _, c in weights) / n,
        "pg_loss": sum(pg) / n,
        "pg_loss_unweighted": sum(plain) / n,
        "tis_clipfrac_range": (above / n, (above + near) / n),
    }
