"""The HTTP guard of every uvicorn server the job runs (rlhpc.util.http_guard), on a real uvicorn
server in this process with a tiny app and short limits: each deadline, each size cap, and which
connection the connection cap closes. The floods as another user, against the engine and the
agent endpoint, are in tests/integration (test_attacks.py, test_engine_auth.py, test_agent.py)."""

from __future__ import annotations

import asyncio
import resource
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from rlhpc.util.http_guard import GuardLimits, connection_cap, trust, uvicorn_options

BIG = 8 * 1024 * 1024  # an answer larger than the socket buffers on both sides
FAST = b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n"
KEYED = b"GET /fast HTTP/1.1\r\nHost: x\r\nX-Key: k\r\n\r\n"  # past the app's key check (``trust``)
SLOW = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"


class App:
    """/fast answers at once, /slow once ``release`` is set, /big with BIG bytes; a request with
    the key (``X-Key: k``) marks its connection a client's, as the engine's and the agent
    endpoint's key checks do."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.slow_in = 0  # /slow requests the app has
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's

    async def __call__(self, scope: dict, receive, send) -> None:
        if (b"x-key", b"k") in scope["headers"]:
            trust(scope)
        body = b"ok"
        if scope["path"] == "/slow":
            self.slow_in += 1
            while not self.release.is_set():
                await asyncio.sleep(0.01)
        elif scope["path"] == "/big":
            body = b"x" * BIG
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


@contextmanager
def serving(limits: GuardLimits) -> Iterator[tuple[tuple[str, int], App]]:
    app = App()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", log_config=None,
                                           **uvicorn_options(limits, "the test server")))  # fmt: skip

    async def serve() -> None:
        app.loop = asyncio.get_running_loop()
        await server.serve(sockets=[sock])

    app.server = server  # its connections, for a test that waits for the guard to close one
    thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname(), app
    finally:
        app.release.set()
        server.should_exit = True
        thread.join(10)
        sock.close()


def connect(address: tuple[str, int], data: bytes = b"") -> socket.socket:
    s = socket.create_connection(address, timeout=10)
    s.sendall(data)
    return s


def answer(s: socket.socket) -> bytes:
    """One answer's head and body (its content-length), or what came before the server closed."""
    got = b""
    while b"\r\n\r\n" not in got or len(got) < got.index(b"\r\n\r\n") + 4 + _length(got):
        chunk = s.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _length(got: bytes) -> int:
    head = got.split(b"\r\n\r\n", 1)[0].lower()
    return int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])


def closed(s: socket.socket) -> bool:
    """Does the server close it within the socket's timeout (reading what it sent first)?"""
    try:
        while s.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


SHORT = GuardLimits(header_timeout_s=0.3, body_timeout_s=0.3, write_stall_s=0.3, max_connections=64, backlog=16,
                    max_header_bytes=1024, max_body_bytes=4096)  # fmt: skip


def test_every_request_has_deadlines_and_size_caps() -> None:
    with serving(SHORT) as (address, app):
        half = connect(address, b"GET /fast HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        kept = connect(address, FAST)
        assert answer(kept).startswith(b"HTTP/1.1 200")
        kept.sendall(b"GET /fast HTTP/1.1\r\n")  # the kept-alive connection's second request, half
        body = connect(address, b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        served = connect(address, FAST)  # a client that sends its request at once: answered, kept
        assert answer(served).startswith(b"HTTP/1.1 200")
        assert closed(half) and closed(kept) and closed(body)
        served.sendall(FAST)
        assert answer(served).startswith(b"HTTP/1.1 200")

        big = connect(address, b"GET /fast HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 2000 + b"\r\n\r\n")
        assert answer(big).startswith(b"HTTP/1.1 431") and closed(big)
        heavy = connect(address, b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"a" * 5000)
        assert answer(heavy).startswith(b"HTTP/1.1 413") and closed(heavy)
        # an answer its client does not read: closed, so less than all of it ever arrives
        connections = app.server.server_state.connections
        before = set(connections)
        stalled = connect(address, b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
        # wait for the guard to drop this connection rather than a fixed time (under load a sleep
        # can end before the guard acts; unguarded, it waits out the deadline and reads it all)
        deadline = time.monotonic() + 20
        while not set(connections) - before and time.monotonic() < deadline:
            time.sleep(0.01)
        while set(connections) - before and time.monotonic() < deadline:
            time.sleep(0.05)
        stalled.settimeout(3)
        got = 0
        try:
            while chunk := stalled.recv(1 << 20):
                got += len(chunk)
        except (ConnectionResetError, TimeoutError):  # closed; or, unguarded, all of it and then nothing
            pass
        assert got < BIG, got


def test_past_the_cap_the_least_recently_active_goes_never_a_key_holders_nor_one_being_answered() -> None:
    limits = GuardLimits(header_timeout_s=30, max_connections=3, backlog=16)
    with serving(limits) as (address, app):

        def answering(s: socket.socket, n: int) -> socket.socket:
            s.sendall(SLOW)
            while app.slow_in < n:
                time.sleep(0.01)
            return s

        def served(s: socket.socket, request: bytes = FAST) -> socket.socket:
            s.sendall(request)
            assert answer(s).startswith(b"HTTP/1.1 200")
            return s

        def is_closed(s: socket.socket) -> bool:
            s.settimeout(0.5)
            return closed(s)

        a = answering(connect(address), 1)
        b, c = served(connect(address)), connect(address)  # answered and kept alive; nothing sent yet
        d = connect(address)
        assert is_closed(b) and not is_closed(c)  # the least recently active, answered or not
        served(c, KEYED)
        e = connect(address)
        assert is_closed(d) and not is_closed(c)  # d opened before c's latest request
        served(served(e))
        f = connect(address)  # c carried the key (a client's pool), e only keyless requests: e goes,
        assert is_closed(e) and not is_closed(c)  # though more recent and answered twice
        answering(c, 2)
        answering(f, 3)
        g = connect(address)  # every other one is being answered: this one goes
        assert is_closed(g)
        app.release.set()
        for s in (a, c, f):
            s.settimeout(10)
            assert answer(s).startswith(b"HTTP/1.1 200")


def test_a_burst_past_the_cap_closes_half_sent_ones_never_a_pools_idle_one() -> None:
    # Under load the server's loop accepts a burst of connections before reading any of their
    # bytes: the half-sent ones must go, not a pool's idle connection its client may be reusing
    # at that moment (the agent's failed under another user's flood, with the loop busy)
    limits = GuardLimits(header_timeout_s=30, max_connections=3, backlog=16)
    with serving(limits) as (address, app):
        pool = connect(address, KEYED)
        assert answer(pool).startswith(b"HTTP/1.1 200")
        stalled, resume = threading.Event(), threading.Event()
        app.loop.call_soon_threadsafe(lambda: (stalled.set(), resume.wait(10)))  # the loop busy, as under load
        assert stalled.wait(10)
        half = [connect(address, b"GET /fast HTTP/1.1\r\nHost: x\r\n") for _ in range(4)]
        sent = connect(address, FAST)  # in the same burst, a request sent whole: answered
        resume.set()
        assert answer(sent).startswith(b"HTTP/1.1 200")
        for s in half[:3]:  # the three over the cap, oldest first
            s.settimeout(5)
            assert closed(s)
        pool.settimeout(0.5)
        assert not closed(pool)
        pool.settimeout(10)
        pool.sendall(KEYED)
        assert answer(pool).startswith(b"HTTP/1.1 200")


def test_the_cap_is_at_most_half_the_open_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard))
    try:
        assert connection_cap(512) == 100 and connection_cap(64) == 64
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
