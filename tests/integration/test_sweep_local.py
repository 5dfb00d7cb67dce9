"""A sweep on the local executor: its tasks one after another, each in its own run dir; --then after each."""

import subprocess

import yaml
from support.jobs import REPO, job_args, rollouts, said


def test_a_local_sweep_runs_its_tasks_in_turn_then_its_follow_ups(tmp_path):
    sweep = tmp_path / "sweep"
    args = [*job_args(sweep, "rollout.num_rollout=1", "eval.interval=null"), "--sweep", "seed=1,2",
            "--then", 'echo "$RLHPC_RUN_DIR ${PYTHONSAFEPATH:-as the user has it}" > "$RLHPC_RUN_DIR/then.txt"']  # fmt: skip
    p = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    tasks = [sweep / "task_000", sweep / "task_001"]
    for seed, task in zip((1, 2), tasks):
        assert rollouts(task) == [0] and yaml.safe_load((task / "config.yaml").read_text())["seed"] == seed
        # the user's own command: rlhpc's PYTHONSAFEPATH (its own processes') is not passed on
        assert (task / "then.txt").read_text().strip() == f"{task} as the user has it"
    # one after another: task 1 started after task 0 had finished
    assert (tasks[0] / "FINISHED").stat().st_mtime <= (tasks[1] / "restarts.jsonl").stat().st_mtime
    again = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert again.returncode == 0 and "are finished: not submitted again" in said(again)
