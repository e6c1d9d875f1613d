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

With ``tls`` (the control API under ``--auth tls``) the TLS handshake is done here too, after the
connection was admitted and within the header deadline (handed to uvicorn, it would run before any
limit applies, with asyncio's 60 s timeout); the identity the client certificate names goes into each
request's scope (``api.auth.PEER_SCOPE_KEY``), where the authorizer finds it.

A connection past a deadline is closed (an application reading its body sees a disconnect). The
probe server (``tierckpt_replicator.probes``) runs the same protocol on its own port and loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import ssl
from asyncio import sslproto
from collections.abc import Callable
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tierckpt.protocol.identity import Peer, peer_of
from tierckpt_replicator.api.auth import PEER_SCOPE_KEY
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


def guarded_http(
    limits: ApiLimits, tls: Callable[[], ssl.SSLContext] | None = None
) -> tuple[type[asyncio.Protocol], SourceLimits]:
    """A uvicorn ``http`` protocol class enforcing ``limits`` (and serving TLS with the context ``tls()``
    gives, if any: uvicorn's own ``ssl`` must then be off), and its connection counter."""
    connections = SourceLimits(limits.name, total=limits.total, per_source=limits.per_source)

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        _source: str | None = None
        _timer: asyncio.TimerHandle | None = None
        _raw: asyncio.Transport | None = None
        """The TCP transport while the TLS handshake runs (before uvicorn sees the connection)."""
        _made = False
        _early: list[bytes]
        peer: Peer | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._early = []
            peername = transport.get_extra_info("peername")
            source = str(peername[0]) if peername else "?"
            if not connections.admit(source):
                transport.abort()
                return
            self._source = source
            if tls is None:
                self._made_with(transport)
                return
            # The TLS layer goes in now, before the event loop reads a byte (uvloop starts reading
            # right after this returns, pause or not, so loop.start_tls, which runs a step later,
            # would miss the ClientHello): asyncio's own SSL protocol, as loop.start_tls builds it.
            self._raw = transport
            self._arm(limits.header_timeout, "handshake and headers")
            waiter: asyncio.Future[None] = self.loop.create_future()
            layer = sslproto.SSLProtocol(
                self.loop,
                self,
                tls(),
                waiter,
                server_side=True,
                call_connection_made=False,
                ssl_handshake_timeout=math.ceil(limits.header_timeout),  # our deadline closes it first
            )
            transport.set_protocol(layer)
            layer.connection_made(transport)
            waiter.add_done_callback(lambda done: self._handshake_done(done, layer))

        def _handshake_done(self, done: asyncio.Future[None], layer: sslproto.SSLProtocol) -> None:
            raw, self._raw = self._raw, None
            exc = None if done.cancelled() else done.exception()
            if done.cancelled() or exc is not None or raw is None or raw.is_closing():
                log.debug("%s: TLS handshake with %s failed: %s", limits.name, self._source, exc)
                if raw is not None:
                    raw.abort()
                self._disarm()
                self._release()  # the TLS layer tells the application nothing of a failed handshake
                return
            getter = getattr(layer, "_get_app_transport", None)  # Python 3.11+; 3.10: the attribute
            secured = getter() if getter is not None else layer._app_transport
            ssl_object = cast("ssl.SSLObject | None", secured.get_extra_info("ssl_object"))
            self.peer = peer_of(ssl_object.getpeercert()) if ssl_object is not None else None
            self._made_with(secured, armed=True)

        def _made_with(self, transport: asyncio.Transport, *, armed: bool = False) -> None:
            super().connection_made(transport)
            self._made = True
            if not armed:
                self._arm(limits.header_timeout, "headers")
            early, self._early = self._early, []
            for data in early:
                super().data_received(data)

        def data_received(self, data: bytes) -> None:
            if not self._made:  # the request may arrive with the handshake's end, before start_tls returns
                self._early.append(data)
                return
            super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._release()
            if self._made:
                super().connection_lost(exc)

        def _release(self) -> None:
            if self._source is not None:
                connections.release(self._source)
                self._source = None

        def on_message_begin(self) -> None:
            super().on_message_begin()
            cast("dict[str, Any]", self.scope)[PEER_SCOPE_KEY] = self.peer
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
            transport = self.transport if self._made else self._raw
            if transport is not None and not transport.is_closing():
                log.debug(
                    "%s: closing %s: request %s not received within %gs",
                    limits.name,
                    self._peer(),
                    what,
                    seconds,
                )
                transport.close()

        def _peer(self) -> str:
            if self._made and self.client:
                return f"{self.client[0]}:{self.client[1]}"
            return self._source or "a client"

    GuardedHttpToolsProtocol.__name__ = GuardedHttpToolsProtocol.__qualname__ = "GuardedHttpToolsProtocol"
    return GuardedHttpToolsProtocol, connections
