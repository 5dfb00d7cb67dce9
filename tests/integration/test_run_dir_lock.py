"""Two jobs never share a run dir: a second jobs/submit.py on a run with a live local job is
refused, naming the job, and changes nothing; once that job is gone the run dir is taken over."""

import os
import signal
import subprocess
import time

from support.jobs import REPO, job_args, rollouts, said, submit

from rlhpc.launch.run_owner import read


def snapshot(run) -> dict:
    """What a second submission would write (the first job keeps writing checkpoints and metrics)."""
    files = [run / "config.yaml", run / "owner.json", run / "restarts.jsonl"]
    return {
        **{f.name: (f.stat().st_mtime_ns, f.read_text()) for f in files},
        "submitted": sorted(p.name for p in (run / "logs" / "submitit").glob("*_submitted.pkl")),
    }


def test_second_submission_is_refused_while_the_first_job_lives(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen(
        job_args(run, "rollout.num_rollout=200"), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.time() + 240
        while not ((run / "metrics.jsonl").exists() and rollouts(run)):  # training: the job owns the run
            assert time.time() < deadline and first.poll() is None
            time.sleep(0.2)
        owner = read(run)
        assert owner.kind == "local"
        before = snapshot(run)
        p = submit(run, "rollout.num_rollout=200")
        out = " ".join((p.stdout + p.stderr).split())
        assert p.returncode == 2 and f"in use by local job {owner.job_id}" in out and "fix:" in out, out[-2000:]
        assert snapshot(run) == before  # nothing written, nothing submitted
        assert read(run) == owner
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # no chance to release: a stale owner is left
        first.wait()
    p = submit(run, "rollout.num_rollout=2")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "which is gone" in said(p)
    assert not (run / "owner.json").exists()  # released when the run finished
