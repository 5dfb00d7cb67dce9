"""The one guard of every uvicorn server the job runs against peers that hold connections or send
too much (issue 32, item 4; issue 43, items 1 and 2): the CPU engine server, and rlhpc's agent
endpoint in the driver. Both listen where every user of the node reaches them, and the key is
checked only once a request's headers are complete, so none of this needs it.

uvicorn times a connection only while it sits idle between requests: one that trickles its
headers or its body, or sends half of a second request after a complete first one, is held
forever, and nothing caps how many there are or how large their headers grow (held connections
once exhausted an engine's file descriptors and made the driver fail with "Too many open files",
and a header flood grew an engine by 600 MB). The guard, as nginx's ``client_header_timeout``,
``client_body_timeout``, ``large_client_header_buffers`` and ``client_max_body_size``
(the limits in ``GuardLimits``):

- every request on every connection, the first and each one after it on a kept-alive
  connection, gets ``header_timeout_s`` from its first byte (a new connection's: from its
  opening) to complete its line and headers, and ``body_timeout_s`` from there for its body;
- headers past ``max_header_bytes`` (counted as they arrive, before the parser holds them) are
  answered 431 and a body past ``max_body_bytes`` 413, and the connection is closed;
- an answer its client stops reading for ``write_stall_s`` closes the connection;
- at most ``max_connections`` are open at once, and at most half the open-file limit
  (``connection_cap``: the process needs descriptors of its own). A new connection past the cap
  closes, least recently active first, one holding part of a request's head (read, or still in
  the kernel: a burst of connections is accepted before any of their bytes are read, so the
  bytes are peeked), else an idle or silent one that never carried a request with the key,
  else itself. Never closed for a newer one: a connection being answered, one whose kernel holds
  a whole request head (its client has just sent it), and a key holder's idle connection (the
  app's key check marks it: ``trust``; another user's, which can only reach the open /health
  and 401s, goes however many requests it carried). Closing an idle kept-alive connection
  races its client, which may be writing its next request on it at that moment and then reads
  a reset (RFC 9112, 9.3.1; a client with no retries, as an agent's may be, fails that request):
  only the idle deadline ends a pool's connection (httpx's pools drop theirs after 5 s idle,
  before it). Where all the others are busy or pools, the new connection goes, as one past a
  full listen queue would;
- a burst of new connections is accepted ``backlog`` at a time (the listen backlog, and what
  asyncio's loop accepts per turn), so a flood holds about ``max_connections`` + 2 x ``backlog``.

The server's own work on a request (a generation) has no deadline here: it is not the peer's to
stretch. Apply it with ``uvicorn.Config(app, **uvicorn_options(limits, "the server"), ...)``: it
is uvicorn's httptools protocol (what uvicorn picks where httptools is installed, as here).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import socket
import struct
import termios
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
    max_connections: int = 512  # and at most half the open-file limit (connection_cap)
    # connections accepted at once (the listen backlog, and what asyncio accepts per turn of its
    # loop): the descriptors a burst takes before the cap closes them. uvicorn's default: the
    # engine's clients open hundreds at the start of a rollout, and a full queue drops a SYN for 1 s
    backlog: int = 2048
    max_header_bytes: int = 32 * 1024  # nginx's large_client_header_buffers: 4 x 8 KB
    max_body_bytes: int = 64 * 1024 * 1024


def connection_cap(wanted: int = GuardLimits.max_connections) -> int:
    """``wanted``, or half of this process's open-file limit where that is lower: the process
    needs descriptors of its own (model files, its clients), and a connection past the limit
    fails to be accepted at all."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if soft == resource.RLIM_INFINITY else min(wanted, max(8, soft // 2))


def uvicorn_options(limits: GuardLimits, server: str) -> dict[str, Any]:
    """What ``uvicorn.Config`` takes from the limits: the guarded protocol, keep-alive, backlog."""
    return {
        "http": guarded_protocol(limits, server),
        "timeout_keep_alive": limits.idle_timeout_s,
        "backlog": limits.backlog,
    }


