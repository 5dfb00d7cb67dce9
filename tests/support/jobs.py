"""Whole jobs for tests: the jobs/submit.py command line of a fast local job, run it, kill it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rlhpc.metrics import read_metrics
from rlhpc.util.processes import kill_groups, process_groups
from support.hold import GATE_ENV, HOLD_ENV

REPO = Path(__file__).resolve().parents[2]  # the checkout
SUBMIT = [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "local"]
FAST = [
    "--set", "data.num_train=64",
    "--set", "rollout.rollout_batch_size=8",
    "--set", "rollout.n_samples_per_prompt=4",
    "--set", "logging.wandb_mode=disabled",
]  # fmt: skip


def deterministic_config(num_rollout: int, save_interval: int = 3) -> list[str]:
    """The ``--set`` values of a small deterministic run without evaluations: what an interrupted
    run of the same config must reproduce bit for bit."""
    return [
        "data.num_train=64",
        "rollout.rollout_batch_size=8",
        "rollout.n_samples_per_prompt=4",
        f"rollout.num_rollout={num_rollout}",
        "eval.interval=null",
        "logging.wandb_mode=disabled",
        "deterministic=true",
        f"checkpoint.save_interval={save_interval}",
    ]


def job_args(run_dir: Path, *overrides: str) -> list[str]:
    """The jobs/submit.py command line for a fast local job with ``--set`` overrides."""
    args = [*SUBMIT, "--run-dir", str(run_dir), *FAST]
    for o in overrides:
        args += ["--set", o]
    return args


def submit(
    run_dir: Path, *overrides: str, timeout: float = 300, cwd: Path = REPO, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a fast local job to its end; ``env`` added to this process's environment."""
    return subprocess.run(
        job_args(run_dir, *overrides), capture_output=True, text=True, timeout=timeout, cwd=cwd,
        env={**os.environ, **(env or {})},
    )  # fmt: skip


def slurm_args(
    run_dir: Path, *args: str, overrides: list[str] | tuple[str, ...] = (), follow: bool | None = None
) -> list[str]:
    """``jobs/submit.py --cluster slurm --run-dir RUN_DIR``, each override as ``--set``, then ARGS
    (a ``--set`` among them wins over an override of the same key), then ``--follow`` or
    ``--no-follow`` when ``follow`` is given."""
    cmd = [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "slurm", "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    cmd += args
    if follow is not None:
        cmd.append("--follow" if follow else "--no-follow")
    return cmd


def submit_slurm(
    run_dir: Path,
    *args: str,
    overrides: list[str] | tuple[str, ...] = (),
    follow: bool | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 400,
) -> subprocess.CompletedProcess:
    """Run ``slurm_args(...)`` to its end; ``env`` added to this process's."""
    cmd = slurm_args(run_dir, *args, overrides=overrides, follow=follow)
    env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)


