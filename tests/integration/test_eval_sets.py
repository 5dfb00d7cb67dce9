"""Named eval sets through a whole local run, and rlhpc-eval on its checkpoint: the same code and
the same weights give the same numbers the run logged at that rollout."""

import json
import stat
import subprocess
import sys

import pytest
from support.jobs import REPO, said, submit
from support.rewards import SCORED_ENV, pass_at_k_by_hand, scored

from rlhpc.metrics import read_metrics

EVAL = [sys.executable, "-m", "rlhpc.cli.evaluate"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Two rollouts, evaluated at the start, after each and saved after each, on two sets: the
    task's own rows (greedy) and a JSONL file under other keys, 2 samples each (pass@1, pass@2, maj@2)."""
    tmp = tmp_path_factory.mktemp("evalsets")
    rows = [{"q": f"{a}+{b}=", "sol": str((a + b) % 10), "set": "file"} for a in range(4) for b in range(3)]
    (tmp / "file.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp / "run"
    p = submit(
        run, "rollout.num_rollout=2", "eval.interval=1", "checkpoint.save_interval=1", "data.num_eval=16",
        "data.reward=support.rewards:odd_or_even", "eval.sets.toy.file=null",
        f"eval.sets.file.file={tmp}/file.jsonl", "eval.sets.file.prompt_key=q", "eval.sets.file.label_key=sol",
        "eval.sets.file.n_samples_per_prompt=2", "eval.sets.file.temperature=1.0",
        "deterministic=true",  # the sampled set's seeds honoured: rlhpc-eval gives the same numbers
        env={SCORED_ENV: str(tmp / "scored.jsonl")},
    )  # fmt: skip
    assert p.returncode == 0, said(p)
    return run


def test_each_set_is_logged_at_start_every_interval_and_the_end(run):
    evals = [r for r in read_metrics(run) if r["kind"] == "eval"]
    assert [r["rollout_id"] for r in evals] == [-1, 0, 1]
    for r in evals:
        names = {"toy/mean", "toy/pass@1", "file/mean", "file/pass@1", "file/pass@2", "file/maj@2"}
        assert {f"eval/{n}" for n in names} <= set(r)  # named as the reference names them
        assert "eval/reward" not in r  # no default set beside named ones
        assert r["eval/toy/pass@1"] == r["eval/toy/mean"]  # one greedy sample, a 0/1 reward
    # the file set's pass@k and maj@2 at each evaluation, from the samples its reward scored
    samples = scored(run.parent / "scored.jsonl", set="file")
    assert len(samples) == 3 * 12 * 2  # three evaluations of 12 prompts x 2 samples, one after the other
    for i, r in enumerate(evals):
        expected, (maj_low, maj_high) = pass_at_k_by_hand(samples[24 * i : 24 * (i + 1)], 2)
        assert {k: r[f"eval/file/{k}"] for k in expected} == pytest.approx(expected, abs=1e-9)
        assert maj_low - 1e-9 <= r["eval/file/maj@2"] <= maj_high + 1e-9
    assert any(0 < r["eval/file/pass@1"] < r["eval/file/pass@2"] < 1 for r in evals)  # something to count


def test_rlhpc_eval_of_a_checkpoint_equals_what_the_run_logged(run):
    p = subprocess.run(
        [*EVAL, str(run), "--checkpoint", "rollout_0"], capture_output=True, text=True, timeout=300, cwd=REPO,
        umask=0o022,
    )  # fmt: skip
    assert p.returncode == 0, said(p)
    written = json.loads((run / "evals" / "rollout_000000.json").read_text())
    logged = next(r for r in read_metrics(run) if r["kind"] == "eval" and r["rollout_id"] == 0)
    assert written["rollout_id"] == 0
    # under the run's own access (private), whatever the umask it was started with (022 here)
    assert stat.S_IMODE((run / "evals").stat().st_mode) == 0o700
    assert stat.S_IMODE((run / "evals" / "rollout_000000.json").stat().st_mode) == 0o600
    # greedy on the same weights: identical; sampled with the same per-sample seeds (deterministic): identical too
    assert written["metrics"] == {k: v for k, v in logged.items() if k not in ("kind", "rollout_id")}
    assert f"eval/toy/mean {logged['eval/toy/mean']:.4f}" in said(p)


def test_rlhpc_eval_refuses_a_missing_run_or_checkpoint(run, tmp_path):
    for args, words in (
        ([str(tmp_path / "nope")], "is not a run dir (it has no config.yaml)"),
        ([str(run), "--checkpoint", "rollout_7"], "pick one of: rollout_000000, rollout_000001"),
    ):
        p = subprocess.run([*EVAL, *args], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert p.returncode == 2 and words in said(p) and "Traceback" not in said(p), said(p)
    assert not (tmp_path / "nope").exists() and not (run / "evals" / "rollout_000007.json").exists()
