"""A guard for the HTTP servers a job runs, against peers that hold connections or send too much
(issue 43): uvicorn's httptools protocol with a deadline on every request and caps on what one
connection or all of them may hold. Shared by the servers that face other users of the node:
rlhpc's agent endpoint in the driver (``rlhpc.rollout.agent_endpoint``), and meant for the CPU
engine server as well (``rlhpc.engine_server.cpu.guard`` guards its first request so far).

uvicorn times out idle keep-alive connections, but not a connection that is sending a request:
one that trickles its headers or its body, a byte at a time or not at all, is held forever, and
thousands of them exhaust the server's file descriptors (the driver failed with "Too many open
files"). Every request here has deadlines, as nginx's ``client_header_timeout`` and
``client_body_timeout``: its line and headers within ``header_timeout_s`` of its first byte (a new
connection's, of its opening), its body within ``body_timeout_s`` of its headers. Past them, or
past ``max_header_bytes`` of headers or ``max_body_bytes`` of body, the connection is closed. At
most ``max_connections`` are open at once: a new one past the cap closes the oldest connection
that has not finished a request yet, else the oldest idle kept-alive one, else itself; a
connection being answered is never dropped for a newer one, and a client that was answered keeps
its idle connection while others flood. A burst of new connections is accepted ``backlog`` at a
time (uvicorn's default, 2048, let one turn of the loop take thousands of descriptors before any
was checked), so the server holds at most about ``max_connections`` + 2 x ``backlog``. An answer the client stops reading for
``write_stall_s`` closes its connection too. The server's own work on a request (a generation) has
no deadline here: it is not the peer's to stretch.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GuardLimits:
    header_timeout_s: float = 10.0  # a request's line and headers, from its first byte (a new connection: its opening)
    body_timeout_s: float = 60.0  # its body, from the end of its headers
    idle_timeout_s: float = 30.0  # a kept-alive connection between requests (uvicorn's timeout_keep_alive)
    write_stall_s: float = 60.0  # an answer the client does not read
    max_connections: int = 256
    # connections accepted at once (the listen backlog, and what asyncio accepts per turn of its
    # loop): the descriptors a burst takes before the cap can close them
    backlog: int = 128
    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 64 * 1024 * 1024


class RequestTooLarge(Exception):
    """Raised inside the parser's callbacks: httptools stops, uvicorn answers 400 and closes."""


def guarded_protocol(limits: GuardLimits, server: str) -> type:
    """A protocol class for ``uvicorn.Config(http=..., backlog=limits.backlog)``, one per server
    (its connections are counted together); ``server`` names it in the log."""
    open_conns: OrderedDict[Any, None] = OrderedDict()  # every open connection, oldest first
    dropped = [0]

    class GuardedHttpTools(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._timer: asyncio.TimerHandle | None = None
            self._answering = False  # from a request's headers to the end of its answer
            self._served = False  # answered a request and kept open (a refused caller is closed)
            self._sizes = [0, 0]  # this request's header and body bytes
            open_conns[self] = None
            self._arm(limits.header_timeout_s, "sent no complete request headers in time")
            if len(open_conns) > limits.max_connections:
                # the oldest that never finished a request, else the oldest idle one, else this one
                idle = [c for c in open_conns if not c._answering]
                victim = next((c for c in idle if not c._served), idle[0] if idle else self)
                victim._drop(f"was the oldest of more than {limits.max_connections} connections")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            open_conns.pop(self, None)
            super().connection_lost(exc)

        # the request as the parser reads it
        def on_message_begin(self) -> None:
            self._sizes = [0, 0]
            if self._timer is None:  # a kept-alive connection's next request: timed from its first byte
                self._arm(limits.header_timeout_s, "sent no complete request headers in time")
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._count(0, len(url), limits.max_header_bytes, "headers")
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(0, len(name) + len(value) + 4, limits.max_header_bytes, "headers")
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._answering = True
            self._arm(limits.body_timeout_s, "sent no complete body in time")
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            self._count(1, len(body), limits.max_body_bytes, "body")
            super().on_body(body)

        def on_message_complete(self) -> None:
            self._disarm()  # the request is in: what remains is the server's work
            super().on_message_complete()

        def on_response_complete(self) -> None:
            self._answering, self._served = False, True
            super().on_response_complete()

        # the answer as the client reads it
        def pause_writing(self) -> None:
            super().pause_writing()
            self._arm(limits.write_stall_s, "stopped reading its answer")

        def resume_writing(self) -> None:
            super().resume_writing()
            self._disarm()

        # the guard's own
        def _count(self, which: int, n: int, cap: int, what: str) -> None:
            self._sizes[which] += n
            if self._sizes[which] > cap:
                self._note(f"sent more than {cap} bytes of {what}")
                raise RequestTooLarge(f"request {what} over {cap} bytes")

        def _arm(self, seconds: float, why: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._drop, why)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _drop(self, why: str) -> None:
            self._disarm()
            open_conns.pop(self, None)
            self._note(why)
            self.transport.abort()  # not close(): that would wait to flush an answer nobody reads

        def _note(self, why: str) -> None:
            dropped[0] += 1
            if dropped[0] in (1, 10, 100, 1000) or dropped[0] % 10000 == 0:  # a flood: a few lines, not one each
                log.warning("%s closed a connection from %s that %s (%d so far)", server, _peer(self.client), why,
                            dropped[0])  # fmt: skip

    return GuardedHttpTools


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