def _answer(status: str) -> bytes:
    text = status.split(" ", 1)[1].lower().encode()
    return (
        b"HTTP/1.1 " + status.encode() + b"\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: "
        + str(len(text)).encode() + b"\r\nconnection: close\r\n\r\n" + text
    )  # fmt: skip


_HEADERS_TOO_LARGE = _answer("431 Request Header Fields Too Large")
_BODY_TOO_LARGE = _answer("413 Content Too Large")


def guarded_protocol(limits: GuardLimits, server: str) -> type:
    """A protocol class for ``uvicorn.Config(http=...)``, one per server (the class counts that
    server's connections together); ``server`` names it in the log."""
    cap = connection_cap(limits.max_connections)
    count = [0, 0]  # open connections, connections closed by the guard
    # the cap's victims, first to last: every connection not being answered, by its last
    # activity (its opening, a byte of a request, its last answer)
    quiet: OrderedDict[GuardedHttpTools, None] = OrderedDict()

    class GuardedHttpTools(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None  # the request's headers or body, or the idle wait
        _stall: asyncio.TimerHandle | None = None  # the answer's reading
        _counted = False
        _kept = False  # answered and kept alive, no next request begun: the idle timer runs
        _answers = 0
        _trusted = False  # carried a request the app's key check let through (``trust``)
        _head = True  # the bytes coming in are a request's line and headers
        _head_bytes = 0
        _body_bytes = 0
        _refusal: tuple[bytes | None, str] | None = None  # the answer (or none) and the reason, once refused

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            count[0] += 1
            self._counted = True
            quiet[self] = None
            self._wait()
            if count[0] > cap:
                self._shed()

        def connection_lost(self, exc: Exception | None) -> None:
            self._forget()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self in quiet:  # its latest activity: the last of them the cap closes
                quiet.move_to_end(self)
            if self._kept:  # a kept-alive connection's next request: timed from its first byte
                self._wait()
            super().data_received(data)
            # raw bytes of a request whose headers are not complete yet: httptools holds a header
            # until its end (a pipelined request's first chunk may count a body's tail too)
            if self._head and self._refusal is None:
                self._head_bytes += len(data)
                if self._head_bytes > limits.max_header_bytes:
                    self._refuse_headers()
            if self._refusal is not None and not self.transport.is_closing():
                self._refuse(*self._refusal)

        # the request as the parser reads it; once refused, none of it reaches uvicorn or the app
        def on_message_begin(self) -> None:
            if self._refusal is None:
                self._head, self._head_bytes, self._body_bytes = True, 0, 0
                if self._kept:  # begun in the chunk that ended the one before
                    self._wait()
                super().on_message_begin()
                self.scope[_CONNECTION] = self  # for ``trust``: the app's key check marks its connection

        def on_url(self, url: bytes) -> None:
            if self._refusal is None:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self._refusal is None:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._refusal is not None:
                return
            self._head = False
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > limits.max_header_bytes:  # arrived whole, in one chunk
                self._refuse_headers()
                return
            quiet.pop(self, None)  # being answered from here (or queued behind a pipelined one)
            self._arm(limits.body_timeout_s, "sent no complete body in time")
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if self._refusal is None:
                self._body_bytes += len(body)
                if self._body_bytes > limits.max_body_bytes:
                    # answered 413, unless its answer has begun (the client would read two)
                    answer = None if self.cycle.response_started else _BODY_TOO_LARGE
                    self._refusal = (answer, f"sent more than {limits.max_body_bytes} bytes of body")
                else:
                    super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refusal is not None:
                return
            self._disarm()  # the request is in: what remains is the server's work
            super().on_message_complete()
            if self.cycle is not None and self.cycle.response_complete:  # answered before its body was in
                self._settle()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._settle()  # else closed, or a pipelined request is answered next

        # the answer as the client reads it
        def pause_writing(self) -> None:
            super().pause_writing()
            self._cancel(self._stall)
            self._stall = self.loop.call_later(limits.write_stall_s, self._drop, "stopped reading its answer")

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stall = self._cancel(self._stall)

        # the guard's own
        def _settle(self) -> None:
            """Answered: a next request begun is timed; else the connection is kept alive, idle."""
            self._answers += 1
            quiet[self] = None
            quiet.move_to_end(self)
            if self._head and self._head_bytes:
                self._wait()
            else:
                self._kept = True
                # uvicorn's keep-alive timer, which a byte after the answer cancels for good
                self._arm(limits.idle_timeout_s, None)

        def _wait(self) -> None:
            self._kept = False
            self._arm(limits.header_timeout_s, "sent no complete request headers in time")

        def _arm(self, seconds: float, why: str | None) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._drop, why)

        def _disarm(self) -> None:
            self._deadline = self._cancel(self._deadline)

        @staticmethod
        def _cancel(timer: asyncio.TimerHandle | None) -> None:
            if timer is not None:
                timer.cancel()

        def _shed(self) -> None:
            """Past the cap (a new connection, this one, is in): close one whose client cannot be
            in the middle of sending a request it expects answered, else this new one."""
            slow, stranger = None, None
            for c in quiet:  # least recently active first
                pending = c._pending()
                if pending is True:
                    continue  # a whole request head waits in the kernel: its client has just sent it
                if c._head and c._head_bytes:  # part of a request head read: trickled
                    slow = c
                    break
                if c._trusted:
                    continue  # a pool's (below)
                if pending is False:  # part of a head only, not read yet: a burst's half-sent requests
                    slow = c
                    break
                if stranger is None and c is not self:  # idle, or opened and silent
                    stranger = c
            # an idle connection that carried a request with the key is a pool's: its client may be
            # writing its next request on it at this moment, and would read a reset. Never closed
            # here (its idle deadline ends it, past the client's own): this new one goes instead.
            # One that carried only keyless requests (an open /health, 401s) goes like any other
            victim = slow or stranger or self
            victim._drop(f"was opened past the cap of {cap} connections, every other one busy or a pool's" if victim is self
                         else f"was the least recently active half-sent or idle one past the cap of {cap} connections")  # fmt: skip

        def _pending(self) -> bool | None:
            """What the kernel holds for it that the loop has not read yet: None nothing, True a
            request head's end among it, False part of a head only. Peeked, not read: a burst of
            new connections is accepted before any of their bytes are."""
            sock = None
            try:
                fd = self.transport.get_extra_info("socket").fileno()
                if not struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]:
                    return None
                sock = socket.socket(fileno=fd)  # the transport's own descriptor, detached below
                return b"\r\n\r\n" in sock.recv(limits.max_header_bytes + 4, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (AttributeError, OSError, ValueError):  # closed meanwhile
                return None
            finally:
                if sock is not None:
                    sock.detach()

        def _forget(self) -> None:
            self._disarm()
            self._stall = self._cancel(self._stall)
            quiet.pop(self, None)
            if self._counted:
                count[0] -= 1
                self._counted = False

        def _refuse_headers(self) -> None:
            # answered 431, unless a pipelined request before it is being answered
            answer = _HEADERS_TOO_LARGE if self.cycle is None or self.cycle.response_complete else None
            self._refusal = (answer, f"sent more than {limits.max_header_bytes} bytes of headers")

        def _refuse(self, answer: bytes | None, why: str) -> None:
            if answer is not None:
                self.transport.write(answer)
            self._drop(why, flush=answer is not None)

        def _drop(self, why: str | None, flush: bool = False) -> None:
            """Closed; ``why`` None: an idle kept-alive connection's end, not worth a line."""
            self._forget()
            if why is not None:
                count[1] += 1
                if count[1] in (1, 10, 100, 1000) or count[1] % 10000 == 0:  # a flood: a few lines, not one each
                    log.warning("%s closed a connection from %s that %s (%d so far)", server, _peer(self.client),
                                why, count[1])  # fmt: skip
            # close() sends what was written first; abort() does not wait for a client that reads nothing
            if flush or why is None:
                self.transport.close()
            else:
                self.transport.abort()

    return GuardedHttpTools


_CONNECTION = "rlhpc.guarded_connection"  # the scope key of a request's guarded connection


def trust(scope: dict) -> None:
    """The app's key check let this request through: its connection is a client's, never closed
    for a newer one past the cap (only its idle deadline ends it). A scope of an unguarded server
    is left as it is."""
    connection = scope.get(_CONNECTION)
    if connection is not None:
        connection._trusted = True


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
