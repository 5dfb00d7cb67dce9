"""The engine client's connections notice a silent peer: a node that lost power sends no reset,
so only the kernel's keepalive probes and user timeout end a request waiting on it (the node-loss
tests on the minicluster show the whole path)."""

from __future__ import annotations

import socket

from rlhpc.wire import client as client_module
from rlhpc.wire.client import EngineClient


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
