"""The embedded job's local Ray requires the job's token, as on Slurm (issue 12, item 2)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray

HEAD = """
import json, sys
from pathlib import Path
from rlhpc.config import ClusterConfig
from rlhpc.launch.job import local_ray
from rlhpc.launch.signals import StopRequest

with local_ray(ClusterConfig(), 2, StopRequest(), Path(sys.argv[1])):
    import ray
    print(json.dumps({"address": ray.get_runtime_context().gcs_address}), flush=True)
    sys.stdin.readline()
"""

CLIENT = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("CONNECTED", ray.cluster_resources().get("CPU", 0))
ray.shutdown()
"""


def client(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    # A refused client retries its connection for ~20 s; three tries say as much.
    env = {**env, "RAY_gcs_server_port_wait_time_s": "3"}
    return subprocess.run([sys.executable, "-c", CLIENT, address], env=env, capture_output=True, text=True, timeout=120)


def test_local_ray_refuses_a_client_without_the_token(tmp_path: Path) -> None:
    token = tmp_path / "ray" / "auth_token"
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD, str(token)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=bare
    )
    try:
        address = json.loads(head.stdout.readline())["address"]
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        home = tmp_path / "home"  # no ~/.ray/auth_token of the user's to fall back on
        home.mkdir()
        denied = client(address, {**bare, "HOME": str(home)})
        assert denied.returncode != 0 and "CONNECTED" not in denied.stdout, denied.stdout + denied.stderr[-2000:]
        wrong = tmp_path / "wrong_token"
        wrong.write_text("0" * 64)
        denied = client(address, {**bare, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)})
        assert denied.returncode != 0 and "CONNECTED" not in denied.stdout, denied.stdout + denied.stderr[-2000:]
        allowed = client(address, {**bare, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
        assert "CONNECTED" in allowed.stdout, allowed.stderr[-3000:]
    finally:
        head.stdin.close()
        head.wait(120)
