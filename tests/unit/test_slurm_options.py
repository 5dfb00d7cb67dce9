"""Submission-side pieces that need no cluster: time formats, passthrough, ports, dry run."""

import subprocess
import sys
from pathlib import Path

import pytest

from rlhpc.errors import ConfigError
from rlhpc.launch.ray_cluster import FIRST_PORT, NUM_BLOCKS, PORT_BLOCK, RayPorts
from rlhpc.launch.slurm import parse_extra, parse_time

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "text,minutes",
    [
        ("90", 90),
        ("24:00:00", 1440),
        ("1:30:00", 90),
        ("0:30:30", 31),
        ("1-12", 2160),
        ("2-00:30", 2910),
        ("1-0:0:1", 1441),
        ("10:30", 11),
    ],
)
def test_slurm_time_formats(text, minutes):
    assert parse_time(text) == minutes


def test_bad_time():
    with pytest.raises(ConfigError, match="not a Slurm time"):
        parse_time("tomorrow")


def test_sbatch_passthrough():
    assert parse_extra(["mail-type=END", "--hold", "comment=a=b"]) == {
        "mail-type": "END",
        "hold": True,
        "comment": "a=b",
    }


def test_port_blocks_per_job():
    a, b = RayPorts.for_job("1234"), RayPorts.for_job("1235")
    ports_a = set(vars(a).values())
    assert len(ports_a) == 10  # no port used twice inside a job
    assert not (set(range(a.gcs, a.gcs + PORT_BLOCK)) & set(range(b.gcs, b.gcs + PORT_BLOCK)))
    assert not a.min_worker <= a.gcs <= a.max_worker  # ray start refuses a GCS port in the worker range
    assert FIRST_PORT <= a.gcs and a.max_worker < FIRST_PORT + NUM_BLOCKS * PORT_BLOCK <= 32768  # below ephemeral ports
    assert RayPorts.for_job("77_3") == RayPorts.for_job("773")  # array ids use their digits


def test_dry_run_prints_script_and_plan_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--run-dir", str(run), "--nodes", "3", "--gpus-per-node", "8",
         "--partition", "gpu", "--time", "2:00:00", "--sbatch", "mail-type=END",
         "--set", "cluster.actor_num_gpus=16", "--set", "cluster.rollout_num_gpus=8"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    for line in (
        "#SBATCH --nodes=3",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --time=120",
        "#SBATCH --partition=gpu",
        "#SBATCH --mail-type=END",
    ):
        assert line in p.stdout
    assert "actor rank 15  -> node1:gpu7" in p.stdout and "engine 7   (tp=1) -> node2:gpu7" in p.stdout
    assert not run.exists()


def test_dry_run_refuses_a_layout_bigger_than_the_allocation(tmp_path):
    p = subprocess.run(
        [sys.executable, str(REPO / "jobs" / "submit.py"), "--dry-run", "--nodes", "1", "--gpus-per-node", "4", "--set", "cluster.actor_num_gpus=4"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "needs 5 GPUs" in p.stderr + p.stdout
