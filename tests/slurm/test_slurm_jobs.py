"""Real Slurm jobs on the minicluster: jobs/submit.py -> sbatch -> Ray across the nodes -> the loop."""

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.jobs import Beside, said, submit_slurm

from rlhpc.launch import slurm
from rlhpc.launch.ray_cluster import RayPorts, block_index
from rlhpc.metrics import read_metrics

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
SMALL = [
    "--set", "data.num_train=64",
    "--set", "rollout.rollout_batch_size=8",
    "--set", "rollout.n_samples_per_prompt=4",
    "--set", "rollout.num_rollout=2",
    "--set", "eval.interval=null",
    "--set", "logging.wandb_mode=disabled",
]  # fmt: skip


def submit(run_dir: Path, *args: str, follow: bool = True, timeout: float = 400) -> subprocess.CompletedProcess:
    return submit_slurm(run_dir, "--time", "15", *SMALL, *args, follow=follow, timeout=timeout)


def job_log(run_dir: Path) -> str:
    return "".join(p.read_text() for p in sorted((run_dir / "logs" / "submitit").glob("*_0_log.*")))


def wait_gone(job_id: str, timeout: float = 300) -> str:
    """Wait until the job left the active states; return its final state ("" if forgotten)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True).stdout
        state = re.search(r"JobState=(\S+)", out)
        if not state or state.group(1) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED"):
            return state.group(1) if state else ""
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} still active after {timeout}s")


def no_ray_left(job_id: str) -> bool:
    return subprocess.run(["pgrep", "-f", f"rlhpc-{job_id}-"], capture_output=True).returncode != 0


def queued_ids() -> set[str]:
    """The ids Slurm lists now. Compared as "none added": a job of an earlier test may still be
    leaving the queue meanwhile."""
    return set(subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split())


@pytest.fixture(scope="module")
def beside(minicluster, tmp_path_factory) -> Iterator[dict[str, tuple[Path, Beside]]]:
    """Jobs submitted as the four-node test starts, each run beside it and checked by a test of its
    own (they fit beside it: 2 GPUs a node each): the three-node job and the job whose reward
    raises, both on node0, where the four-node job's head is too (three jobs' Ray on one node).
    Their submissions and jobs are stopped at the end if still there (a test run with -k)."""
    three = tmp_path_factory.mktemp("three-nodes") / "run dir;$(touch pwned)'\""
    crash_dir = tmp_path_factory.mktemp("crash")
    crash, crash_run = crash_dir / "crash-now", crash_dir / "run"
    crash.write_text("")
    env = {"PYTHONPATH": f"{REPO / 'tests'}:{os.environ.get('PYTHONPATH', '')}", "RLHPC_TEST_CRASH_FILE": str(crash)}
    started = {
        # 3 x 2 GPUs: actor ranks on slots 0-2 (node A both GPUs + node B), engines on slots 3-4.
        "three_nodes": (three, Beside(three, "--time", "15", *SMALL, "--nodes", "3", "--gpus-per-node", "2",
                                      "--set", "cluster.actor_num_gpus=3", "--set", "cluster.rollout_num_gpus=2",
                                      "--sbatch", "nodelist=node[0-2]", "--follow")),
        "crash": (crash_run, Beside(crash_run, "--time", "15", *SMALL, "--nodes", "1", "--gpus-per-node", "2",
                                    "--set", "data.reward=support.crashy_reward:reward", "--sbatch", "nodelist=node0",
                                    "--follow", env=env)),
    }  # fmt: skip
    yield started
    for run, submission in started.values():
        submission.stop()
        job = run / "slurm_job_id"
        if job.is_file() and slurm.job_state(job.read_text().strip()) not in (None, "COMPLETED", "FAILED"):
            subprocess.run(["scancel", job.read_text().strip()])


def test_four_nodes_actor_and_rollout_on_different_nodes(minicluster, beside, tmp_path):
    # beside: the module's other whole jobs are submitted first, to run beside this one
    run, stage = tmp_path / "run", tmp_path / "node-local"  # one disk here, as if on each node
    p = submit(
        run,
        "--nodes", "4",
        "--gpus-per-node", "2",  # 2 ranks + 2 engines: 16 of each took 150 s of two cores to start
        "--set", "cluster.actor_num_gpus=2",
        "--set", "cluster.rollout_num_gpus=2",
        "--set", f"cluster.stage_dir={stage}",
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert [r["rollout_id"] for r in read_metrics(run) if r["kind"] == "rollout"] == [0, 1]
    log = job_log(run)
    # staged start: task 0 sbcast the model to the 4 nodes, the engines served that copy, all removed
    flat = " ".join(log.split())
    assert "staged base_model in" in flat and "sbcast to every node)" in flat, log[-3000:]
    engine_logs = "".join(p.read_text() for p in (run / "logs" / "engines").glob("*.log"))
    assert f"serving {stage}/rlhpc-" in engine_logs
    assert "Ray cluster ready: 4 nodes, 8 GPUs" in log
    # both ranks on one node (they meet in a file there, issue 43 item 7): the node the log names
    ranks = re.search(r"actor group: 2 rank\(s\) on slots \S+ \S+ \((.*?)\), rendezvous", flat)
    assert ranks, flat[-3000:]
    actor_ips = set(re.findall(r"([\d.]+) \(GPU \d+\)", ranks.group(1)))
    assert len(actor_ips) == 1, ranks.group(0)
    actor_ip = actor_ips.pop()
    engine_ips = set(re.findall(r"http://([\d.]+):\d+", log))  # engine URLs are the only http:// in the log
    assert actor_ip in minicluster.node_ips.values()
    assert engine_ips and actor_ip not in engine_ips  # 2 actor GPUs fill one node; engines on another
    job_id = (run / "slurm_job_id").read_text().strip()
    state = run / "ray" / f"job_{job_id}.0"  # first attempt of the job
    # The head runs on task 0's node, published through the run dir (placement may put the
    # actor ranks on any node, so the head is not compared with them).
    head_ip = json.loads((state / "head.json").read_text())["address"].split(":")[0]
    assert head_ip == json.loads((state / "node_0.json").read_text())["ip"]
    assert head_ip in minicluster.node_ips.values()
    assert (state / "auth_token").stat().st_mode & 0o777 == 0o600
    token = (state / "auth_token").read_text()
    assert token not in (run / "logs" / "submitit" / f"{job_id}_submission.sh").read_text() and token not in log
    wait_gone(job_id)
    assert no_ray_left(job_id)
    assert list(stage.iterdir()) == []  # every task removed its copy


def test_three_nodes_uneven_layout_in_a_run_dir_with_any_characters(minicluster, beside):
    # Submitted beside the four-node test (``beside``); 3 x 2 GPUs: actor ranks on slots 0-2 (node A
    # both GPUs + node B), engines on slots 3-4. The run dir's name has a space, quotes and a command
    # (issue 32, item 8): one word everywhere.
    run, submission = beside["three_nodes"]
    p = submission.result()
    assert p.returncode == 0, p.stdout[-8000:]
    log = job_log(run)
    assert "actor group: 3 rank(s)" in log and "Ray cluster ready: 3 nodes, 6 GPUs" in log
    assert (run / "FINISHED").is_file()
    assert not (REPO / "pwned").exists() and not list(run.parent.rglob("pwned"))  # the job's cwd is REPO


def test_two_jobs_share_a_node(minicluster, beside):
    # The three-node job and the job whose reward raises (``beside``), both with their head on node0
    # at once (the crash comes at the first reward, after Ray, the ranks and the engines started):
    # Ray ports and temp dirs must not collide. Each ran as its own test says.
    runs = [beside["three_nodes"][0], beside["crash"][0]]
    for _, submission in beside.values():
        submission.result()
    ids = [(run / "slurm_job_id").read_text().strip() for run in runs]
    for job_id in ids:
        wait_gone(job_id)
    # the ports each head chose (and published for its workers) differ
    heads = [json.loads((run / "ray" / f"job_{j}.0" / "head.json").read_text()) for run, j in zip(runs, ids)]
    assert [h["address"].split(":")[0] for h in heads] == [minicluster.node_ips["node0"]] * 2
    assert heads[0]["ports"]["gcs"] != heads[1]["ports"]["gcs"]
    assert all(no_ray_left(j) for j in ids)
    # node-local temp dirs removed: the ones these jobs' tasks said they used (node files)
    used = [json.loads(f.read_text())["temp_dir"] for run in runs for f in (run / "ray").glob("job_*/node_*.json")]
    assert len(used) == 3 + 1 and not [d for d in used if Path(d).exists()], used


def test_node_whose_ray_cannot_start_fails_clearly(minicluster, tmp_path):
    run = tmp_path / "run"
    p = submit(
        run,
        "--nodes",
        "2",
        "--gpus-per-node",
        "2",
        "--sbatch",
        "nodelist=node0,node1",
        "--sbatch",
        "hold",
        "--set",
        "cluster.ray_start_timeout_s=25",
        follow=False,
    )
    assert p.returncode == 0, p.stderr
    job_id = (run / "slurm_job_id").read_text().strip()
    # Something else on node1 holds the raylet port of every block its Ray may use (a taken
    # block is skipped for the next): that node's Ray cannot start.
    ports = [b.node_manager for b in RayPorts.candidates(block_index(job_id))]
    squatter = subprocess.Popen(
        ["nsenter", f"--net=/var/run/netns/{minicluster.netns('node1')}", sys.executable, "-c",
         "import socket,time\nheld = []\n"
         f"for port in {ports}:\n"
         "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
         "    s.bind(('0.0.0.0', port)); s.listen(); held.append(s)\n"
         "print('held', flush=True)\ntime.sleep(300)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert squatter.stdout.readline().strip() == "held", "the squatter could not hold the ports"  # bound: go
        subprocess.run(["scontrol", "release", job_id], check=True)
        state = wait_gone(job_id, timeout=180)
    finally:
        squatter.kill()
        squatter.wait()
    log = job_log(run)
    assert "Ray cluster not ready after 25s" in log, log[-3000:]
    assert "never joined: task 1 (10.77.0.11; log" in log
    # FAILED at the Ray deadline; the time limit would have ended it TIMEOUT
    assert not (run / "FINISHED").exists() and state == "FAILED"
    assert no_ray_left(job_id)


def test_a_reward_that_raises_fails_the_job_at_once_without_a_requeue(minicluster, beside):
    """The user's own reward raising (issue 42): the job ends FAILED at its first start, with the
    default checkpoint.requeue_on_failure, never requeued or held; --follow and the status say why.
    Submitted beside the four-node test (``beside``)."""
    run, submission = beside["crash"]
    p = submission.result()
    error = "the reward support.crashy_reward:reward raised RuntimeError: simulated crash after resume on the sample"
    assert p.returncode == 2 and error in said(p), said(p)[-3000:]
    job_id = (run / "slurm_job_id").read_text().strip()
    assert submission.final_state == "FAILED"  # read as its --follow returned (Slurm forgets)
    info = subprocess.run(["scontrol", "show", "job", job_id, "-o"], capture_output=True, text=True).stdout
    assert "Restarts=0" in info or not info  # never requeued (forgotten already: nothing to read)
    assert len((run / "restarts.jsonl").read_text().splitlines()) == 1
    shown = subprocess.run([sys.executable, str(REPO / "jobs" / "status.py"), str(run)], capture_output=True, text=True)
    status_text = " ".join(shown.stdout.split())  # status aligns its columns with spaces
    assert "ended FAILED" in status_text and error in status_text, shown.stdout
    assert no_ray_left(job_id)


def test_a_run_dir_with_a_live_job_is_refused_and_following_a_held_job_returns(minicluster, tmp_path):
    run = tmp_path / "run"
    small = ["--nodes", "1", "--gpus-per-node", "2"]
    # --follow on a job held from the start returns, saying it is held and how to release it
    p = submit(run, *small, "--sbatch", "hold", timeout=120)
    out = " ".join((p.stdout + p.stderr).split())
    job_id = (run / "slurm_job_id").read_text().strip()
    try:
        assert p.returncode == 2 and f"job {job_id} is held" in out and f"scontrol release {job_id}" in out, out
        before = {f: (run / f).read_text() for f in ("config.yaml", "owner.json", "slurm_job_id")}
        queued = queued_ids()
        again = submit(run, *small, follow=False, timeout=120)
        out = " ".join((again.stdout + again.stderr).split())
        assert again.returncode == 2 and f"in use by Slurm job {job_id}" in out and f"scancel {job_id}" in out, out
        assert {f: (run / f).read_text() for f in before} == before  # nothing written
        assert not queued_ids() - queued  # nothing submitted
    finally:
        subprocess.run(["scancel", job_id])
    wait_gone(job_id)
    third = submit(run, *small, "--sbatch", "hold", follow=False, timeout=120)  # the owner is gone: accepted
    new_id = (run / "slurm_job_id").read_text().strip()
    subprocess.run(["scancel", new_id])
    assert third.returncode == 0 and new_id != job_id, third.stderr[-2000:]
    assert "which is gone" in said(third)


def test_job_state_tells_a_forgotten_job_from_a_controller_that_does_not_answer(minicluster, tmp_path, monkeypatch):
    """Gone only when Slurm says so; an unanswered scontrol raises (run_owner then refuses, see its unit tests)."""
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--output=/dev/null", "--wrap=true"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        assert slurm.job_state(job_id) == "PENDING"
        assert slurm.job_state("987654321") is None  # "Invalid job id specified"
        conf = Path(os.environ["SLURM_CONF"]).read_text()
        silent = tmp_path / "slurm.conf"  # the same cluster, asked on port 1 (nobody listens)
        silent.write_text(re.sub(r"^SlurmctldPort=\d+", "SlurmctldPort=1", conf, flags=re.M))
        monkeypatch.setenv("SLURM_CONF", str(silent))
        with pytest.raises(slurm.SlurmUnreachable, match=f"job {job_id}"):
            slurm.job_state(job_id, attempts=1)  # scontrol itself tries for ~8 s
    finally:
        monkeypatch.undo()
        subprocess.run(["scancel", job_id])


@pytest.mark.parametrize(
    "args,message",
    [
        (["--nodes", "5", "--gpus-per-node", "8"], "--nodes 5 but partition 'low' has 4 nodes"),
        (
            ["--nodes", "1", "--gpus-per-node", "9", "--set", "cluster.actor_num_gpus=1"],
            "--gpus-per-node 9 but nodes in partition 'low' have 8 GPUs",
        ),
        (["--partition", "gpu-nope"], "partition 'gpu-nope' does not exist"),
        (["--nodes", "0"], "cluster.num_nodes = 0 must be >= 1"),
        (["--nodes", "1", "--gpus-per-node", "2", "--set", "cluster.actor_num_gpus=2"], "the layout needs 3 GPUs"),
    ],
    ids=["too-many-nodes", "too-many-gpus", "unknown-partition", "zero-nodes", "layout-too-big"],
)
def test_bad_requests_are_refused_before_submission(minicluster, tmp_path, args, message):
    run = tmp_path / "run"
    before = queued_ids()
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--cluster", "slurm", "--run-dir", str(run), *SMALL, *args],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 2 and message in out and "fix:" in out, out[-2000:]
    assert not run.exists()  # nothing written
    assert not queued_ids() - before  # nothing submitted (a job of an earlier test may be leaving the queue)


def test_granted_gpus_must_match_the_config(minicluster, tmp_path):
    # The run dir says 2 GPUs per node; the allocation grants 1 (a template submitted with
    # the wrong --gpus-per-node): the task stops with a clear error instead of hanging.
    run = tmp_path / "run"
    prep = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--prepare-only", "--cluster", "slurm", "--run-dir", str(run),
         "--nodes", "1", "--gpus-per-node", "2", *SMALL],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert prep.returncode == 0, prep.stderr
    p = subprocess.run(
        ["srun", "-N1", "--gpus-per-node=1", "-t", "5", sys.executable, "-m", "rlhpc.launch.task", str(run)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode != 0
    assert "Slurm granted 1 GPUs" in out and "cluster.gpus_per_node = 2" in out and "fix:" in out, out[-2000:]
