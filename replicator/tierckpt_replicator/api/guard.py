"""Slow and crowding clients cannot hold the replicator's HTTP servers: deadlines and connection limits.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) and answers 503 past
``limit_concurrency``, but has no deadline for a request's headers or body: a client that trickles
one header byte every few seconds keeps its connection, and 128 of them make every request a 503
(slowloris). ``guarded_http(limits)`` is uvicorn's httptools protocol with what is missing:

* **connection limits**: a connection is admitted only within ``ApiLimits.per_source`` from its
  address and ``ApiLimits.total`` in all (``SourceLimits``), else closed at once;
* **header deadline**: the request line and headers must be complete ``header_timeout`` seconds after
  the connection (or, on a kept-alive connection, the request) began;
* **body deadline**: the body must be complete ``body_timeout`` seconds after the headers.

A connection past a deadline is closed (an application reading its body sees a disconnect). The
probe server (``tierckpt_replicator.probes``) runs the same protocol on its own port and loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tierckpt_replicator.connlimits import SourceLimits

__all__ = ["ApiLimits", "guarded_http"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ApiLimits:
    """The bounds of one HTTP server."""

    name: str
    header_timeout: float
    body_timeout: float
    total: int
    per_source: int


def guarded_http(limits: ApiLimits) -> tuple[type[asyncio.Protocol], SourceLimits]:
    """A uvicorn ``http`` protocol class enforcing ``limits``, and its connection counter."""
    connections = SourceLimits(limits.name, total=limits.total, per_source=limits.per_source)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _source: str | None = None
        _timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            source = self.client[0] if self.client else "?"
            if not connections.admit(source):
                transport.abort()
                return
            self._source = source
            self._arm(limits.header_timeout, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._source is not None:
                connections.release(self._source)
                self._source = None
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._timer is None:  # a kept-alive connection's next request: its own deadline
                self._arm(limits.header_timeout, "headers")

        def on_headers_complete(self) -> None:
            self._disarm()
            self._arm(limits.body_timeout, "body")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def _arm(self, seconds: float, what: str) -> None:
            self._timer = self.loop.call_later(seconds, self._expire, seconds, what)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self, seconds: float, what: str) -> None:
            self._timer = None
            if not self.transport.is_closing():
                log.debug(
                    "%s: closing %s: request %s not received within %gs",
                    limits.name,
                    self._peer(),
                    what,
                    seconds,
                )
                self.transport.close()

        def _peer(self) -> str:
            return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

    GuardedHttpToolsProtocol.__name__ = GuardedHttpToolsProtocol.__qualname__ = "GuardedHttpToolsProtocol"
    return GuardedHttpToolsProtocol, connections
