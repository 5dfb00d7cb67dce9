"""SGLang launcher: command lines, GPU split over nodes, and the port retry with real processes.

SGLang itself cannot be installed on CPU machines, so its server is not started here; the
server flags are checked against SGLang's own sources in test_sglang_protocol.py, the router's
against the names in sglang_router's ``router_args.py``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import socket
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
import ray

from rlhpc.engine_server import sglang as sg
from rlhpc.engine_server.sglang import SGLangSpec
from rlhpc.errors import RlhpcError
from rlhpc.wire import protocol as P


def flags(cmd: list[str]) -> dict[str, str | None]:
    """``--flag value`` pairs of a command line (a flag followed by another flag has no value)."""
    out: dict[str, str | None] = {}
    for i, a in enumerate(cmd):
        if a.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def spec(**kw: object) -> SGLangSpec:
    base = {"tp_size": 2, "mem_fraction_static": 0.6, "memory_saver": False, "seed": 7}
    return SGLangSpec(**{**base, **kw})


# ------------------------------------------------------------------ command lines


def test_launch_server_command() -> None:
    cmd = sg.launch_server_command("/py", "/models/m", "10.0.0.5", 31000, 31001, spec(extra_args=("--dtype", "bf16")))
    assert cmd[:4] == ["/py", "-P", "-m", "sglang.launch_server"]  # -P: nothing imported from the working dir
    f = flags(cmd)
    assert f["--model-path"] == "/models/m" and f["--host"] == "10.0.0.5"
    assert f["--port"] == "31000" and f["--nccl-port"] == "31001"
    assert f["--tp-size"] == "2" and f["--mem-fraction-static"] == "0.6" and f["--random-seed"] == "7"
    assert f["--base-gpu-id"] == "0" and "--enable-memory-saver" not in f and "--nnodes" not in f
    assert cmd[-2:] == ["--dtype", "bf16"]  # the user's extra args come last

    saver = flags(sg.launch_server_command("/py", "/m", "h", 1, 2, spec(memory_saver=True)))
    assert "--enable-memory-saver" in saver and saver["--enable-memory-saver"] is None


def test_multi_node_command_names_rank_and_dist_init_addr() -> None:
    part = spec(tp_size=16, nnodes=2, node_rank=1)
    f = flags(sg.launch_server_command("/py", "/m", "10.0.0.6", 1, 2, part, "10.0.0.5:29400"))
    assert f["--nnodes"] == "2" and f["--node-rank"] == "1" and f["--dist-init-addr"] == "10.0.0.5:29400"
    assert f["--tp-size"] == "16"  # SGLang's tp size is the whole engine's, over all nodes
    with pytest.raises(RlhpcError, match="dist-init address"):
        sg.launch_server_command("/py", "/m", "h", 1, 2, part)


def test_router_command_is_what_sglang_routers_own_parser_reads(tmp_path: Path) -> None:
    from sglang_router.launch_router import parse_router_args  # sglang-router, installed for the tests

    (tmp_path / "key").write_text("k3y")
    cmd = sg.router_command("/py", ["http://10.0.0.5:1", "http://10.0.0.6:2"], "10.0.0.5", 30500, 30501)
    assert cmd[:4] == ["/py", "-P", "-m", "sglang_router.launch_router"]
    parsed = parse_router_args(cmd[4:])
    assert parsed.worker_urls == ["http://10.0.0.5:1", "http://10.0.0.6:2"] and parsed.policy == "round_robin"
    assert (parsed.host, parsed.port, parsed.prometheus_host, parsed.prometheus_port) == (
        "10.0.0.5", 30500, "127.0.0.1", 30501,
    )  # fmt: skip
    # the job alone judges its engines (tests/integration/test_router.py: what each flag stops)
    assert parsed.disable_health_check and parsed.disable_circuit_breaker and parsed.disable_retries
    assert parsed.log_level == "warn"
    keyed = sg.router_command("/py", ["http://10.0.0.5:1"], "127.0.0.1", 1, 2, tmp_path / "key")
    assert keyed[3:6] == [sg.ROUTER_MAIN, "--api-key-file", str(tmp_path / "key")]
    assert parse_router_args(keyed[6:]).worker_urls == ["http://10.0.0.5:1"]
    with pytest.raises(RlhpcError, match="at least one engine"):
        sg.router_command("/py", [], "h", 1, 2)


def test_the_router_installed_and_required_is_the_one_its_behaviour_is_pinned_against() -> None:
    """What rlhpc.wire.protocol says the router drops and refuses was read from this release."""
    assert importlib.metadata.version("sglang-router") == P.ROUTER_VERSION
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert f"sglang-router=={P.ROUTER_VERSION}" in project["dependencies"]  # every run has a router


def test_server_env_shows_only_the_engine_gpus() -> None:
    env = sg.server_env({"CUDA_VISIBLE_DEVICES": "3", "PATH": "/bin"}, spec(), [4, 5])
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5" and env["PATH"] == "/bin"
    assert sg.server_env({"CUDA_VISIBLE_DEVICES": "3"}, spec(), [])["CUDA_VISIBLE_DEVICES"] == "3"


def test_engine_parts_split_an_engine_over_nodes() -> None:
    # 2 nodes x 4 GPUs; Ray's GPU ids on each node
    where = [("10.0.0.5", g) for g in range(4)] + [("10.0.0.6", g) for g in range(4)]
    one = sg.engine_parts((2, 3), where, 0.5, True, 1)
    assert [(slot, p.gpu_ids, p.nnodes, p.node_rank, p.tp_size) for slot, p in one] == [(2, (2, 3), 1, 0, 2)]
    assert one[0][1].memory_saver and one[0][1].serves_http

    two = sg.engine_parts(tuple(range(8)), where, 0.5, False, 1, ["--dtype", "bf16"])
    assert [(slot, p.gpu_ids, p.nnodes, p.node_rank, p.tp_size) for slot, p in two] == [
        (0, (0, 1, 2, 3), 2, 0, 8),
        (4, (0, 1, 2, 3), 2, 1, 8),
    ]
    assert two[1][1].extra_args == ("--dtype", "bf16") and not two[1][1].serves_http
    with pytest.raises(RlhpcError, match="unevenly"):
        sg.engine_parts((2, 3, 4), where, 0.5, False, 1)


# ------------------------------------------------------------------ port retry, real processes

# A stand-in server: binds the port it is given and answers /health, as SGLang's HTTP server does.
HEALTH_SERVER = textwrap.dedent(
    """
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def test_port_taken_in_between_is_retried_on_another(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    picked: list[int] = []

    def pick(host: str) -> int:  # the first pick loses the race: someone bound it meanwhile
        picked.append(busy if not picked else sg.free_port(host))
        return picked[-1]

    log_path = tmp_path / "server.log"
    try:
        proc, port = sg.start_on_free_port(
            lambda p: [sys.executable, "-c", HEALTH_SERVER, str(p)],
            "127.0.0.1",
            "test server",
            log_path,
            {},
            timeout_s=30,
            pick_port=pick,
        )
    finally:
        taken.close()
    try:
        assert picked[0] == busy and port == picked[1] != busy and proc.poll() is None
        text = log_path.read_text()
        assert "Address already in use" in text and text.count("starting on port") == 2
    finally:
        sg.stop(proc)
    assert proc.returncode is not None


def test_port_retry_is_bounded_and_other_failures_are_not_retried(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    try:
        with pytest.raises(sg.ServerExited, match="Address already in use"):
            sg.start_on_free_port(
                lambda p: [sys.executable, "-c", HEALTH_SERVER, str(p)],
                "127.0.0.1",
                "test server",
                tmp_path / "a.log",
                {},
                timeout_s=30,
                pick_port=lambda host: busy,
                attempts=3,
            )
    finally:
        taken.close()
    assert (tmp_path / "a.log").read_text().count("starting on port") == 3

    with pytest.raises(sg.ServerExited, match="boom") as err:  # not a port problem: no retry
        sg.start_on_free_port(
            lambda p: [sys.executable, "-c", "raise SystemExit('boom')"], "127.0.0.1", "bad", tmp_path / "b.log", {}, 30
        )
    assert "fix:" in str(err.value) and str(tmp_path / "b.log") in str(err.value)
    assert (tmp_path / "b.log").read_text().count("starting on port") == 1


# ------------------------------------------------------------------ sglang missing


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_missing_sglang_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(RlhpcError, match=r"rlhpc\[gpu\]"):
        sg.require_module("sglang", "SGLang")

    from rlhpc.engine_server.host import EngineActor

    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        actor = EngineActor.options(num_gpus=1, num_cpus=1).remote("/m", str(tmp_path), 0, 10.0, None, spec(tp_size=1))
        with pytest.raises(ray.exceptions.RayActorError, match=r"pip install 'rlhpc\[gpu\]'"):
            ray.get(actor.url.remote())
    finally:
        ray.shutdown()
