"""The engine client's connections notice a silent peer: a node that lost power sends no reset,
so only the kernel's keepalive probes and user timeout end a request waiting on it (the node-loss
tests on the minicluster show the whole path). A batch sent one prompt per request (through the
router) comes back in order, fails as one error naming its prompt, and ends when the client closes."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhpc.wire import client as client_module
from rlhpc.wire.client import EngineClient, EngineUnavailable, RequestRefused


def test_every_connection_probes_its_peer_and_bounds_unacknowledged_sends() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    c = EngineClient(f"http://127.0.0.1:{port}")
    url = f"{c.base_url}/health"
    conn = c._http.connection_from_url(url)._new_conn()  # as a request makes it
    conn.connect()  # completes in the listen backlog; taken off it here, no thread to race the close
    peer, _ = server.accept()
    try:
        sock = conn.sock
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1  # urllib3's own default kept
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == client_module.KEEPALIVE_IDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == client_module.KEEPALIVE_INTERVAL_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == client_module.KEEPALIVE_PROBES
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == client_module.USER_TIMEOUT_MS
    finally:
        conn.close()
        c.close()
        peer.close()
        server.close()


def test_a_batchs_prompts_go_on_connections_that_probe_their_peer_too() -> None:
    # the per-prompt path (aiohttp, one event loop) makes its sockets with the same options
    sock = client_module._keepalive_socket((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ()))
    try:
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == client_module.KEEPALIVE_IDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == client_module.USER_TIMEOUT_MS
    finally:
        sock.close()


class _Engine(ThreadingHTTPServer):
    """Answers /generate with the prompt it got (its first token id 0: after ``hold`` is set);
    token id 999 is refused (HTTP 400), as an engine refuses a token out of range."""

    daemon_threads = True

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.arrived = threading.Semaphore(0)
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # kept alive, as the engines' connections

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.arrived.release()
                if body["input_ids"][0] == 0:
                    engine.hold.wait(10)
                status = 400 if 999 in body["input_ids"] else 200
                data = json.dumps({"error": {"message": "token id out of range"}} if status == 400 else body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def test_a_batch_sent_prompt_by_prompt_comes_back_in_order_and_one_refusal_names_its_prompt() -> None:
    engine = _Engine()
    c = EngineClient(f"http://127.0.0.1:{engine.server_address[1]}", timeout_s=10, per_prompt=True)
    try:
        prompts = [[i, 1, 2] for i in range(1, 40)]
        outs = c.generate(input_ids=prompts, sampling_params=[{"sampling_seed": i} for i in range(39)])
        assert [o["input_ids"] for o in outs] == prompts
        assert [o["sampling_params"]["sampling_seed"] for o in outs] == list(range(39))
        with pytest.raises(RequestRefused) as err:
            c.generate(input_ids=[[1], [2, 999], [3]], sampling_params={"sampling_seed": 5})
        assert "refused prompt 1 of 3" in err.value.problem and "token id out of range" in err.value.problem
        assert err.value.status == 400
    finally:
        c.close()
        engine.shutdown()


def test_a_client_closed_while_its_batch_is_in_flight_ends_the_send_with_engine_unavailable() -> None:
    engine = _Engine()
    c = EngineClient(f"http://127.0.0.1:{engine.server_address[1]}", timeout_s=10, per_prompt=True)
    try:
        with ThreadPoolExecutor(1) as ex:
            sent = ex.submit(c.generate, input_ids=[[0], [0]])  # held by the engine
            assert engine.arrived.acquire(timeout=10) and engine.arrived.acquire(timeout=10)
            c.close()  # as the job does when it starts the router again
            with pytest.raises(EngineUnavailable, match="replaced while a batch was being sent"):
                sent.result(timeout=10)
        with pytest.raises(EngineUnavailable, match="replaced"):  # and a batch after it is not sent
            c.generate(input_ids=[[1], [2]])
    finally:
        engine.hold.set()
        engine.shutdown()
