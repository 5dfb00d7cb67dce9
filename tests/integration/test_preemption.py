"""Stop, save, requeue, resume with submitit's local executor: the same code path as on Slurm,
minus the scheduler (tests/test_slurm_preemption.py has the real one)."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.jobs import HELD, Gate, kill_job, rollout_logged

from rlhpc.checkpoint import CheckpointManager
from rlhpc.invariants import comparable, final_weights
from rlhpc.metrics import read_metrics
from rlhpc.runtime.restarts import read_history
from rlhpc.util.processes import process_groups

# The first test's setup makes the module's two runs (five job starts): over the default 600 s on a busy machine.
pytestmark = pytest.mark.timeout(1200)

REPO = Path(__file__).resolve().parents[2]
BASE = [
    "data.num_train=64",
    "rollout.rollout_batch_size=8",
    "rollout.n_samples_per_prompt=4",
    "logging.wandb_mode=disabled",
    "deterministic=true",
    "eval.interval=null",
]


# The runs compared with ``uninterrupted``: 12 rollouts, evaluated on two small sets after rollouts 5
# and 11 (and before the first). Two sets: a stop sent while the job is held at the first set's
# reward (scored once all its answers are in) lands inside the evaluation, in the second set's
# generation, however fast the machine.
TWELVE = ("rollout.num_rollout=12", "eval.interval=6", "data.num_eval=8", "eval.sets.first.file=null",
          "eval.sets.second.file=null")  # fmt: skip


def command(run: Path, *overrides: str) -> list[str]:
    cmd = [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "local", "--run-dir", str(run)]
    for o in (*BASE, *overrides):
        cmd += ["--set", o]
    return cmd


def start(run: Path, *overrides: str, env: dict | None = None, out=subprocess.PIPE) -> subprocess.Popen:
    """``out``: where its output goes (a file for a job that is killed: what a pipe held would be lost)."""
    return subprocess.Popen(
        command(run, *overrides), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, env={**os.environ, **(env or {})},
    )  # fmt: skip


def task_pid(run: Path) -> int:
    """The job's task process (what Slurm would signal), not submit.py or the local controller."""
    out = subprocess.run(["pgrep", "-f", f"submitit.core._submit {run}/logs/submitit"], capture_output=True, text=True)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, out.stdout
    return pids[0]


def trained(run: Path) -> list[int]:
    return [r["rollout_id"] for r in read_metrics(run) if r["kind"] == "rollout"]