class Beside:
    """``slurm_args(...)`` started in the background, so that its job runs beside a test's;
    ``result`` waits for it as ``submit_slurm`` would have (a ``--follow`` included)."""

    def __init__(self, run_dir: Path, *args: str, env: dict[str, str] | None = None, **kwargs) -> None:
        self.out = tempfile.TemporaryFile("w+")  # not a pipe: a full pipe would stall --follow
        cmd = slurm_args(run_dir, *args, **kwargs)
        self.args = cmd
        self.proc = subprocess.Popen(
            cmd, stdout=self.out, stderr=subprocess.STDOUT, text=True, cwd=REPO, env={**os.environ, **(env or {})}
        )
        # Slurm forgets an ended job after MinJobAge (30 s on the minicluster), and a job run
        # beside a longer test ends long before its own test asks: its last state is read here,
        # as its --follow returns
        self.final_state: str | None = None
        self._job_id = run_dir / "slurm_job_id"
        self._watch = threading.Thread(target=self._watch_state, daemon=True)
        self._watch.start()

    def _watch_state(self) -> None:
        from rlhpc.launch import slurm

        self.proc.wait()
        if not self._job_id.is_file():
            return
        job_id = self._job_id.read_text().strip()
        for _ in range(600):
            try:
                state = slurm.job_state(job_id)
            except Exception:  # the minicluster going down as the module ends: no state to read
                return
            if state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
                self.final_state = state
                return
            time.sleep(0.2)

    def result(self, timeout: float = 400) -> subprocess.CompletedProcess:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._watch.join(timeout)
        self.out.seek(0)
        return subprocess.CompletedProcess(self.args, code, self.out.read(), "")

    def stop(self) -> None:
        """Stop the submission (not its job) if it still runs."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def said(p: subprocess.CompletedProcess) -> str:
    """A command's stdout and stderr with every run of whitespace as one space: a log line off
    a terminal is wrapped at 120 columns, and where it wraps depends on the paths in it."""
    return " ".join(((p.stdout or "") + (p.stderr or "")).split())


def routed(run_dir: Path, group: str = "") -> bool:
    """Whether a run's engine group (``group``: "" the rollout engines, "reward", "teacher") had
    the real sglang_router in front (``rollout.sglang.router``): its log holds its start."""
    log = run_dir / "logs" / "engines" / group / "router.log"
    return log.is_file() and "sglang router starting on port" in log.read_text()


def rollouts(run_dir: Path) -> list[int]:
    return [r["rollout_id"] for r in read_metrics(run_dir) if r["kind"] == "rollout"]


HELD = "data.reward=support.hold:digit_sum"  # the default task's reward, held for ``kill_when``


def kill_job(proc: subprocess.Popen, groups: list[int] | None = None) -> None:
    """SIGKILL a submission and its local job, as a crash would: the submitter's process group
    and the job's (its controller leads a session of its own). ``groups``: from
    ``process_groups`` taken earlier, for a kill that must land within milliseconds."""
    kill_groups(groups if groups is not None else process_groups(proc.pid))
    proc.wait()


def kill_when(args: list[str], path: Path, timeout: float = 300, env: dict[str, str] | None = None) -> None:
    """Run a job until ``path`` exists, then SIGKILL it all: no chance to clean up or save. The
    job scores with a reward of ``support.hold`` (``HELD``), which holds it still once ``path``
    exists, so what the kill leaves is the state the test chose however fast the job runs. A job
    that ends or stalls first fails the test with the tail of what it printed. ``env``: added to
    the job's environment."""
    assert any("support.hold:" in a for a in args), f"kill_when needs a held reward: add --set {HELD}"
    env = {**os.environ, **(env or {}), HOLD_ENV: str(path)}
    with tempfile.TemporaryFile("w+") as out:
        # A new session, like a terminal (the job's controller makes a session of its own).
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        deadline = time.time() + timeout
        while not path.exists():
            if time.time() > deadline or proc.poll() is not None:
                ended = f"exited with {proc.returncode}" if proc.poll() is not None else "still running"
                if proc.poll() is None:
                    kill_job(proc)
                out.seek(0)
                raise AssertionError(f"no {path.name} within {timeout:.0f} s; the job {ended}:\n{out.read()[-4000:]}")
            time.sleep(0.2)
        kill_job(proc)


class Gate:
    """Holds a job (scoring with a reward of ``support.hold``, e.g. ``HELD``, and ``env`` in its
    environment) at its first reward after a condition, until the test lets it go on: a stop
    signal, a stopped rank or a killed engine then lands at a point the test chose, however fast
    the job runs. ``shut`` names the condition, ``wait_held`` waits for the job to be held there,
    ``open`` lets it go on."""

    def __init__(self, path: Path):
        self.path, self.held = path, path.with_name(path.name + ".held")
        self.text = ""

    @property
    def env(self) -> dict[str, str]:
        return {GATE_ENV: str(self.path)}

    def shut(self, when: Path, contains: str | None = None) -> None:
        """Hold once ``when`` exists (``contains``: once it holds that text)."""
        self.text = json.dumps({"path": str(when), "contains": contains})
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(self.text)
        os.replace(tmp, self.path)  # a job held by the gate before goes on, unless this holds too

    def is_held(self) -> bool:
        """Whether the job is held by the condition shut last (a Slurm job's test polls this)."""
        return self.held.exists() and self.held.read_text() == self.text

    def wait_held(self, proc: subprocess.Popen, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while not self.is_held():
            if proc.poll() is not None:
                out = proc.stdout.read()[-4000:] if proc.stdout else ""
                raise AssertionError(f"the job ended (exit {proc.returncode}) before it was held:\n{out}")
            assert time.time() < deadline, f"the job was not held within {timeout:.0f} s"
            time.sleep(0.05)

    def open(self) -> None:
        self.path.unlink(missing_ok=True)


def rollout_logged(run_dir: Path, rollout_id: int) -> tuple[Path, str]:
    """A gate's condition: rollout ``rollout_id``'s line is in the run's metrics (it is trained)."""
    return run_dir / "metrics.jsonl", f'{{"kind": "rollout", "rollout_id": {rollout_id},'
