"""The embedded job's local Ray requires the job's token, as on Slurm (issue 12, item 2), and
listens on loopback only (issue 32, item 12)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from rlhpc.launch.local_ray import LOOPBACK_ONLY_ENV

pytestmark = pytest.mark.ray

HEAD = """
import json, sys
from pathlib import Path
from rlhpc.config import ClusterConfig
from rlhpc.launch.local_ray import local_ray
from rlhpc.runtime.signals import StopRequest

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
    # A client on the job's machine takes its loopback node address, as the job's own processes do.
    env = {**env, "RAY_gcs_server_port_wait_time_s": "3", LOOPBACK_ONLY_ENV: "0"}
    return subprocess.run([sys.executable, "-c", CLIENT, address], env=env, capture_output=True, text=True, timeout=120)


def listeners(root: int) -> set[tuple[str, str]]:
    """(process name, address) of every TCP socket listening in ``root``'s process tree."""
    found = set()
    for p in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        try:
            found |= {(p.name(), c.laddr.ip) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except psutil.Error:
            pass  # a worker that ended meanwhile
    return found


def loopback(ip: str) -> bool:
    return ip.removeprefix("::ffff:").startswith("127.") or ip == "::1"


def test_local_ray_listens_on_loopback_only_and_refuses_a_client_without_the_token(tmp_path: Path) -> None:
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
        # Ray's own default binds its servers (GCS, raylet, workers, dashboard, agents) to all addresses
        listening = listeners(head.pid)
        assert {"gcs_server", "raylet"} <= {name for name, _ in listening}, listening
        assert any("Agent" in name for name, _ in listening), listening
        assert not {(name, ip) for name, ip in listening if not loopback(ip)}
        assert address.startswith("127.0.0.1:")
    finally:
        head.stdin.close()
        head.wait(120)
