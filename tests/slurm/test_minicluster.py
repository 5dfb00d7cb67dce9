"""The Slurm minicluster is a real cluster: nodes, per-node IPs, GPUs, preemption, lifecycle."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slurm

TOOL = Path(__file__).resolve().parents[2] / "tools" / "minicluster.py"


def sh(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


def job(jobid: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """`scontrol show job` fields (MinJobAge keeps finished jobs visible for 30 s)."""
    out = sh(["scontrol", "show", "job", "-o", jobid], env=env)
    return dict(re.findall(r"(\w+)=(\S*)", out))


def nodes_info(env: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    out = sh(["scontrol", "show", "node", "-o"], env=env)
    return {f["NodeName"]: f for f in (dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines())}


def sbatch(args: list[str], env: dict[str, str] | None = None) -> str:
    return sh(["sbatch", "--parsable", *args], env=env).strip().split(";")[0]


# ---- the session cluster: 4 nodes x 8 GPUs -------------------------------------------------


def test_all_nodes_idle_with_8_gpus(minicluster) -> None:
    assert minicluster.nodes == ["node0", "node1", "node2", "node3"]
    assert minicluster.gpus_per_node == 8
    wait_for(lambda: all(n["State"] == "IDLE" for n in nodes_info().values()), 30, "all nodes idle")
    info = nodes_info()
    assert sorted(info) == minicluster.nodes
    extra = {"node0": ",train", "node1": ",gen", "node2": ",gen", "node3": ",score"}  # train:1 gen:2 score:1
    for name, ip in minicluster.node_ips.items():
        assert info[name]["Gres"] == "gpu:8"
        assert info[name]["NodeAddr"] == ip
        assert info[name]["Partitions"] == "low,high" + extra[name]
    sinfo = sh(["sinfo", "-h", "-N", "-p", "low", "-o", "%N %T %G"]).split("\n")
    assert sorted(line for line in sinfo if line) == [f"node{k} idle gpu:8" for k in range(4)]
    partitions = sh(["sinfo", "-h", "-o", "%P %a %N"]).split()
    assert partitions == ["low*", "up", "node[0-3]", "high", "up", "node[0-3]", "train", "up", "node0", "gen", "up",
                          "node[1-2]", "score", "up", "node3"]  # fmt: skip


def test_srun_each_node_sees_its_own_ip(minicluster) -> None:
    out = sh(["srun", "-N4", "--ntasks-per-node=1", "bash", "-c", 'echo "$SLURMD_NODENAME $(hostname) $(hostname -I)"'])
    rows = sorted(line.split() for line in out.splitlines())
    assert len(rows) == 4, out
    assert len({row[2] for row in rows}) == 4, f"expected 4 distinct IPs: {out}"
    for node, hostname, ip in rows:
        assert hostname == node
        assert ip == minicluster.node_ips[node]
    # Names resolve on the nodes, as on a real cluster.
    resolved = sh(["srun", "-N1", "-w", "node2", "getent", "hosts", "node0", "node3"])
    assert minicluster.node_ips["node0"] in resolved and minicluster.node_ips["node3"] in resolved


def test_batch_job_gets_gpus(minicluster, tmp_path: Path) -> None:
    script = 'echo "JOB CVD=$CUDA_VISIBLE_DEVICES JOB_GPUS=$SLURM_JOB_GPUS"; srun bash -c \'echo "STEP $SLURMD_NODENAME CVD=$CUDA_VISIBLE_DEVICES"\''
    jobid = sbatch(["-N2", "--gpus-per-node=2", "-o", str(tmp_path / "out-%j.txt"), "--wait", "--wrap", script])
    out = (tmp_path / f"out-{jobid}.txt").read_text()  # output lands where the job asked
    m = re.search(r"JOB CVD=(\S+) JOB_GPUS=(\S+)", out)
    assert m, out
    assert len(m.group(1).split(",")) == 2 and len(m.group(2).split(",")) == 2
    steps = re.findall(r"STEP (node\d) CVD=(\S+)", out)
    assert len(steps) == 2 and all(len(cvd.split(",")) == 2 for _, cvd in steps), out


def test_high_partition_preempts_low_job(minicluster, tmp_path: Path) -> None:
    """A low job holding every GPU is signalled (USR2, at once) when a high job needs one of
    its nodes; it requeues itself, as a checkpointing job would, and the high job runs."""
    low_out = tmp_path / "low.out"
    low_script = tmp_path / "low.sh"
    low_script.write_text(
        "#!/bin/bash\n"
        # Kill the background child too: with proctrack/linuxproc an orphan escapes the job.
        "trap 'echo \"got USR2 restart=${SLURM_RESTART_COUNT:-0}\"; kill $child; scontrol requeue $SLURM_JOB_ID; exit 0' USR2\n"
        'echo "start restart=${SLURM_RESTART_COUNT:-0}"\n'
        "sleep 300 & child=$!\n"
        "wait\n"
    )
    low = sbatch(["-p", "low", "-N4", "--gpus-per-node=8", "--requeue", "--signal=B:USR2@60",
                  "--open-mode=append", "-o", str(low_out), str(low_script)])  # fmt: skip
    high = None
    try:
        wait_for(lambda: low_out.exists() and "start restart=0" in low_out.read_text(), 30, "the low job to start")
        high = sbatch(["-p", "high", "-N1", "--gpus-per-node=1", "-o", str(tmp_path / "high.out"),
                       "--wrap", "echo high ran on $SLURMD_NODENAME"])  # fmt: skip
        wait_for(lambda: "got USR2" in low_out.read_text(), 20, "the low job to get USR2")
        wait_for(lambda: job(low)["Restarts"] == "1", 20, "the low job to be requeued")
        wait_for(lambda: job(low)["JobState"] in ("PENDING", "RUNNING"), 20, "the low job to be pending again")
        wait_for(lambda: (tmp_path / "high.out").exists() and "high ran" in (tmp_path / "high.out").read_text(),
                 30, "the high job to run")  # fmt: skip
    finally:
        subprocess.run(["scancel", low, *([high] if high else [])], check=False)


def test_up_twice_is_idempotent(minicluster) -> None:
    state = minicluster._load_state()
    proc = subprocess.run(
        [
            sys.executable,
            str(TOOL),
            "up",
            "--nodes",
            "4",
            "--gpus-per-node",
            "8",
            *[f"--partition={name}:{nodes}" for name, nodes, _ in minicluster.spec.partitions],
            "--state-dir",
            str(minicluster.state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "already up" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == f"export SLURM_CONF={minicluster.slurm_conf}"
    assert minicluster._load_state()["pids"] == state["pids"], "up rebuilt an identical healthy cluster"
    assert minicluster.up() is False
    status = subprocess.run([sys.executable, str(TOOL), "status", "--state-dir", str(minicluster.state_dir)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert status.returncode == 0 and "node3" in status.stdout


# ---- a second, small cluster beside it: own state dir, subnet and port --------------------


def _free_subnet_index() -> int:
    """X such that 10.77.X.0/24 is on no interface (another session's small cluster)."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    return next(x for x in range(9, 250) if f" 10.77.{x}." not in used)


@pytest.fixture(scope="module")
def small_cluster(minicluster_tool: ModuleType) -> Iterator:
    # Not under pytest's tmp dir: that is mode 0700 and munged runs as the munge user.
    # Own state dir, subnet and port (a free one), so concurrent test sessions do not share it.
    x = _free_subnet_index()
    mc = minicluster_tool.MiniCluster(
        f"/tmp/rlhpc-minicluster-test-{x}",
        nodes=2,
        gpus_per_node=2,
        subnet=f"10.77.{x}.0/24",
        port=16900 + 2 * x,
        grace_time=3,
    )
    mc.up()
    try:
        yield mc
    finally:
        mc.down()


def test_grace_time_expiry_requeues_a_job_that_ignores_the_signal(small_cluster, tmp_path: Path) -> None:
    env = small_cluster.env()
    out = tmp_path / "low.out"
    low = sbatch(["-p", "low", "-N2", "--gpus-per-node=2", "--open-mode=append", "-o", str(out),
                  "--wrap", 'echo "start restart=${SLURM_RESTART_COUNT:-0}"; sleep 300'], env=env)  # fmt: skip
    high = None
    try:
        wait_for(lambda: out.exists() and "start restart=0" in out.read_text(), 30, "the low job to start")
        high = sbatch(
            ["-p", "high", "-N1", "--gpus-per-node=1", "-o", str(tmp_path / "high.out"), "--wrap", "sleep 1"], env=env
        )
        # Slurm itself kills it after GraceTime (3 s here; its periodic check adds up to ~10 s)
        # and requeues it.
        wait_for(lambda: job(low, env)["Restarts"] == "1", 45, "Slurm to requeue the low job")
        assert "PREEMPTION" in out.read_text()
    finally:
        subprocess.run(["scancel", low, *([high] if high else [])], check=False, env=env)


def test_second_cluster_is_separate(small_cluster, minicluster) -> None:
    assert sorted(nodes_info(small_cluster.env())) == ["node0", "node1"]
    assert nodes_info(small_cluster.env())["node1"]["NodeAddr"] == small_cluster.node_ips["node1"]
    assert len(nodes_info()) == 4  # the session cluster is untouched


def test_up_with_another_spec_rebuilds(small_cluster, minicluster_tool: ModuleType) -> None:
    before = small_cluster._load_state()["pids"]["slurmctld"]
    s = small_cluster.spec
    bigger = minicluster_tool.MiniCluster(
        small_cluster.state_dir, nodes=2, gpus_per_node=3, subnet=s.subnet, port=s.port, grace_time=s.grace_time,
        partitions=[("gen", 1, 1)],  # node0 in a partition of its own, with 1 GPU
    )  # fmt: skip
    assert bigger.up() is True
    assert bigger._load_state()["pids"]["slurmctld"] != before
    info = nodes_info(bigger.env())
    assert (info["node0"]["Gres"], info["node1"]["Gres"]) == ("gpu:1", "gpu:3")
    assert (info["node0"]["Partitions"], info["node1"]["Partitions"]) == ("low,high,gen", "low,high")
    assert bigger.up() is False  # the same spec (partitions included) read back from its state: nothing to do


def test_down_leaves_nothing_and_status_fails(small_cluster) -> None:
    state = small_cluster._load_state()
    pids = [state["pids"]["slurmctld"], state["pids"]["munged"], *state["pids"]["slurmd"].values()]
    small_cluster.down()
    status = subprocess.run([sys.executable, str(TOOL), "status", "--state-dir", str(small_cluster.state_dir)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert status.returncode != 0
    assert "no minicluster" in status.stderr
    assert not small_cluster.state_dir.exists()
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert small_cluster.tag not in netns
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert small_cluster.tag not in links
    # down twice is fine
    small_cluster.down()


def test_kill_node_is_a_power_loss_and_revive_node_brings_it_back(minicluster, tmp_path: Path) -> None:
    """kill-node leaves nothing running on the node; Slurm drops it from a --no-kill job, whose
    srun --no-kill step goes on elsewhere; revive-node makes it usable again."""
    out = tmp_path / "out.txt"
    script = "srun --no-kill bash -c 'echo up $SLURMD_NODENAME; sleep 120'"
    jobid = sbatch(["-N2", "-w", "node2,node3", "--no-kill", "-o", str(out), "--wrap", script])
    try:
        wait_for(lambda: out.exists() and out.read_text().count("up node") == 2, 30, "the step on both nodes")
        assert minicluster.node_pids("node3")
        killed = minicluster.kill_node("node3")
        assert killed and not minicluster.node_pids("node3")  # slurmd and the job's task: all gone
        wait_for(lambda: "DOWN" in nodes_info(minicluster.env())["node3"]["State"], 90, "Slurm to mark node3 DOWN")
        info = job(jobid)
        assert info["JobState"] == "RUNNING" and info["NodeList"] == "node2", info  # the job lives on
        minicluster.revive_node("node3")
        assert "DOWN" not in nodes_info(minicluster.env())["node3"]["State"]
    finally:
        subprocess.run(["scancel", jobid], check=False)
        minicluster.revive_node("node3")
