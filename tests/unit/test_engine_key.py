"""The engine key on SGLang's and the router's command lines, and the key file (issue 12, item 1)."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import yaml
from support import sglang_wheel

from rlhpc.engine_server import sglang as sglang_server
from rlhpc.engine_server.cpu.app import UNAUTHORIZED
from rlhpc.engine_server.sglang import SGLangSpec
from rlhpc.wire.engine_key import auth_headers, authorized, new_key


def test_key_file_is_0600_and_new_each_time(tmp_path: Path) -> None:
    a = new_key(tmp_path / "engine_key")
    assert stat.S_IMODE((tmp_path / "engine_key").stat().st_mode) == 0o600
    b = new_key(tmp_path / "engine_key")
    assert a != b and len(b) >= 32 and (tmp_path / "engine_key").read_text() == b
    assert not [p for p in tmp_path.iterdir() if p.name != "engine_key"]  # no temporary left


def test_bearer_header_is_checked(tmp_path: Path) -> None:
    key = new_key(tmp_path / "k")
    assert authorized(auth_headers(key)["Authorization"], key)
    assert authorized(f"bearer {key}", key)
    for bad in (None, "", key, f"Bearer {key}x", f"Basic {key}", "Bearer "):
        assert not authorized(bad, key)


def test_sglangs_401_keeps_the_connection_as_the_cpu_engines_does() -> None:
    # SGLang's key middleware answers 401 with no connection header (uvicorn keeps the connection
    # alive); the CPU engine's middleware does the same (its integration test reads a second 401
    # on one connection). A pin: a new SGLang that closes shows here.
    auth = sglang_wheel.source("sglang/srt/utils/auth.py")
    refusal = auth[auth.index("if not decision.allowed:") :].split("await response(", 1)[0]
    assert "ORJSONResponse(" in refusal and "headers" not in refusal and "close" not in refusal.lower(), refusal


def test_the_cpu_engines_401_body_is_sglangs() -> None:
    # SGLang's body for a missing or wrong key is {"error": "Unauthorized"} (its 403 says
    # "Forbidden"); the CPU engine's middleware answers with the same
    refusal = sglang_wheel.function_code("sglang/srt/utils/auth.py", "__call__")
    assert "content={'error': 'Unauthorized' if decision.error_status_code == 401 else 'Forbidden'}" in refusal, refusal
    assert UNAUTHORIZED == {"error": "Unauthorized"}


def test_sglang_gets_the_key_in_a_0600_config_file_not_on_its_command_line(tmp_path: Path) -> None:
    key = new_key(tmp_path / "engine_key")
    config = sglang_server.write_key_config(tmp_path / "sglang_key.yaml", key)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert yaml.safe_load(config.read_text()) == {"api-key": key}
    spec = SGLangSpec(tp_size=1, mem_fraction_static=0.5, memory_saver=False, seed=1)
    cmd = sglang_server.launch_server_command("/py", "/m", "h", 1, 2, spec, None, config)
    assert cmd[cmd.index("--config") + 1] == str(config)
    assert key not in " ".join(cmd) and "--api-key" not in cmd


def test_the_routers_command_line_names_the_key_file_not_the_key(tmp_path: Path) -> None:
    key = new_key(tmp_path / "engine_key")
    cmd = sglang_server.router_command("/py", ["http://a:1"], "127.0.0.1", 5, 6, tmp_path / "engine_key")
    assert cmd[3:6] == ["rlhpc.engine_server.router_main", "--api-key-file", str(tmp_path / "engine_key")]
    assert key not in " ".join(cmd) and "--api-key" not in cmd
    assert "--api-key-file" not in sglang_server.router_command("/py", ["http://a:1"], "127.0.0.1", 5, 6)


def test_server_output_reaches_the_log_with_the_key_replaced(tmp_path: Path) -> None:
    """SGLang logs its server arguments, api_key included; the log gets them without it."""
    log = tmp_path / "server.log"
    script = "import sys; print('server_args=' + repr({'api_key': sys.argv[1]}), flush=True); sys.exit(3)"
    try:
        sglang_server.start_on_free_port(
            lambda port: [sys.executable, "-c", script, "s3cr3t-key"],
            "127.0.0.1", "fake", log, {}, 30, attempts=1, api_key="s3cr3t-key",
        )  # fmt: skip
    except sglang_server.ServerExited as e:
        assert "s3cr3t-key" not in e.problem and "<engine key>" in e.problem
    else:
        raise AssertionError("the fake server exited, start_on_free_port must say so")
    text = log.read_text()
    assert "server_args=" in text and "s3cr3t-key" not in text
