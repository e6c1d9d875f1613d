"""Slow and crowding clients cannot hold the replicator's HTTP servers: an accept loop of our own, with
connection limits and deadlines, in front of uvicorn's HTTP protocol.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) and answers 503 past
``limit_concurrency``, but it admits every connection, runs a TLS handshake for up to 60 s before any
limit applies, and has no deadline for a request's headers or body: a client that trickles one byte
every few seconds keeps its connection, and enough of them make every request a 503 (slowloris).
``GuardedServer`` is a ``uvicorn.Server`` whose connections come from its own accept loop instead:

* **admission** (``tierckpt_replicator.connlimits``): within ``ApiLimits.per_source`` connections
  from one address and ``ApiLimits.total`` in all, else closed at once; when all are open, the oldest
  pending (unauthenticated) connection of the source holding the most pending ones makes room, never an
  authenticated one; under pressure a new connection gets a shorter deadline;
* **TLS** (the control API under ``--auth tls``): the handshake is the event loop's
  (``loop.connect_accepted_socket``), within the connection's deadline; once it is done, with a client
  certificate of the CA, the connection is authenticated and the identity the certificate names goes
  into each request's scope (``api.auth.PEER_SCOPE_KEY``, by ``_PeerScope``), where the authorizer
  finds it. Without TLS, a connection is authenticated once its first request is complete;
* **header deadline**: the request line and headers must be complete within the connection's deadline
  (which the TLS handshake shares) or, on a kept-alive connection, ``header_timeout`` seconds after the
  next request began;
* **body deadline**: the body must be complete ``body_timeout`` seconds after the headers.

A connection past a deadline is aborted (an application reading its body sees a disconnect). The
deadlines follow a second httptools parser fed the same bytes as uvicorn's (``_Connection``): it sees
where each request's headers and body end without reaching into uvicorn. The probe server
(``tierckpt_replicator.probes``) is a ``GuardedServer`` too, on its own port and loop.

Seams. Of asyncio only public APIs (``sock_accept``, ``connect_accepted_socket``, protocols and
transports), and httptools' parser; no private class of asyncio or uvicorn is subclassed or built. Of
uvicorn, ``Server`` (public: subclassed through ``startup(sockets=[])``, the lifespan with no listener
of its own, ``shutdown``, ``capture_signals`` and the ``started``/``should_exit`` flags), and the
protocol class ``Config.http_protocol_class`` made with the keyword arguments ``Server.startup`` gives
it (``config``, ``server_state``, ``app_state``: the server's ``server_state`` and ``lifespan.state``).
That last one is not documented, so pyproject.toml pins the uvicorn versions this was tested with
(``TESTED_UVICORN``) and ``tests/replicator/test_guard.py`` fails on any other: upgrade it only with
those tests passing. (The guard used to subclass uvicorn's httptools protocol and build asyncio's
private SSL protocol; the TLS handshake had to be forced in before uvloop read the first bytes.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import Any, cast

import httptools
import uvicorn

from tierckpt.protocol.identity import Peer, peer_of
from tierckpt_replicator.api.auth import PEER_SCOPE_KEY
from tierckpt_replicator.connlimits import Admission, ConnectionLimits, close_now

__all__ = ["TESTED_UVICORN", "ApiLimits", "GuardedServer"]

log = logging.getLogger(__name__)

TESTED_UVICORN = ((0, 54), (0, 55))
"""The uvicorn versions (from, up to but excluding) the seams above were tested with."""
_STARTUP_FAILURE = 3  # uvicorn's exit status when it cannot listen
_ACCEPT_RETRY = 0.05


@dataclasses.dataclass(frozen=True)
class ApiLimits:
    """The bounds of one HTTP server."""

    name: str
    header_timeout: float
    body_timeout: float
    total: int
    per_source: int
    keepalive: float = 5.0
    """An idle kept-alive connection is closed after this long (uvicorn's ``timeout_keep_alive``)."""


Client = tuple[str, int]


class _PeerScope:
    """ASGI middleware: the identity of the connection's client certificate into the request's scope."""

    def __init__(self, app: Any, peers: dict[Client, Peer | None]) -> None:
        self.app, self.peers = app, peers

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            client = scope.get("client")
            scope[PEER_SCOPE_KEY] = self.peers.get((client[0], client[1])) if client else None
        await self.app(scope, receive, send)


class GuardedServer(uvicorn.Server):
    """uvicorn serving ``app`` on ``host:port`` behind ``limits`` (and TLS with the context ``tls()``
    gives, if any: called per connection, so a context reloaded in place serves the next one). No signal
    handling: the caller owns the signals. ``connections``: the admission counter."""

    def __init__(
        self,
        app: Any,
        limits: ApiLimits,
        *,
        host: str,
        port: int,
        tls: Callable[[], ssl.SSLContext] | None = None,
        log_level: str = "info",
        timeout_graceful_shutdown: int = 5,
    ) -> None:
        self.peers: dict[Client, Peer | None] = {}
        super().__init__(
            uvicorn.Config(
                _PeerScope(app, self.peers),
                host=host,
                port=port,
                http="httptools",
                ws="none",
                lifespan="off",
                access_log=False,
                proxy_headers=False,  # scope["client"] is the socket's peer: _PeerScope relies on it
                log_level=log_level.lower(),
                timeout_graceful_shutdown=timeout_graceful_shutdown,
                limit_concurrency=2 * limits.total,  # the admission bounds connections: out of its way
                timeout_keep_alive=math.ceil(limits.keepalive),
            )
        )
        self.limits, self.tls = limits, tls
        self.connections = ConnectionLimits(
            limits.name, total=limits.total, per_source=limits.per_source, deadline=limits.header_timeout
        )
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._opening: set[asyncio.Task[None]] = set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    @property
    def port(self) -> int:
        assert self._listener is not None
        return int(self._listener.getsockname()[1])

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        config = self.config
        try:
            listener = socket.create_server(
                (config.host, config.port),
                family=socket.AF_INET6 if ":" in config.host else socket.AF_INET,
                backlog=config.backlog,
            )
        except OSError as exc:
            log.error("%s: cannot listen on %s:%d: %s", self.limits.name, config.host, config.port, exc)
            raise SystemExit(_STARTUP_FAILURE) from exc
        listener.setblocking(False)
        self._listener = listener
        await super().startup(sockets=[])  # the lifespan; every connection comes from _accept
        self._accepting = asyncio.get_running_loop().create_task(self._accept(listener))

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        if self._listener is not None:
            self._listener.close()
        for opening in list(self._opening):
            opening.cancel()
        await super().shutdown(sockets)

    def http_protocol(self) -> asyncio.Protocol:
        """uvicorn's HTTP protocol for one connection, made as ``Server.startup`` makes it."""
        make = self.config.http_protocol_class
        return make(config=self.config, server_state=self.server_state, app_state=self.lifespan.state)  # type: ignore[call-arg]

    async def _accept(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(listener)
            except OSError as exc:  # out of descriptors, say: the backlog waits
                log.warning("%s: accept failed: %s", self.limits.name, exc)
                await asyncio.sleep(_ACCEPT_RETRY)
                continue
            connection = _Connection(self, sock, str(addr[0]))
            admission = self.connections.admit(connection.source, connection.shed)
            if admission is None:
                close_now(sock)
                continue
            connection.admission = admission
            opening = loop.create_task(connection.open())
            connection.opening = opening
            self._opening.add(opening)
            opening.add_done_callback(connection.opened)


class _Connection(asyncio.Protocol):
    """One admitted connection: its TLS handshake, then uvicorn's protocol behind the deadlines (every
    transport event is passed on to it)."""

    admission: Admission
    opening: asyncio.Task[None] | None = None
    transport: asyncio.Transport | None = None
    client: Client | None = None
    _handed = False
    """Whether the socket went to ``connect_accepted_socket`` (which closes it on failure)."""

    def __init__(self, server: GuardedServer, sock: socket.socket, source: str) -> None:
        self.server, self.source = server, source
        self.loop = asyncio.get_running_loop()
        self._sock: socket.socket | None = sock
        self._inner: asyncio.Protocol | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._at = 0.0
        self._parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)

    # ------------------------------------------------------------------ opening

    async def open(self) -> None:
        sock, tls = self._sock, self.server.tls
        assert sock is not None
        # Pending (under pressure, on a short deadline) until the TLS handshake is done, or without
        # TLS until the first request is: the request line and headers are due by then. Once the
        # handshake is, the headers are due by the usual deadline, from the same start.
        self._at = self.loop.time() + (self.server.limits.header_timeout if tls else self.admission.deadline)
        self._handed = True
        if tls is None:
            await self.loop.connect_accepted_socket(lambda: self, sock)
        else:
            await self.loop.connect_accepted_socket(
                lambda: self, sock, ssl=tls(), ssl_handshake_timeout=self.admission.deadline
            )

    def opened(self, opening: asyncio.Task[None]) -> None:
        self.server._opening.discard(opening)
        self.opening = None
        failed = None if opening.cancelled() else opening.exception()
        if opening.cancelled() or failed is not None:
            if failed is not None:
                log.debug("%s: handshake with %s failed: %s", self.server.limits.name, self.source, failed)
            if not self._handed and self._sock is not None:  # cancelled before it started: ours to close
                self._sock.close()
            if self.transport is None:
                self.admission.release()
        self._sock = None

    def shed(self) -> None:
        """Close it now: a newcomer takes its place (it was pending: no request of it is served)."""
        if self.transport is not None:
            self.transport.abort()
        elif self.opening is not None:
            self.opening.cancel()

    # ------------------------------------------------------------------ transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast("asyncio.Transport", transport)  # uvloop's TLS transport is not an asyncio class
        self.transport = transport
        peername = transport.get_extra_info("peername")
        self.client = (str(peername[0]), int(peername[1])) if peername else None
        if self.server.tls is not None:
            peercert = transport.get_extra_info("peercert")
            if self.client is not None:
                self.server.peers[self.client] = peer_of(peercert) if peercert else None
            self.admission.authenticated()
        left = self._at - self.loop.time()
        if left <= 0:
            transport.abort()
            return
        self._arm(left, "request headers")
        self._inner = self.server.http_protocol()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._parser is not None:
            try:
                self._parser.feed_data(data)
            except (httptools.HttpParserError, httptools.HttpParserUpgrade):
                self._parser = None  # uvicorn's parser fails too and answers; the armed deadline stays
        if self._inner is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.admission.release()
        if self.client is not None:
            self.server.peers.pop(self.client, None)
        if self._inner is not None:
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    # ------------------------------------------------------------------ the shadow parser's events

    def on_message_begin(self) -> None:
        if self._timer is None:  # a kept-alive connection's next request: its own deadline
            self._arm(self.server.limits.header_timeout, "request headers")

    def on_headers_complete(self) -> None:
        self._disarm()
        self._arm(self.server.limits.body_timeout, "request body")

    def on_message_complete(self) -> None:
        self._disarm()
        self.admission.authenticated()  # without TLS: a whole request (with TLS: already)

    # ------------------------------------------------------------------ deadlines

    def _arm(self, seconds: float, what: str) -> None:
        self._timer = self.loop.call_later(seconds, self._expire, seconds, what)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, seconds: float, what: str) -> None:
        self._timer = None
        if self.transport is not None and not self.transport.is_closing():
            name = self.server.limits.name
            log.debug("%s: closing %s: %s not received within %.1fs", name, self.client, what, seconds)
            self.transport.abort()
