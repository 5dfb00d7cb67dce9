"""Two jobs never share a run dir: a second jobs/submit.py on a run with a live local job is
refused, naming the job, and changes nothing; once that job is gone the run dir is taken over.
A local job stops with its controller, and a kill stops it for good."""

import os
import signal
import subprocess
import time

from support.hold import HOLD_ENV
from support.jobs import HELD, REPO, job_args, kill_job, rollouts, submit
from support.other_user import require_second_user, shared_tmp_dir, what_the_other_user_reads

from rlhpc.invariants import processes_using
from rlhpc.launch.run_owner import liveness, read
from rlhpc.runtime.restarts import read_history
from rlhpc.util.processes import kill_groups, process_groups


def snapshot(run) -> dict:
    """What a second submission would write (the first job keeps writing checkpoints and metrics)."""
    files = [run / "config.yaml", run / "owner.json", run / "restarts.jsonl"]
    return {
        **{f.name: (f.stat().st_mtime_ns, f.read_text()) for f in files},
        "submitted": sorted(p.name for p in (run / "logs" / "submitit").glob("*_submitted.pkl")),
    }


CONFIG = (HELD, "rollout.num_rollout=3", "checkpoint.save_interval=1")


def wait_until(what, timeout: float, why: str) -> None:
    deadline = time.time() + timeout
    while not what():
        assert time.time() < deadline, why
        time.sleep(0.2)


def second_submission_and_the_other_user(run) -> None:
    """While a local job lives (held at its first reward): a second submission on its run dir is
    refused, naming the job, and writes nothing; another user of the machine, with the run dir
    where anyone can reach it (under a 1777 dir, as /tmp), tries to read the live run's engine
    key and Ray token, and gets neither, also once the run dir itself is opened to all (the
    key's own 0600)."""
    secrets = lambda: [run / "engine_key", *(run / "ray").glob("*/auth_token")]  # noqa: E731
    wait_until(lambda: all(p.is_file() for p in secrets()) and len(secrets()) == 2, 240, "no engine key and Ray token")
    owner = read(run)
    assert owner.kind == "local"
    before = snapshot(run)
    p = submit(run, *CONFIG)
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2 and f"in use by local job {owner.job_id}" in out and "fix:" in out, out[-2000:]
    assert snapshot(run) == before  # nothing written, nothing submitted
    assert read(run) == owner
    tried = what_the_other_user_reads(run, *secrets())
    assert set(tried.values()) == {"PermissionError"}, tried
    run.chmod(0o755)  # opened by hand: each file still refuses
    try:
        tried = what_the_other_user_reads(run, *secrets())
    finally:
        run.chmod(0o700)
    assert tried.pop(str(run)) == "read" and set(tried.values()) == {"PermissionError"}, tried


def test_one_job_per_run_dir_and_a_local_job_stops_with_its_controller(tmp_path):
    """Two jobs never share a run dir: while the first start lives, a second submission is refused
    (and the other user reads none of its secrets: ``second_submission_and_the_other_user``);
    once that job is gone (its controller SIGKILLed) the next submission takes the run dir over.
    One run for all (the refusal's own job and its takeover run were two job starts more)."""
    require_second_user()
    with shared_tmp_dir() as shared:
        stops_with_its_controller(shared / "run", tmp_path)


def stops_with_its_controller(run, tmp_path) -> None:
    # Issue 32, item 7: `kill PID` (what a refused submission says) restarted the job, and
    # `kill -9 PID` left its task training as an orphan in a run dir that looked free.
    hold = tmp_path / "hold"
    hold.touch()  # the job waits at its first reward while this exists
    env = {**os.environ, HOLD_ENV: str(hold)}
    args = [*job_args(run, *CONFIG), "--no-follow"]
    for kill in (signal.SIGKILL, signal.SIGTERM):
        # Output to a file: the controller left running holds it open (a pipe would never end).
        with open(tmp_path / f"submit-{kill.name}.log", "w+") as out:
            p = subprocess.run(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=240)
            out.seek(0)
            assert p.returncode == 0, out.read()[-3000:]
        controller = int(read(run).job_id)
        # globbed at each look: a submission that returns at once may return before the task's log exists
        logs = run / "logs" / "submitit"
        ray_up = lambda: any("local Ray up" in f.read_text() for f in logs.glob(f"{controller}_0_log.*"))  # noqa: E731, B023
        try:
            wait_until(ray_up, 240, "the job's Ray is not up")
            if kill == signal.SIGKILL:
                second_submission_and_the_other_user(run)
            else:  # the SIGKILLed start left its owner record: this submission took the run dir over
                assert "which is gone" in " ".join((tmp_path / "submit-SIGTERM.log").read_text().split())
        except BaseException:
            kill_groups(process_groups(controller))  # a failed check leaves no job held at its reward
            raise
        os.kill(controller, kill)
        if kill == signal.SIGTERM:
            hold.unlink()  # let it reach its next safe point, where it saves and stops
        wait_until(lambda: not processes_using(run), 120, f"left after {kill.name}: {processes_using(run)}")
        assert read(run) is None or liveness(read(run)).alive is False  # free for the next submission
    starts = read_history(run)
    assert len(starts) == 2, starts  # one start each: the SIGTERM was no restart
    assert not (run / "FINISHED").exists() and len(rollouts(run)) < 3  # stopped before the end, resumable

    # Issue 28: Ctrl-C in the terminal (SIGINT to its foreground group: the submission, following
    # the job) stops the job at its next safe point and says how to resume.
    hold.touch()
    follow = [a for a in args if a != "--no-follow"]
    # SIGINT as a terminal leaves it: a shell's background job (a CI runner's) starts with it ignored
    proc = subprocess.Popen(
        follow, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    try:
        started = lambda: (o := read(run)) is not None and o.kind == "local" and o.job_id != str(controller)  # noqa: E731
        wait_until(started, 240, "the job did not start")  # its own controller, not the last one's record
        logs = run / "logs" / "submitit"
        ray_up = lambda: any("local Ray up" in f.read_text() for f in logs.glob(f"{read(run).job_id}_0_log.*"))  # noqa: E731
        wait_until(ray_up, 240, "the job's Ray is not up")
        os.killpg(proc.pid, signal.SIGINT)
        hold.unlink()
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            kill_job(proc)
    said_ = " ".join(out.split())
    assert proc.returncode == 130, out[-3000:]
    assert "stopped at your request" in said_ and "run the same command again to resume" in said_, out[-3000:]
    wait_until(lambda: not processes_using(run), 120, f"left after Ctrl-C: {processes_using(run)}")
    assert len(read_history(run)) == 3 and not (run / "FINISHED").exists()
    p = subprocess.run(follow, cwd=REPO, capture_output=True, text=True, timeout=300)  # and the same command resumes
    assert p.returncode == 0 and (run / "FINISHED").exists(), p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(rollouts(run)) == [0, 1, 2]  # each rollout logged once
    assert not (run / "owner.json").exists()  # released when the run finished