def wait_for(cond, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, proc.stdout.read()[-4000:] if proc.stdout else f"ended with {proc.returncode}"
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    p = subprocess.run(
        command(run, *TWELVE, "checkpoint.save_interval=100"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return run


def evaluated(run: Path) -> list[int]:
    return [r["rollout_id"] for r in read_metrics(run) if r["kind"] == "eval"]


def task_said(run: Path) -> str:
    """What the job's task wrote to its stderr so far (submitit's log of it)."""
    return "".join(p.read_text() for p in (run / "logs" / "submitit").glob("*.err"))


HOLD_WRITES = REPO / "tests" / "support" / "hold_writes"  # a sitecustomize that holds the ranks' checkpoint writes


@pytest.fixture(scope="module")
def interrupted(uninterrupted, tmp_path_factory) -> tuple[Path, str, dict, subprocess.CompletedProcess]:
    """One run of the uninterrupted config, interrupted three times (the five tests below check
    different things of it; each fault is dealt while the job is held at a Gate, so a fast run
    cannot outrun it):
    - its first start stopped by SIGUSR2 after rollout 2, that stop's checkpoint write held
      until looked at (save_interval=100: the first write held is the stop's);
    - its second start stopped inside the evaluation after rollout 5 (held at the first of its
      two sets' reward: the stop lands in the second set's generation however fast the machine);
    - its third start stopped after rollout 8 and SIGKILLed while that stop's checkpoint write is
      held: mid-save, no cleanup of any kind; then submitted again, which finishes the run.
    The run dir, what the requeued job printed, what was seen at each fault, and the resubmission."""
    run = tmp_path_factory.mktemp("interrupted") / "run"
    writes = run.parent / "hold-writes"
    writes.write_text("")
    overrides = (*TWELVE, "checkpoint.save_interval=100", "logging.wandb_mode=offline", HELD)
    env = {"PYTHONPATH": f"{HOLD_WRITES}:{os.environ.get('PYTHONPATH', '')}", "RLHPC_TEST_HOLD_WRITES": str(writes)}
    gate = Gate(run.parent / "gate")
    gate.shut(*rollout_logged(run, 2))  # held at rollout 3's reward, however fast the run goes
    env.update(gate.env)
    log = run.parent / "submission.log"
    with log.open("w") as out:
        proc = start(run, *overrides, env=env, out=out)
    write_held = Path(f"{writes}.held")
    try:
        gate.wait_held(proc)
        os.kill(task_pid(run), signal.SIGUSR2)  # what Slurm sends before the time limit or on preemption
        gate.open()
        wait_for(write_held.exists, proc)  # the stop's snapshot is taken, its write held
        seen = {
            "latest": CheckpointManager(run / "checkpoints", 2).latest(),
            "starts": len(read_history(run)),
            "running": proc.poll() is None,
        }
        # rollout 5 is logged right before its evaluation: the second start is held at its first set
        gate.shut(*rollout_logged(run, 5))
        write_held.unlink()
        writes.unlink()
        gate.wait_held(proc)
        seen["evaluated_when_held"] = evaluated(run)
        seen["starts_when_held"] = len(read_history(run))
        os.kill(task_pid(run), signal.SIGUSR2)
        wait_for(lambda: task_said(run).count("got SIGUSR2") == 2, proc)  # recorded before the evaluation goes on
        gate.shut(*rollout_logged(run, 8))  # the evaluation goes on, cut short; the third start is held at rollout 9
        gate.wait_held(proc)
        writes.write_text("")  # the stop's file writes are held ...
        os.kill(task_pid(run), signal.SIGUSR2)
        wait_for(lambda: task_said(run).count("got SIGUSR2") == 3, proc)
        gate.open()
        wait_for(write_held.exists, proc)  # ... and one is: mid-save
        groups = process_groups(proc.pid)
        seen["killed"] = {
            "latest": CheckpointManager(run / "checkpoints", 2).latest(),
            "staging": sorted(p.name for p in (run / "checkpoints").glob(".staging-rollout_*")),
            "finished": (run / "FINISHED").exists(),
        }
        seen["wandb"] = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))  # the requeued starts'
        kill_job(proc, groups)  # mid-write, no cleanup of any kind
    finally:
        if proc.poll() is None:
            kill_job(proc)
    writes.unlink(missing_ok=True)
    out = log.read_text()
    resumed = subprocess.run(command(run, *overrides), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    return run, out, seen, resumed


def test_stop_signal_saves_requeues_and_ends_like_an_uninterrupted_run(uninterrupted, interrupted):
    run, out, seen, _ = interrupted
    assert "got SIGUSR2: stopping at the next safe point" in out

    history = read_history(run)
    assert [h["restart_count"] for h in history[:3]] == [0, 1, 2]
    stopped_at = history[1]["next_rollout_id"]
    assert 3 <= stopped_at <= 5  # the first stop, before the second start's rollout 5
    # No work lost: the emergency saves held every rollout logged before each stop.
    assert trained(run) == list(range(12))
    # Bit-identical to the run nobody interrupted.
    assert final_weights(run) == final_weights(uninterrupted)
    assert comparable(run) == comparable(uninterrupted)
    # Each requeued start continued the same wandb run rather than starting a new one.
    runs = {name.rsplit("-", 1)[1] for name in seen["wandb"]}
    assert len(runs) == 1 and len(seen["wandb"]) == 3


def test_a_stop_waits_for_the_background_save_to_commit(uninterrupted, interrupted):
    run, out, seen, _ = interrupted
    # While the write was held nothing was committed and the job had not requeued.
    assert {k: seen[k] for k in ("latest", "starts", "running")} == {"latest": None, "starts": 1, "running": True}
    history = read_history(run)
    stopped_at = history[1]["next_rollout_id"]
    # The requeued job resumed from the checkpoint the stop had in flight: no rollout recomputed.
    assert f"resuming from rollout_{stopped_at - 1:06d}" in " ".join(out.split()), out[-4000:]
    assert trained(run) == list(range(12))
    assert final_weights(run) == final_weights(uninterrupted)
    assert comparable(run) == comparable(uninterrupted)


def test_stop_signal_during_an_evaluation_is_a_safe_point(uninterrupted, interrupted):
    run, out, seen, _ = interrupted
    assert seen["starts_when_held"] == 2 and 5 not in seen["evaluated_when_held"]
    said = " ".join(out.split())  # unwrap rich lines
    # The second stop landed inside the evaluation (not at the next rollout): it was cut short,
    # rollout 5 saved, and the job requeued, not failed.
    assert "evaluation after rollout 5 cut short by a stop request" in said, out[-4000:]
    assert "saving rollout 5 before stopping" in said
    assert read_history(run)[2]["next_rollout_id"] == 6
    # At resume the cut evaluation ran once; every rollout and every eval logged exactly once.
    assert trained(run) == list(range(12))
    assert evaluated(run) == [-1, 5, 11]
    assert final_weights(run) == final_weights(uninterrupted)
    assert comparable(run) == comparable(uninterrupted)


def test_killed_run_resumes_from_last_checkpoint_and_ends_like_an_uninterrupted_run(uninterrupted, interrupted):
    """SIGKILLed once checkpoint 5 is written, resumed: every rollout once, and the metrics and
    final weights of the run nobody killed (the optimizer's and the RNG's state came back with
    the weights)."""
    run, _, seen, resumed = interrupted
    left = seen["killed"]
    assert left["latest"].rollout_id >= 5 and not left["finished"]
    assert f"resuming from rollout_{left['latest'].rollout_id:06d}" in resumed.stdout
    assert trained(run) == list(range(12))  # every rollout exactly once, none lost, none doubled
    assert comparable(run) == comparable(uninterrupted)
    assert final_weights(run) == final_weights(uninterrupted)


def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(uninterrupted, interrupted):
    run, _, seen, resumed = interrupted
    left = seen["killed"]
    ck = left["latest"]  # never the half-written one
    assert ck is not None and ".staging" not in str(ck.path)
    # The kill landed inside the third stop's save (held at rollout 9's reward: it saves rollout 8,
    # or trains 9 first and saves that): staged, not committed.
    assert ck.rollout_id == 5 and left["staging"] in ([".staging-rollout_000008"], [".staging-rollout_000009"])
    assert f"resuming from {ck.path.name}" in resumed.stdout
    assert trained(run) == list(range(12))
    assert not list((run / "checkpoints").glob(".staging-*"))
    assert comparable(run) == comparable(uninterrupted)
    assert final_weights(run) == final_weights(uninterrupted)


class FlakyGrader(BaseHTTPRequestHandler):
    """A grader that lives elsewhere (data.reward: URL): exact answers, until the file ``down``
    names exists; then every call is answered 503, as a service that went down."""

    down: Path

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).down.exists():
            self.send_response(503)
            self.end_headers()
            return
        out = json.dumps({"score": float(body["response"].startswith(body["label"]))}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


def test_restart_loop_is_held_with_a_message(tmp_path):
    """An infrastructure fault (a grader elsewhere that stays down) keeps its restarts: the job
    requeues itself until its restart policy holds it as a restart loop."""
    run = tmp_path / "run"
    FlakyGrader.down = tmp_path / "grader-down"
    server = ThreadingHTTPServer(("127.0.0.1", 0), FlakyGrader, bind_and_activate=False)
    server.request_queue_size = 64  # the job's calls come at once: a backlog of 5 would reset some
    server.server_bind()
    server.server_activate()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proc = start(
            run, "rollout.num_rollout=40", "checkpoint.save_interval=2",
            f"data.reward=http://127.0.0.1:{server.server_address[1]}/score", "checkpoint.max_starts_without_progress=1",
        )  # fmt: skip
        wait_for(lambda: (run / "checkpoints" / "latest").is_file(), proc)
        FlakyGrader.down.write_text("")  # from now on every generation fails: the resumed job fails at once
        os.kill(task_pid(run), signal.SIGUSR2)
        out, _ = proc.communicate(timeout=300)
    finally:
        server.shutdown()
    assert proc.returncode == 2, out[-4000:]
    said = " ".join(out.split())  # unwrap rich lines
    assert "no rollout was trained in between (a restart loop)" in said
    assert "ended without a result: not restarting: the last" in said  # how the local job ended, plainly
    history = read_history(run)
    # one good start, then two starts at the same rollout (max_starts_without_progress = 1): the second is refused
    assert len({h["next_rollout_id"] for h in history[1:]}) == 1 and len(history) == 3
    assert json.loads((run / "restarts.jsonl").read_text().splitlines()[-1])["restart_count"] == 2
    assert "/score raised MaxRetryError" in said and "503" in said  # and on what
    shown = subprocess.run([sys.executable, str(REPO / "jobs" / "status.py"), str(run)], capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    shown = " ".join(shown.stdout.split())
    assert "ended HELD (job" in shown and "no rollout was trained in between (a restart loop)" in shown
    assert "starts 3 (" in shown


def test_a_reward_that_raises_stops_the_job_at_once(tmp_path):
    """The user's own code raising is the user's error, not a fault to retry: the job stops at
    its first start, exit status non-zero, one error naming the function, the sample and the
    line it raised at; the status says why (before: three restarts, then held as a restart loop)."""
    run = tmp_path / "run"
    crash = tmp_path / "crash-now"
    crash.write_text("")
    env = {"PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}", "RLHPC_TEST_CRASH_FILE": str(crash)}
    p = subprocess.run(
        command(run, "rollout.num_rollout=4", "data.reward=support.crashy_reward:reward"), cwd=REPO,
        capture_output=True, text=True, timeout=300, env={**os.environ, **env},
    )  # fmt: skip
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-4000:]
    said = " ".join(out.split())
    error = "the reward support.crashy_reward:reward raised RuntimeError: simulated crash after resume on the sample"
    assert error in said and "crashy_reward.py:" in said and "in reward `raise RuntimeError(" in said
    assert "restarting" not in said and "restart loop" not in said
    assert len(read_history(run)) == 1  # one start, no requeue
    shown = subprocess.run([sys.executable, str(REPO / "jobs" / "status.py"), str(run)], capture_output=True, text=True)
    shown = " ".join(shown.stdout.split())
    assert "ended FAILED (job" in shown and error in shown and "starts 1 (" in shown
