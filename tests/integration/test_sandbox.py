"""The sandbox for model-written code, for real on this node (bwrap, as the tests' user: root
here, so it also drops to nobody): what hostile code reaches and what it is scored; a sandbox
killed from outside or starved by the node is infrastructure, not the code's failure."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import pytest
import torch
from support.jobs import REPO, job_args
from support.sandboxed import RUN_ENV, kill_when_running

from rlhpc import rewards, sandbox
from rlhpc.algo.grpo import grpo_advantages
from rlhpc.config import SandboxConfig
from rlhpc.data.tasks import TASKS, load_split
from rlhpc.errors import InfrastructureFailure, RlhpcError
from rlhpc.metrics import read_metrics
from rlhpc.rollout.scoring import Sample, Scorer
from rlhpc.rollout.tools import Tools
from rlhpc.run_dir import RunDir
from rlhpc.runtime.startup import read_startup
from rlhpc.sandbox import backends
from rlhpc.sandbox.pool import SandboxPool
from rlhpc.wire.tool_calls import ParsedCall, parse_hermes

# A wall limit far above the CPU limit: spinning code meets its CPU limit first even on a loaded
# machine (the wall limit is waited out only by code that sleeps, which gets a pool of its own).
LIMITS = {"wall_s": 30.0, "cpu_s": 1.0, "memory_mb": 512, "processes": 16, "disk_mb": 8, "retries": 0}


@pytest.fixture(scope="module")
def pool():
    p = SandboxPool(SandboxConfig(pool_size=2, **LIMITS))
    p.start()
    yield p
    p.close()


def test_an_execution_sees_only_the_system_read_only_and_its_own_tmp(pool, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "engine_key").write_text("secret-engine-key")
    monkeypatch.setenv("RLHPC_ENGINE_KEY", "secret-engine-key")  # what the driver's environment may hold
    code = f"""
import os, glob
for path in [{str(run_dir / "engine_key")!r}, os.path.expanduser("~root/.bashrc"), "/etc/passwd", "/etc/munge/munge.key"]:
    try:
        open(path).read()
        print("READ", path)
    except OSError as e:
        print("no", path, type(e).__name__)
print("env", sorted(os.environ))
print("procs", sorted(int(p) for p in os.listdir("/proc") if p.isdigit()))
print("root", sorted(os.listdir("/")))
try:
    open("/usr/rlhpc-was-here", "w")
    print("WROTE /usr")
except OSError as e:
    print("no write", type(e).__name__)
