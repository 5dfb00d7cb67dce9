"""sglang_router, the real one, in front of two CPU engines (issue 32, item 3): it serves only a
client with the engine key, and no command line of its process tree carries the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import urllib3
from support.engines import start_server, stop_server

from rlhpc.engine_server.sglang import Router
from rlhpc.wire.client import EngineClient
from rlhpc.wire.engine_key import new_key


def test_the_router_serves_with_the_key_and_no_command_line_carries_it(model_path: str, tmp_path: Path) -> None:
    key = new_key(tmp_path / "engine_key")
    engines = [start_server(model_path, tmp_path, f"e{i}", key_path=tmp_path / "engine_key") for i in range(2)]
    router = Router("127.0.0.1", tmp_path / "router.log", 60.0, tmp_path / "engine_key")
    try:
        url = router.start([u for _, u, _ in engines])
        tree = [psutil.Process(router.proc.pid), *psutil.Process(router.proc.pid).children(recursive=True)]
        for proc in tree:
            assert key not in " ".join(proc.cmdline()) and key not in str(proc.environ())
        assert "--api-key-file" in router.proc.args and key not in " ".join(router.proc.args)  # as started
        ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
        assert key not in ps

        client = EngineClient(url, timeout_s=60, api_key=key)
        outs = [client.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4, "temperature": 1.0,
                                                                      "sampling_seed": s}) for s in range(4)]  # fmt: skip
        assert all(1 <= len(o["output_ids"]) == o["meta_info"]["completion_tokens"] <= 4 for o in outs)
        body = b'{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}'
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            resp = urllib3.request("POST", url + "/generate", body=body, headers=headers, timeout=30, retries=False)
            assert resp.status == 401, resp.data[:200]
        assert key not in (tmp_path / "router.log").read_text()
    finally:
        router.stop()
        for proc, _, _ in engines:
            stop_server(proc)


def test_the_key_cannot_be_passed_on_the_command_line(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rlhpc.engine_server.router_main", "--api-key-file", str(tmp_path / "k"), "--api-key", "x"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 2 and "--api-key-file, not --api-key" in out.stderr


pytestmark = pytest.mark.timeout(180)
