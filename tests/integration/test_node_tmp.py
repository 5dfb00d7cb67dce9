"""Files a Ray worker makes for a job (an engine's ready file) live in the task's node-local dir,
so a worker killed with them open leaves nothing behind once the task ends (issue 12)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

JOB = """
import json, os, signal, sys
from pathlib import Path
from rlhpc.config import ClusterConfig
from rlhpc.launch.job import local_ray
from rlhpc.launch.signals import StopRequest

temp_dir, result = Path(sys.argv[1]), Path(sys.argv[2])
with local_ray(ClusterConfig(), 2, StopRequest(), temp_dir=temp_dir):
    import ray

    @ray.remote
    def make_and_die():
        from rlhpc.util.files import node_tmp_dir
        d = node_tmp_dir("rlhpc-engine0-")
        (d / "ready.json").write_text("{}")
        return str(d)

    @ray.remote(max_retries=0)
    def killed(path):
        from rlhpc.util.files import node_tmp_dir
        (node_tmp_dir("rlhpc-engine1-") / "ready.json").write_text(path)
        os.kill(os.getpid(), signal.SIGKILL)  # as a killed engine actor: no cleanup of its own

    made = ray.get(make_and_die.remote())
    try:
        ray.get(killed.remote(made))
    except Exception:
        pass
    # a file, not stdout: Ray's log monitor prints workers' lines to stdout from its own thread
    result.write_text(json.dumps({"made": made, "inside": sorted(p.name for p in temp_dir.iterdir())}))
"""


def test_a_killed_workers_files_go_with_the_tasks_node_local_dir() -> None:
    short = Path(tempfile.mkdtemp(prefix="rlhpc-t-"))  # Ray's socket paths must stay short
    temp_dir, result = short / "ray", short / "seen.json"
    try:
        out = subprocess.run(
            [sys.executable, "-c", JOB, str(temp_dir), str(result)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        leftover = temp_dir.exists()
        assert out.returncode == 0, out.stderr[-3000:]
        assert result.is_file(), out.stdout[-3000:] + out.stderr[-3000:]
        seen = json.loads(result.read_text())
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert Path(seen["made"]).parent == temp_dir  # in the task's dir, not the machine's /tmp
    assert any(name.startswith("rlhpc-engine1-") for name in seen["inside"])  # the killed worker's too
    assert not leftover  # removed with the task's dir when the job ended