open("/tmp/mine", "w").write("x")
print("uid", os.getuid())
"""
    r = pool.run(code)
    assert r.ok, r
    assert "READ" not in r.stdout and "WROTE" not in r.stdout, r.stdout
    assert "secret" not in r.stdout
    assert "env ['HOME', 'LANG', 'PATH', 'TMPDIR']" in r.stdout
    procs = [line for line in r.stdout.splitlines() if line.startswith("procs")][0]
    assert eval(procs.split(" ", 1)[1]) == [1, 2]  # the worker and the code: no other job's process
    root = eval([line for line in r.stdout.splitlines() if line.startswith("root")][0].split(" ", 1)[1])
    assert not {"home", "root", "work", "run", "var"} & set(root)
    assert "uid 65534" in r.stdout if os.geteuid() == 0 else f"uid {os.geteuid()}" in r.stdout
    # the next execution sees nothing of this one's files
    left = pool.run("import os; print(os.listdir('/tmp'), os.getcwd())").stdout.split()
    assert left[0] == f"['{left[1].removeprefix('/tmp/')}']", left  # its own working directory alone


def test_no_network(pool):
    r = pool.run("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)")
    assert r.status == "error" and "Network is unreachable" in r.stderr, r
    r = pool.run("import socket\nprint(socket.getaddrinfo('example.com', 80))")
    assert r.status == "error", r


def test_a_fork_bomb_is_held_to_the_process_limit_and_the_sandbox_serves_on(pool):
    box = set(pool.pids())
    r = pool.run("import os\nwhile True:\n    os.fork()")
    assert not r.infra and r.status in ("error", "ok", "timeout", "cpu_limit"), r
    assert "BlockingIOError" in r.stderr or "Resource temporarily unavailable" in r.stderr, r.stderr[-500:]
    after = pool.run("import os; print(len([p for p in os.listdir('/proc') if p.isdigit()]))")
    assert after.ok and after.stdout.strip() == "2", after  # nothing of the bomb survived it
    assert set(pool.pids()) == box  # the same warm sandboxes


def test_filling_the_disk_is_the_codes_failure_and_the_space_comes_back(pool):
    r = pool.run("f = open('/tmp/fill', 'wb')\nwhile True:\n    f.write(b'x' * 65536)")
    assert r.status in ("error", "crashed") and not r.infra, r
    assert "No space left" in r.stderr or "file past sandbox.disk_mb" in r.detail or "File too large" in r.stderr, r
    r = pool.run("open('/dev/shm/fill', 'wb').write(b'x' * (64 << 20))")
    assert r.status in ("error", "crashed"), r  # /dev/shm is as small
    r = pool.run("open('/tmp/again', 'wb').write(b'x' * (4 << 20)); print('ok')")
    assert r.ok, r


def test_code_that_runs_forever_is_cut_and_scored(pool):
    sleepy = SandboxPool(SandboxConfig(pool_size=1, **{**LIMITS, "wall_s": 2.0}))
    try:
        r = sleepy.run("import time\ntime.sleep(1000)")  # asleep: it had the CPU whenever it wanted it
    finally:
        sleepy.close()
    assert r.status == "timeout" and not r.infra, r
    r = pool.run("while True:\n    pass")  # spinning: its CPU limit ends it well before the wall limit
    assert r.status == "cpu_limit" and not r.infra, r
    r = pool.run("x = bytearray(1 << 30)")
    assert r.status == "error" and "MemoryError" in r.stderr, r


def test_the_code_cannot_kill_its_sandbox(pool):
    box = set(pool.pids())
    r = pool.run(
        "import os, signal\nfor s in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):\n    os.kill(1, s)\nprint('alive')"
    )
    assert r.ok and r.stdout == "alive\n", r
    r = pool.run("import os\nos.kill(os.getppid(), 9)\nos.kill(-1, 9)\nprint('after')")
    assert not r.infra, r  # what it killed was itself: its own failure
    assert pool.run("print(1)").ok
    assert set(pool.pids()) == box


def test_bash_runs_and_what_it_leaves_running_is_ended(pool):
    count = "n=0; for p in /proc/[0-9]*; do n=$((n+1)); done; echo $n"  # builtins only: no process of its own
    r = pool.run(f"sleep 300 &\n{count}", "bash")
    assert r.ok and r.stdout == "3\n", r  # the worker, this bash and its sleep
    assert pool.run(count, "bash").stdout == "2\n"  # the sleep is gone


def _host_processes_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid, *(q for p in map(int, out) for q in _host_processes_of(p))]


def test_a_sandbox_killed_from_outside_is_infrastructure_and_retried_in_a_fresh_one():
    p = SandboxPool(SandboxConfig(pool_size=1, **{**LIMITS, "retries": 1}))
    p.start()
    try:
        (first,) = p.pids()
        killed = threading.Event()

        def kill_when_running() -> None:
            while len(tree := _host_processes_of(first)) < 3:  # bwrap, the worker, the code's child
                time.sleep(0.02)
            for pid in reversed(tree):
                os.kill(pid, signal.SIGKILL)
            killed.set()

        threading.Thread(target=kill_when_running).start()
        r = p.run("import time\ntime.sleep(1.5)\nprint('done')")
        assert killed.is_set()
        assert r.ok and r.attempts == 2 and r.stdout == "done\n", r  # the retry ran in a fresh sandbox
        assert p.pids() != [first]
        assert p.counts["retries"] == 1
    finally:
        p.close()
    # no retry left: the execution's outcome is infrastructure, never the code's
    p = SandboxPool(SandboxConfig(pool_size=1, **LIMITS))
    p.start()
    try:
        (first,) = p.pids()

        def kill_outermost_when_running() -> None:
            while len(_host_processes_of(first)) < 3:
                time.sleep(0.02)
            os.kill(first, signal.SIGKILL)  # bwrap alone: the sandbox inside dies with it

        threading.Thread(target=kill_outermost_when_running).start()
        r = p.run("import time\ntime.sleep(1.5)\nprint('done')")
        assert r.status == "lost" and r.infra, r
        assert p.run("print(2)").ok  # a fresh sandbox takes its place
    finally:
        p.close()


def test_a_time_out_the_node_caused_is_infrastructure():
    """The code's process is starved on a CPU that five hogs of the host hold at a higher
    priority (it lowered its own to the floor): it spent the wall limit waiting to run, which
    the sandbox reads from the kernel's run delay, so the time-out is the node's."""
    # Each hog in a session of its own, as other jobs' processes are: with the kernel's autogroups
    # (sched_autogroup_enabled) a CPU is shared between sessions first, and the code, which runs
    # in a session of its own, would get half of it against any number of hogs in one session.
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", "import os\nos.sched_setaffinity(0, {0})\nwhile True: pass"], start_new_session=True
        )
        for _ in range(5)
    ]
    p = SandboxPool(SandboxConfig(pool_size=1, **{**LIMITS, "wall_s": 3.0, "cpu_s": 10.0}))
    try:
        p.start()
        r = p.run("import os\nos.sched_setaffinity(0, {0})\nos.nice(19)\nwhile True: pass")
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        p.close()
    assert r.status == "overloaded" and r.infra, r
    assert r.waited_s > 1.5 > r.cpu_s, r


def test_a_missing_bwrap_is_one_error_naming_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RlhpcError) as e:
        SandboxPool(SandboxConfig()).start()
    assert "bwrap" in e.value.problem and "bubblewrap" in e.value.fix


def test_apptainer_is_the_same_sandbox_as_a_command_line(tmp_path):
    image = tmp_path / "py.sif"
    cfg = SandboxConfig(backend="apptainer", image=str(image), binds=[str(tmp_path)])
    argv = backends.apptainer_command(cfg, "print(1)")
    assert argv[:2] == ["apptainer", "exec"]
    for flag in ("--containall", "--no-init", "--no-home", "--net"):
        assert flag in argv
    assert argv[argv.index("--network") + 1] == "none"
    assert f"{tmp_path}:{tmp_path}:ro" in argv
    assert argv[argv.index(str(image)) + 1 :] == ["python3", "-I", "-c", "print(1)", "isolated", "/tmp"]
    if backends.apptainer_binary() is None:  # not installed here: its absence is one clear error
        with pytest.raises(RlhpcError) as e:
            backends.check(cfg)
        assert "apptainer" in e.value.problem and "module" in e.value.fix


def test_the_subprocess_backend_runs_with_the_limits_and_no_isolation(tmp_path):
    p = SandboxPool(SandboxConfig(backend="subprocess", pool_size=1, **{**LIMITS, "wall_s": 2.0}))
    p.start()
    try:
        secret = tmp_path / "visible"
        secret.write_text("yes")
        r = p.run(f"print(open({str(secret)!r}).read())")
        assert r.ok and r.stdout == "yes\n", r  # no isolation at all: trusted code only
        assert p.run("import time\ntime.sleep(100)").status == "timeout"
        assert p.run("x = bytearray(1 << 30)").status == "error"
    finally:
        p.close()


def test_nothing_is_left_running(pool):
    pids = pool.pids()
    pool.close()
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


# ---------------------------------------------------------------- the code reward and the tools


@pytest.fixture
def configured():
    sandbox.configure(SandboxConfig(pool_size=2, **LIMITS))
    yield sandbox.pool()
    sandbox.close()


def sample(response: str, tests: str) -> Sample:
    return Sample(prompt="", response=response, label=tests)


def test_the_code_reward_runs_a_solution_against_each_form_of_tests(configured):
    stdio = json.dumps({"inputs": ["1 2\n", "5 7\n"], "outputs": ["3\n", "12"]})
    call = json.dumps({"inputs": [[1, 2], [3, 4]], "outputs": [3, [7]], "fn_name": "add"})
    asserts = json.dumps(["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 1"])
    solution = "```python\ndef add(a, b):\n    return a + b\n```"
    reads = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
    got = rewards.code(
        [
            sample(reads, stdio),
            sample(solution, call),
            sample(solution, asserts),
            sample("```python\ndef add(a, b):\n    return a - b\n```", call),
            # exits before any test ran: passes none of them
            sample("import os\ndef add(a, b):\n    return 0\nos._exit(0)", asserts),
            sample("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", stdio),
            sample("while True:\n    pass", call),
            sample("def add(a, b):\n    return a + b\n" + "assert add(1, 1) == 2", "assert add(2, 3) == 5"),
        ]
    )
    assert [g["score"] for g in got] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], got
    assert [round(g["passed"], 3) for g in got] == [1.0, 1.0, 0.667, 0.0, 0.0, 0.0, 0.0, 1.0], got


def test_the_code_tasks_rows_are_scored_by_running_their_answers(configured):
    """The built-in code task: each row's own solution passes all its asserts; an answer that
    runs but is wrong passes what it can (f(0) > 0); one that does not run, nothing."""
    rows = load_split(TASKS["code"], None, 12, seed=5)

    def scored(response: str, row) -> Sample:
        return Sample(prompt=row.prompt_text, response=response, label=row.label, row=row)

    right = TASKS["code"].reward([scored(r["solution"], r) for r in rows])
    assert right == [1.0] * len(rows)
    c = int(rows[0]["solution"][1:])
    wrong = TASKS["code"].reward([scored(f"+ {c % 9 + 1}", rows[0]), scored("", rows[0]), scored("+ ;", rows[0])])
    assert wrong == [0.2, 0.0, 0.0]  # a wrong digit passes "f(0) > 0"; x alone and a syntax error nothing


def test_a_sample_whose_sandbox_was_killed_from_outside_is_unscored_not_zero(configured):
    """The reward's sandbox is SIGKILLed mid-execution with no retry left: the sample's score is
    NaN (no reward), which the advantages and the loss masks leave out; the others score."""
    sandbox.configure(SandboxConfig(pool_size=1, **LIMITS))  # one sandbox: the kill hits the execution
    box = sandbox.pool()
    kill_when_running(box)
    scorer = Scorer(rewards.code, "rlhpc.rewards:code")
    slow = "import time\ntime.sleep(2)\ndef f():\n    return 1"
    scores, parts = scorer([sample(slow, "assert f() == 1"), sample("def f():\n    return 1", "assert f() == 1")])
    assert math.isnan(scores[0]) and scores[1] == 1.0, (scores, box.counts)
    assert box.counts["lost"] == 1
    adv = grpo_advantages(torch.tensor([scores[0], 1.0, 0.0, 1.0]), 4)
    assert adv[0] == 0 and torch.allclose(adv[1:], grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), 3))


def test_the_python_and_bash_tools_answer_what_ran(configured):
    assert sandbox.python("print(6 * 7)") == "42\n"
    assert sandbox.python("import sys\nprint('x')\nsys.exit(3)") == "x\n[exit status 3]"
    assert "ZeroDivisionError" in sandbox.python("1/0") and sandbox.python("1/0").endswith("[exit status 1]")
    assert sandbox.bash("echo $((6*7)); ls /proc/self >/dev/null") == "42\n"
    tools = Tools([sandbox.python, sandbox.bash], parse_hermes, 60)
    assert [s["function"]["name"] for s in tools.schemas] == ["python", "bash"]
    messages, counts = tools.run(
        [[ParsedCall("python", {"code": "print(1)"}), ParsedCall("bash", '{"command": "pwd"}')]]
    )
    assert [m["content"] for m in messages[0]] == ["1\n", messages[0][1]["content"]]
    assert messages[0][1]["content"].startswith("/tmp/run") and counts[0].errors == 0 and counts[0].infra == 0


def test_a_tool_whose_sandbox_could_not_run_ends_its_episode_unscored(configured):
    def flaky(code: str) -> str:
        """Fails as a sandbox killed from outside does."""
        raise InfrastructureFailure("the sandbox lost after 2 attempt(s)")

    messages, counts = Tools([flaky], parse_hermes, 60).run([[ParsedCall("flaky", {"code": "1"})]])
    assert counts[0].infra == 1 and counts[0].errors == 0


def test_a_job_scores_hostile_code_masks_a_killed_sandbox_and_goes_on(tmp_path):
    """A whole local job of the code task, with ``support.sandboxed:contained`` as its reward:
    every attack is held and scored 0, the sample whose sandbox was SIGKILLed from outside is
    unscored (NaN), masked out of the loss and of its group's baseline, and counted, and the job
    runs to its end."""
    run = tmp_path / "run"
    p = subprocess.run(
        job_args(
            run, "data.task=code", "rollout.max_new_tokens=2", "rollout.num_rollout=2", "eval.interval=null",
            "data.reward=support.sandboxed:contained", "sandbox.retries=0", "sandbox.wall_s=3", "sandbox.pool_size=2",
            "sandbox.disk_mb=64",
        ),
        capture_output=True, text=True, timeout=400, cwd=REPO, env={**os.environ, RUN_ENV: str(run)},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "sandbox_up" in [ph["phase"] for ph in read_startup(RunDir(run))]  # warmed at the start
    records = [m for m in read_metrics(run) if m["kind"] == "rollout"]
    assert [m["infra/failed"] for m in records] == [1.0, 1.0]
    for r in range(2):
        with h5py.File(run / "rollouts" / f"rollout_{r:06d}.h5") as f:
            rewards, advantages = f["rewards"][:], f["advantages"][:]
            masks = [list(m) for m in f["loss_mask"][:]]
        assert math.isnan(rewards[0]) and advantages[0] == 0.0 and not any(masks[0])
        assert rewards[1:7].tolist() == [0.0] * 6  # every attack held, and scored
        assert all(all(m) for m in masks[1:])
        group = torch.tensor(rewards[1:4])  # the rest of sample 0's group: its baseline without it
        assert torch.allclose(torch.tensor(advantages[1:4]), grpo_advantages(group, 3), atol=1e-6)
