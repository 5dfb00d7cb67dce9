"""slurm_templates/: the plain template trains on the minicluster through real sbatch; the
container templates (no enroot or apptainer here) parse and run the same two commands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "slurm_templates"
NAMES = ("plain.sbatch", "pyxis.sbatch", "apptainer.sbatch")
OVERRIDES = [
    "--set rollout.num_rollout=3",
    "--set data.num_train=64",
    "--set rollout.rollout_batch_size=8",
    "--set rollout.n_samples_per_prompt=4",
    "--set eval.interval=null",
    "--set logging.wandb_mode=disabled",
    "--set cluster.actor_num_gpus=2",
    "--set cluster.rollout_num_gpus=2",
]
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED"}
PREPARE = 'python "$RLHPC_HOME/jobs/submit.py" --prepare-only'
TASK = 'python -P -m rlhpc.launch.task "$RUN_DIR" &'


def job_state(job_id: str) -> str | None:
    """JobState from scontrol (the minicluster has no sacct); None once Slurm forgot the job."""
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    m = re.search(r"\bJobState=(\S+)", out)
    return m.group(1) if m else None


def wait_done(job_id: str, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while (state := job_state(job_id)) in ACTIVE:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            raise AssertionError(f"job {job_id} still {state} after {timeout:.0f}s; cancelled")
        time.sleep(0.5)
    return state


def logs(run: Path) -> str:
    files = sorted(run.glob("slurm-*.out")) + sorted((run / "logs").glob("slurm-*.out"))
    return "\n".join(f"==> {f.name}\n{f.read_text()[-3000:]}" for f in files)


@pytest.mark.slurm
def test_plain_template_trains_on_two_nodes(minicluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()  # sbatch's --output directory must exist when the job starts
    in_venv = sys.prefix != sys.base_prefix
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    export = ",".join(
        [
            "--export=ALL",
            f"CONFIG={REPO / 'jobs' / 'configs' / 'embedded.yaml'}",
            f"RUN_DIR={run}",
            f"OVERRIDES={' '.join(OVERRIDES)}",
            f"VENV={sys.prefix if in_venv else ''}",  # the template activates the venv tests run in
        ]
    )
    started = time.monotonic()
    sbatch = subprocess.run(
        ["sbatch", "--parsable", "--nodes", "2", "--gpus-per-node", "2", "--partition", "low", "--time", "10",
         "--output", f"{run}/slurm-%j.out", export, str(TEMPLATES / "plain.sbatch")],
        capture_output=True, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    assert sbatch.returncode == 0, sbatch.stderr
    job_id = sbatch.stdout.strip().split(";")[0]
    state = wait_done(job_id, timeout=240)
    elapsed = time.monotonic() - started

    assert state in ("COMPLETED", None), f"job {job_id} ended {state}\n{logs(run)}"
    assert (run / "FINISHED").is_file(), logs(run)
    rollouts = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rollouts if r.get("kind") == "rollout"] == [0, 1, 2]
    assert (run / "slurm_job_id").read_text().strip() == job_id
    task0 = (run / "logs" / f"slurm-{job_id}-task0.out").read_text()
    assert "Ray cluster ready: 2 nodes, 4 GPUs" in task0
    assert (run / "logs" / f"slurm-{job_id}-task1.out").is_file()
    # Every task stopped its own Ray: nothing of this job is left on any node.
    left = subprocess.run(["pgrep", "-af", f"rlhpc-{job_id}-"], capture_output=True, text=True).stdout
    assert not left, left
    # jobs/status.py finds the job through the id the template wrote into the run dir.
    status = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "status.py"), str(run)], capture_output=True, text=True, cwd=REPO
    )
    assert status.returncode == 0 and f"slurm job    {job_id}" in status.stdout, status.stdout + status.stderr
    print(f"template job {job_id}: {elapsed:.0f}s from sbatch to done")


@pytest.mark.slurm
def test_the_hetjob_template_trains_with_the_engines_on_their_own_partition(minicluster, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    # Component sizes live in the template's #SBATCH lines (sbatch's own options reach component 0
    # only): the minicluster's train partition holds node0, gen node1-2.
    text = (TEMPLATES / "hetjob.sbatch").read_text()
    text = text.replace("#SBATCH --gpus-per-node=8", "#SBATCH --gpus-per-node=2", 1)
    text = text.replace("#SBATCH --gpus-per-node=4", "#SBATCH --gpus-per-node=1", 1).replace("24:00:00", "10")
    script = tmp_path / "hetjob.sbatch"
    script.write_text(text)
    in_venv = sys.prefix != sys.base_prefix
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    overrides = [o for o in OVERRIDES if "cluster." not in o]  # each group takes its component
    export = ",".join(
        [
            "--export=ALL",
            f"CONFIG={REPO / 'jobs' / 'configs' / 'embedded.yaml'}",
            f"RUN_DIR={run}",
            f"OVERRIDES={' '.join(overrides)}",
            f"VENV={sys.prefix if in_venv else ''}",
            f"RLHPC_HOME={REPO}",
        ]
    )
    sbatch = subprocess.run(["sbatch", "--parsable", "--output", f"{run}/slurm-%j.out", export, str(script)],
                            capture_output=True, text=True, cwd=REPO, env=env)  # fmt: skip
    assert sbatch.returncode == 0, sbatch.stderr
    job_id = sbatch.stdout.strip().split(";")[0]
    state = wait_done(job_id, timeout=240)
    assert state in ("COMPLETED", None), f"job {job_id} ended {state}\n{logs(run)}"
    assert (run / "FINISHED").is_file(), logs(run)
    rollouts = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout_id"] for r in rollouts if r.get("kind") == "rollout"] == [0, 1, 2]
    task0 = " ".join((run / "logs" / f"slurm-{job_id}-task0.out").read_text().split())
    assert "Ray cluster ready: 3 nodes, 4 GPUs" in task0, logs(run)
    ips = minicluster.node_ips
    assert f"slot0={ips['node0']}:gpu0, slot1={ips['node0']}:gpu1" in task0  # the actor on train
    assert f"rollout engines up: http://{ips['node1']}:" in task0 or f"http://{ips['node2']}:" in task0


def test_templates_parse_and_share_the_run_lines() -> None:
    texts = {}
    for name in NAMES:
        path = TEMPLATES / name
        check = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert check.returncode == 0, f"{name}: {check.stderr}"
        texts[name] = path.read_text()
    plain = texts["plain.sbatch"]
    prepare = next(line for line in plain.splitlines() if line.startswith(PREPARE))
    step = next(line for line in plain.splitlines() if line.endswith(TASK))
    srun_opts = step.removesuffix(TASK)
    headers = {name: [x for x in t.splitlines() if x.startswith("#SBATCH")] for name, t in texts.items()}
    for name, text in texts.items():
        lines = text.splitlines()
        # The container runs the very same command: only what comes before it differs.
        assert [x for x in lines if x.endswith(prepare)], f"{name} lacks the prepare line {prepare!r}"
        task_lines = [x for x in lines if x.endswith(TASK)]
        assert len(task_lines) == 1 and task_lines[0].startswith(srun_opts), f"{name}: {task_lines}"
        assert headers[name] == headers["plain.sbatch"], f"{name}: #SBATCH lines differ from plain.sbatch"
        # Signal forwarding, wait and requeue are the same text in every template.
        assert text[text.index("step=$!") :] == plain[plain.index("step=$!") :], name
    assert "--container-image=" in texts["pyxis.sbatch"] and "--container-mounts=" in texts["pyxis.sbatch"]
    assert "apptainer exec --nv" in texts["apptainer.sbatch"]
    # The het template: the same signal forwarding, wait and requeue; its step spans both components.
    het = (TEMPLATES / "hetjob.sbatch").read_text()
    assert subprocess.run(["bash", "-n", str(TEMPLATES / "hetjob.sbatch")]).returncode == 0
    assert het[het.index("step=$!") :] == plain[plain.index("step=$!") :]
    assert [x for x in het.splitlines() if x.endswith(TASK)][0].startswith("srun --het-group=0,1 ")
    assert het.count("#SBATCH --signal=USR2@120") == 2 and "#SBATCH hetjob" in het
