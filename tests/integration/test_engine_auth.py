"""The engine key: no route of a CPU engine server but its /health probe answers without it (issue 12,
item 1)."""

from __future__ import annotations

import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import urllib3
from support.engines import engine_client, key_file, start_server, stop_server
from support.jobs import REPO, job_args, submit

from rlhpc.engine_server.cpu.app import UNAUTHORIZED
from rlhpc.engine_server.cpu.server import parse_args
from rlhpc.wire.protocol import Route


@pytest.fixture(scope="module")
def server(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    work = tmp_path_factory.mktemp("auth")
    proc, url, _ = start_server(model_path, work, "engine")
    try:
        yield url, work
    finally:
        stop_server(proc)


@pytest.mark.parametrize("route", sorted(set(Route.all().values())) + ["/docs", "/openapi.json", "/no_such_route"])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "wrong"}])
def test_every_route_refuses_a_request_without_the_key(server: tuple[str, Path], route: str, headers: dict) -> None:
    url, _ = server
    for method in ("GET", "POST"):
        resp = urllib3.request(method, url + route, json={}, headers=headers, timeout=30, retries=False)
        if (method, route) == ("GET", Route.HEALTH):  # the probe, as SGLang's: nothing in it (the engines
            # rlhpc starts run nothing for it either: SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false)
            assert resp.status == 200 and resp.data == b"", resp.data[:200]
        else:
            assert resp.status == 401 and resp.json() == UNAUTHORIZED, (method, route, resp.status, resp.data[:200])


def test_the_client_with_the_key_is_served(server: tuple[str, Path]) -> None:
    url, work = server
    client = engine_client(url, timeout_s=60)
    assert client.health()
    assert client.get_weight_version() == "default"
    client.pause_generation("in_place")
    client.continue_generation()
    assert stat.S_IMODE(key_file(work, "engine").stat().st_mode) == 0o600
    key = key_file(work, "engine").read_text().strip()
    assert key not in (work / "engine.log").read_text()


def test_without_a_key_the_server_only_listens_on_loopback(model_path: str) -> None:
    assert parse_args(["--model-path", model_path]).api_key_file is None  # 127.0.0.1 by default
    with pytest.raises(SystemExit):
        parse_args(["--model-path", model_path, "--host", "0.0.0.0"])


def test_the_key_is_not_on_the_command_line(server: tuple[str, Path]) -> None:
    url, work = server
    key = key_file(work, "engine").read_text().strip()
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert "--api-key-file" in ps and key not in ps


def test_a_finished_local_job_keeps_its_keys_out_of_every_log(tmp_path: Path) -> None:
    run = tmp_path / "run"
    p = submit(run, "rollout.num_rollout=1")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    secrets = {run / "engine_key": (run / "engine_key").read_text().strip()}
    secrets.update({t: t.read_text().strip() for t in (run / "ray").glob("*/auth_token")})
    assert len(secrets) == 2, secrets.keys()  # the engine key and the local Ray's token
    for path in secrets:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    texts = {f: f.read_bytes() for f in run.rglob("*") if f.is_file() and f not in secrets}
    assert any("logs" in f.parts for f in texts)
    for f, data in texts.items():
        for secret in secrets.values():
            assert secret.encode() not in data, f"{f} holds a secret"
    assert all(secret not in p.stdout + p.stderr for secret in secrets.values())
    dry = subprocess.run(
        [*job_args(tmp_path / "other"), "--dry-run"], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert dry.returncode == 0, dry.stderr
    assert all(secret not in dry.stdout for secret in secrets.values())
    # the engines' launch lines name the key's file (--api-key-file), never a key (--api-key KEY, api-key: KEY)
    assert "--api-key " not in dry.stdout and "api-key:" not in dry.stdout and "RAY_AUTH_TOKEN=" not in dry.stdout

    # Issue 32, item 13: the run's data is the user's: every dir 0700, every file 0600 (under
    # the 022 umask the job was started with): another user of the machine reads none of it.
    wide = {str(f.relative_to(run)): oct(stat.S_IMODE(f.lstat().st_mode)) for f in [run, *run.rglob("*")]
            if not f.is_symlink() and stat.S_IMODE(f.lstat().st_mode) & 0o077}  # fmt: skip
    assert not wide, wide


def test_half_sent_requests_are_bounded_and_timed_out_and_keyless_callers_are_answered_as_by_sglang(
    model_path: str, tmp_path: Path
) -> None:
    # Issue 32, item 4: 20,000 connections holding half a GET /health once exhausted the engine's
    # file descriptors. Now at most --max-connections are open at once, each for header_timeout_s.
    cap = 64
    proc, url, _ = start_server(
        model_path, tmp_path, "flooded", ["--header-timeout-s", "3", "--max-connections", str(cap)]
    )
    host, port = url.removeprefix("http://").rsplit(":", 1)
    flood: list[socket.socket] = []
    try:
        for _ in range(cap + 300):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: engine\r\n")  # and never the blank line
            flood.append(s)
        client = engine_client(url, timeout_s=30)  # a new connection, with its headers at once
        assert client.get_weight_version() == "default"
        held = [c for c in psutil.Process(proc.pid).net_connections("tcp") if c.status == psutil.CONN_ESTABLISHED]
        assert len(held) <= cap, len(held)  # the client's own among them
        deadline = time.monotonic() + 20
        for s in flood:  # every half-sent one is closed: the cap's oldest at once, the rest after 3 s
            s.settimeout(max(0.1, deadline - time.monotonic()))
            assert s.recv(1) == b""
        assert client.get_weight_version() == "default"  # the client's kept connection was never pending

        # a keyless caller's connection is kept after its 401, as SGLang's (test_engine_key.py
        # pins SGLang's); the guard bounds it as any other
        keyless = socket.create_connection((host, int(port)), timeout=10)
        for _ in range(2):
            keyless.sendall(b"GET /get_model_info HTTP/1.1\r\nHost: engine\r\n\r\n")
            answer = b""
            while not answer.endswith(b"}") and (chunk := keyless.recv(65536)):  # its JSON, or EOF
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 401") and b"connection: close" not in answer.lower(), answer
        keyless.close()
    finally:
        for s in flood:
            s.close()
        stop_server(proc)
