"""Bounded resources per peer for any uvicorn server the job runs (issue 32, item 4; issue 43, item 1).

uvicorn times a connection only while it sits idle between requests, and stops doing so at its
first byte: a connection that never finishes its headers, or that sends half of a second
request after a complete first one, is held forever, and nothing caps how many there are or how
large their headers grow (held connections once exhausted an engine's file descriptors, and a
header flood grew it by 600 MB). The key is checked only once headers are complete, so none of
this needs it. The guard, as nginx's ``client_header_timeout`` and ``large_client_header_buffers``:

- every request on every connection, the first and each one after it on a kept-alive
  connection, gets ``header_timeout_s`` from its first byte (or from the connection's start)
  to complete its headers; so does whatever a client sends after its request was answered;
- headers (request line included) larger than ``max_header_bytes`` are answered 431 and the
  connection closed, so a connection holds at most that much of them;
- at most ``max_connections`` connections are open at once: a new one past the cap closes the
  connection that has been idle the longest (waiting for headers, or kept alive between
  requests), never one whose request is being served; when every one is served, the new one is
  closed. A client that sends its request at once is never the one closed: our clients
  (urllib3's pools) notice a closed idle connection before reusing it and open another.

Apply it to a server by its protocol class, one per server (the class holds that server's
connections): ``uvicorn.Config(app, http=guarded_protocol(), ...)``. It is uvicorn's httptools
protocol (what uvicorn picks where httptools is installed, as here), whatever the app.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

HEADER_TIMEOUT_S = 10.0
MAX_HEADER_BYTES = 32 * 1024  # nginx's large_client_header_buffers: 4 x 8 KB
MAX_CONNECTIONS = 512  # at most; and at most half the open-file limit (``connection_cap``)

_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"content-length: 33\r\nconnection: close\r\n\r\nrequest header fields too large\r\n"
)


def connection_cap(wanted: int = MAX_CONNECTIONS) -> int:
    """``wanted``, or half of this process's open-file limit where that is lower: the process
    needs descriptors of its own (model files, its clients), and a connection past the limit
    fails to be accepted at all."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if soft == resource.RLIM_INFINITY else max(8, min(wanted, soft // 2))


def guarded_protocol(
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_connections: int | None = None,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> type:
    """A protocol class for ``uvicorn.Config(http=...)``; one per server (its connections are shared).
    ``max_connections``: None is ``connection_cap()``."""
    cap = connection_cap() if max_connections is None else max_connections
    # every open connection; the idle ones (not being served) in the order of their last activity
    every: set[GuardedHttpTools] = set()
    idle: OrderedDict[GuardedHttpTools, None] = OrderedDict()
    closed = [0]

    class GuardedHttpTools(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _head = True  # the bytes coming in are a request's line and headers
        _head_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            every.add(self)
            self._idle()
            self._arm("sent no complete headers in time")
            if len(every) > cap:  # the longest idle goes; this one (the newest) only if all others are served
                next(iter(idle))._drop(f"more than {cap} connections were open")

        def data_received(self, data: bytes) -> None:
            if not self._serving():
                self._idle()  # the most recent activity: the last to be closed for the cap
                if self._deadline is None:  # a new request's first bytes (or more after an answer)
                    self._arm("sent no complete headers in time")
            super().data_received(data)
            if self._head:  # counted while served too: a pipelined request's headers are held as well
                self._head_bytes += len(data)
                if self._head_bytes > max_header_bytes and not self.transport.is_closing():
                    self.transport.write(_TOO_LARGE)
                    self._drop(f"sent more than {max_header_bytes} bytes of headers")

        def on_message_begin(self) -> None:
            self._head = True
            self._head_bytes = 0
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._head = False
            super().on_headers_complete()
            if self._serving():  # its request runs: no deadline while the app has it
                self._disarm()
                idle.pop(self, None)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self._serving() and not self.transport.is_closing():
                self._idle()  # kept alive: uvicorn's keep-alive timeout applies until the next byte

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            every.discard(self)
            idle.pop(self, None)
            super().connection_lost(exc)

        def _serving(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def _idle(self) -> None:
            idle[self] = None
            idle.move_to_end(self)

        def _arm(self, why: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(header_timeout_s, self._drop, why)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _drop(self, why: str) -> None:
            self._disarm()
            every.discard(self)
            idle.pop(self, None)
            closed[0] += 1
            if closed[0] in (1, 10, 100, 1000) or closed[0] % 10000 == 0:  # a flood: a few lines, not one each
                log.warning("closed a connection from %s that %s (%d so far)", _peer(self.client), why, closed[0])
            self.transport.close()

    return GuardedHttpTools


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
