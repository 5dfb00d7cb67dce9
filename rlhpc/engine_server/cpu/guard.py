"""Bounded resources per unauthenticated peer: uvicorn's httptools protocol with a header
timeout and a cap on connections that have not sent their headers yet (issue 32, item 4).

uvicorn times out idle keep-alive connections but not a connection that never finishes its
headers, and the engine key is checked only once they are complete: holding thousands of
half-sent requests open once exhausted the engine's file descriptors, and an authorized
/generate failed. As nginx's ``client_header_timeout``, a connection gets ``header_timeout_s``
to send its first request's headers; at most ``max_pending`` such connections are open at once,
and a new one past the cap closes the oldest pending one, not itself: our clients send their
headers at once, so only a connection that sits on half a request is ever dropped. A request
refused for its key closes its connection (``RequireKey`` answers with ``connection: close``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("rlhpc.cpu_server")

HEADER_TIMEOUT_S = 10.0
MAX_PENDING = 256


def guarded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_pending: int = MAX_PENDING) -> type:
    """A protocol class for ``uvicorn.Config(http=...)``; one per server (its pending set is shared)."""
    pending: OrderedDict[GuardedHttpTools, asyncio.TimerHandle] = OrderedDict()
    dropped = [0]

    class GuardedHttpTools(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            pending[self] = self.loop.call_later(header_timeout_s, self._drop, "sent no complete headers in time")
            while len(pending) > max_pending:
                oldest = next(iter(pending))
                oldest._drop(f"more than {max_pending} connections without headers")

        def on_headers_complete(self) -> None:
            self._settled()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._settled()
            super().connection_lost(exc)

        def _settled(self) -> None:
            timer = pending.pop(self, None)
            if timer is not None:
                timer.cancel()

        def _drop(self, why: str) -> None:
            self._settled()
            dropped[0] += 1
            if dropped[0] in (1, 10, 100, 1000) or dropped[0] % 10000 == 0:  # a flood: a few lines, not one each
                log.warning("closed a connection from %s that %s (%d so far)", _peer(self.client), why, dropped[0])
            self.transport.close()

    return GuardedHttpTools


def _peer(client: Any) -> str:
    return f"{client[0]}:{client[1]}" if client else "?"
