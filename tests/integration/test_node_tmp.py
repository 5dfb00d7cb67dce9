"""Files a Ray worker makes for a job (an engine's ready file) live in the task's node-local dir,
so a worker killed with them open leaves nothing behind once the task ends (issue 12); and that
dir is private: Ray makes its own dirs 0777, but another user of the node can neither look into
them nor swap an engine's dir for one of its own (issue 32, item 1)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support.other_user import UID, require_second_user

pytestmark = pytest.mark.ray

JOB = """
import json, os, signal, subprocess, sys
from pathlib import Path
from rlhpc.config import ClusterConfig
from rlhpc.launch.local_ray import local_ray
from rlhpc.runtime.signals import StopRequest

record, result, attacker = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
with local_ray(ClusterConfig(), 2, StopRequest(), record=record):
    import ray

    temp_dir = Path(record.read_text())

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
    attack = subprocess.run([*attacker, str(temp_dir), made], capture_output=True, text=True) if attacker else None
    try:
        ray.get(killed.remote(made))
    except Exception:
        pass
    # a file, not stdout: Ray's log monitor prints workers' lines to stdout from its own thread
    result.write_text(json.dumps({
        "temp_dir": str(temp_dir),
        "made": made,
        "inside": sorted(p.name for p in temp_dir.iterdir()),
        "ray_modes": sorted({oct(p.stat().st_mode & 0o777) for p in (temp_dir / "ray").rglob("*") if p.is_dir()}),
        "attack": attack and (attack.returncode, attack.stdout, attack.stderr),
    }))
"""

# The other user's try, as in the issue: rename the engine's dir away and put its own in its place,
# or just look inside Ray's dirs. Each step's outcome is printed; none may succeed.
ATTACK = """
import json, os, sys
temp_dir, engine_dir = sys.argv[1], sys.argv[2]
out = {}
for name, step in (
    ("list Ray's dir", lambda: os.listdir(os.path.join(temp_dir, "ray"))),
    ("rename the engine dir", lambda: os.rename(engine_dir, engine_dir + ".away")),
    ("plant a dir", lambda: os.mkdir(os.path.join(temp_dir, "ray", "planted"))),
    ("read the ready file", lambda: open(os.path.join(engine_dir, "ready.json")).read()),
):
    try:
        step()
        out[name] = "done"
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""


def test_a_killed_workers_files_go_with_the_tasks_node_local_dir_which_no_other_user_enters() -> None:
    require_second_user()
    attacker = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", "/usr/bin/python3", "-c", ATTACK]
    work = Path(tempfile.mkdtemp(prefix="rlhpc-t-"))
    record, result = work / "local_ray_dir", work / "seen.json"
    try:
        out = subprocess.run(
            [sys.executable, "-c", JOB, str(record), str(result), json.dumps(attacker)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        assert result.is_file(), out.stdout[-3000:] + out.stderr[-3000:]
        seen = json.loads(result.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    temp_dir = Path(seen["temp_dir"])
    leftover = temp_dir.exists()
    assert temp_dir.parent == Path(tempfile.gettempdir())  # the machine's /tmp: others pass through it
    assert Path(seen["made"]).parent == temp_dir  # in the task's dir, not the machine's /tmp
    assert any(name.startswith("rlhpc-engine1-") for name in seen["inside"])  # the killed worker's too
    assert not leftover  # removed with the task's dir when the job ended
    assert "0o777" in seen["ray_modes"]  # Ray's own choice, inside ours
    code, stdout, stderr = seen["attack"]
    assert code == 0, stderr
    assert json.loads(stdout) == {
        "list Ray's dir": "PermissionError",
        "rename the engine dir": "PermissionError",
        "plant a dir": "PermissionError",
        "read the ready file": "PermissionError",
    }
