"""The embedded job's local Ray requires the job's token, as on Slurm (issue 12, item 2), and
listens on loopback only (issue 32, item 12)."""

from __future__ import annotations

import http.client
import json
import os
import re
import stat
import subprocess
import sys
import time
import urllib.request
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

with local_ray(ClusterConfig(), 2, StopRequest(), Path(sys.argv[1]) if sys.argv[1] else None):
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


def ray_default(module: str, name: str) -> int:
    """A port Ray takes unless its variable says otherwise, read from Ray's source (a new pin shows it)."""
    import importlib.util

    source = Path(importlib.util.find_spec(module).origin).read_text()
    return int(re.search(rf'{name} = env_integer\("{name}", (\d+)\)', source).group(1))


def prometheus_endpoints(root: int) -> dict[str, int]:
    """Which of Ray's Prometheus endpoints answer GET /metrics, by what they serve, and on which port."""
    found = {}
    for p in [psutil.Process(root), *psutil.Process(root).children(recursive=True)]:
        try:
            ports = [c.laddr.port for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            continue
        for port in ports:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
                    text = r.read(1 << 20).decode(errors="replace")
            except (OSError, ValueError, http.client.HTTPException):
                continue  # not HTTP, or 401 (the token's)
            kind = "dashboard" if "ray_dashboard_" in text else "autoscaler" if "autoscaler_" in text else "node"
            found[kind] = port
    return found


def test_a_local_ray_without_a_jobs_token_requires_one_and_keeps_its_metrics_on_ports_of_its_own(
    tmp_path: Path,
) -> None:
    # Issue 43, item 12: rlhpc-eval ran its Ray without a token; Ray's Prometheus endpoints answer
    # whoever reaches them, the dashboard's and the autoscaler's on fixed ports every job shares.
    bare = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "DASHBOARD_", "AUTOSCALER_"))}
    head = subprocess.Popen(
        [sys.executable, "-c", HEAD, ""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=bare
    )
    try:
        address = json.loads(head.stdout.readline())["address"]
        home = tmp_path / "home"
        home.mkdir()
        denied = client(address, {**bare, "HOME": str(home)})
        assert denied.returncode != 0 and "CONNECTED" not in denied.stdout, denied.stdout + denied.stderr[-2000:]
        # nor with the token Ray keeps for all of a user's clusters (~/.ray/auth_token): its own
        denied = client(address, bare)
        assert denied.returncode != 0 and "CONNECTED" not in denied.stdout, denied.stdout + denied.stderr[-2000:]
        deadline = time.monotonic() + 180  # the dashboard serves its metrics a while after Ray is up
        while {"dashboard", "autoscaler"} - set(found := prometheus_endpoints(head.pid)):
            assert time.monotonic() < deadline, found
            time.sleep(2)
        assert "node" not in found, found  # the agent's per-node exporter is off
        assert found["dashboard"] != ray_default("ray.dashboard.consts", "DASHBOARD_METRIC_PORT"), found
        assert found["autoscaler"] != ray_default("ray.autoscaler._private.constants", "AUTOSCALER_METRIC_PORT"), found
    finally:
        head.stdin.close()
        head.wait(120)
