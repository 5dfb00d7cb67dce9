"""Start and stop a CPU engine server process for tests (port 0 + ready file, as EngineActor does)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def start_server(
    model_path: str, work: Path, name: str, extra_args: list[str] | None = None
) -> tuple[subprocess.Popen, str, Path]:
    """Start a CPU engine server on port 0; return (process, url, ready file)."""
    ready = work / f"{name}.ready.json"
    log = open(work / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlhpc.rollout.cpu_server", "--model-path", model_path, "--port", "0"]
        + ["--ready-file", str(ready), "--parent-pid", str(os.getpid()), *(extra_args or [])],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, (work / f"{name}.log").read_text()
        assert time.monotonic() < deadline, "server did not get ready"
        time.sleep(0.05)
    info = json.loads(ready.read_text())
    return proc, f"http://{info['host']}:{info['port']}", ready


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
