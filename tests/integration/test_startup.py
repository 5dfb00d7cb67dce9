"""Every start of a job times its start-up phases into the run dir and the log, and
jobs/status.py shows the newest start's. Real local jobs through jobs/submit.py."""

from __future__ import annotations

import json
import subprocess
import sys

from support.jobs import HELD, REPO, job_args, kill_when, rollouts

from rlhpc.run_dir import RunDir
from rlhpc.runtime.restarts import read_history
from rlhpc.runtime.startup import PHASES, read_startup


def status(run) -> str:
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "status.py"), str(run)], capture_output=True, text=True, cwd=REPO
    )
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


# every phase but the sandbox's, which only a run that runs code in it has (tests/integration/test_sandbox.py's job),
# and the FP8 copy's, which only an FP8 rollout's first start writes (tests/integration/test_fp8_rollout.py's job)
EVERY_RUN = [p for p in PHASES if p not in ("sandbox_up", "quantize")]


def test_every_start_records_its_phases_and_status_shows_the_newest(tmp_path):
    run, stage = tmp_path / "run", tmp_path / "node-local"  # staged start: the copies land in stage
    args = job_args(
        run,
        "rollout.num_rollout=3",  # killed at rollout 2, which the second start trains (each evaluated)
        "eval.interval=1",
        "data.num_eval=8",  # an evaluation's phase is timed, whatever its size
        "checkpoint.save_interval=1",
        f"cluster.stage_dir={stage}",
        HELD,
    )
    kill_when(args, run / "checkpoints" / "rollout_000001")  # killed after its first rollout
    assert str(stage / "rlhpc-") in (run / "logs" / "engines" / "engine_0.log").read_text()  # served the copy

    first = read_startup(RunDir(run))
    assert [ph["phase"] for ph in first] and sorted(ph["phase"] for ph in first) == sorted(EVERY_RUN)
    for ph in first:
        assert 0 <= ph["began_s"] <= ph["ended_s"] and ph["seconds"] >= 0
    by_name = {ph["phase"]: ph for ph in first}
    # the engines start before the actor ranks do, and the ranks before the engines are awaited
    assert by_name["engines_up"]["began_s"] <= by_name["actor_up"]["began_s"] < by_name["weight_channel"]["began_s"]
    assert by_name["first_rollout"]["ended_s"] == max(ph["ended_s"] for ph in first)

    shown = status(run)
    assert "first rollout after" in shown
    for name in EVERY_RUN:
        assert f"  {name} " in shown

    # The resumed start appends its own phases and logs them; status shows those.
    again = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert rollouts(run) == [0, 1, 2]
    assert "start-up: job start -> first rollout" in again.stdout
    # the second start stages the checkpoint it resumes from (the model's copy, left by the kill, is current)
    resumed = f"rollout_{read_history(run)[-1]['next_rollout_id'] - 1:06d}"
    assert f"staged base_model, {resumed} in" in " ".join(again.stdout.split()), again.stdout[-3000:]
    assert list(stage.iterdir()) == []  # removed at the end
    lines = [json.loads(line) for line in RunDir(run).startup_file.read_text().splitlines()]
    starts = {(line["job_id"], line["started_at"]) for line in lines}
    assert len(starts) == 2
    second = read_startup(RunDir(run))
    assert {ph["phase"] for ph in second} >= set(EVERY_RUN) - {"first_eval"}  # no eval if the kill came after it
    assert (second[0]["job_id"], second[0]["started_at"]) != (first[0]["job_id"], first[0]["started_at"])
    assert f"job {second[0]['job_id']} started {second[0]['started_at']}" in status(run)
