"""The asyncio client's transport for calls to named nodes over mutual TLS: HTTP/1.1 on asyncio's own
TLS streams, each node's idle connections kept for its next call.

Why not httpx's own transport (httpcore on anyio): the operator calls every replicator of a job, and at
4,096 nodes that transport spent about 0.9 ms of CPU a call on a 2-vCPU VM, against about 0.05 ms for the
same request written and read on an asyncio stream (docs/benchmarks.md, "The operator at thousands of
nodes"). The replicator's control API needs little of HTTP: one request at a time on a connection, a
body of known length, an answer with ``Content-Length`` or chunked. This module does that much and
nothing else; it is an ``httpx.AsyncBaseTransport`` (httpx's public API), so the client's requests,
retries, size bounds and typed answers stay as they are.

A connection proves one node's identity in its handshake (the TLS server name is the node's,
``node_server_name``), so it carries only that node's calls, wherever the node's address points now.
Bounded: the status line and headers of an answer within ``MAX_HEAD_BYTES``, at most ``max_idle`` idle
connections a node, idle ones closed after ``keepalive`` seconds, the least recently called node's past
``max_nodes``. The body is read as the caller reads it (the client stops past its own limit). Failures
are httpx's transport errors (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``, ``WriteTimeout``,
``RemoteProtocolError``), which the client retries like any other.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import httpx

__all__ = ["MAX_HEAD_BYTES", "NodeTransport"]

T = TypeVar("T")

MAX_HEAD_BYTES = 64 << 10
"""The largest status line and headers of an answer read."""
_CHUNK = 64 << 10


class _Connection:
    """One kept-alive HTTP/1.1 connection to a node."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.idle_since = 0.0

    def usable(self, now: float, keepalive: float) -> bool:
        """Still open on both ends (a server that closed it while idle has sent its EOF) and not idle too
        long."""
        return now - self.idle_since < keepalive and not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class NodeTransport(httpx.AsyncBaseTransport):
    """HTTP/1.1 over mutual TLS to named nodes (the request's ``sni_hostname`` extension names the node
    the server's certificate must name), kept-alive per node. ``verify`` checks the server's name."""

    def __init__(
        self,
        verify: ssl.SSLContext,
        *,
        keepalive: float = 30.0,
        max_idle: int = 2,
        max_nodes: int = 8192,
    ) -> None:
        self._verify, self._keepalive, self._max_idle, self._max_nodes = (
            verify,
            keepalive,
            max_idle,
            max_nodes,
        )
        self._idle: collections.OrderedDict[tuple[str, str, int], list[_Connection]] = (
            collections.OrderedDict()
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        name = request.extensions.get("sni_hostname")
        if not isinstance(name, str) or not name:
            raise httpx.ConnectError("a call over the per-node pool must name its node", request=request)
        if request.url.scheme != "https" or not request.url.host or request.url.port is None:
            raise httpx.UnsupportedProtocol(f"{request.url!r} is not https://host:port", request=request)
        timeouts: dict[str, float | None] = request.extensions.get("timeout") or {}
        key = (name, request.url.host, request.url.port)
        content = await request.aread()
        conn = self._checkout(key) or await self._connect(key, request, timeouts.get("connect"))
        try:
            head = _request_head(request, content)
            await _within(_write(conn, head + content), timeouts.get("write"), httpx.WriteTimeout, request)
            status, headers = await _within(
                _read_head(conn), timeouts.get("read"), httpx.ReadTimeout, request
            )
        except BaseException:
            conn.close()
            raise
        body = _Body(self, key, conn, headers, request, timeouts.get("read"))
        return httpx.Response(status, headers=headers, stream=body, request=request)

    def _checkout(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.usable(now, self._keepalive):
                return conn
            conn.close()
        return None

    def _checkin(self, key: tuple[str, str, int], conn: _Connection) -> None:
        idle = self._idle.setdefault(key, [])
        self._idle.move_to_end(key)
        if len(idle) >= self._max_idle:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)
        while len(self._idle) > self._max_nodes:
            _, old = self._idle.popitem(last=False)
            for c in old:
                c.close()

    async def _connect(
        self, key: tuple[str, str, int], request: httpx.Request, timeout: float | None
    ) -> _Connection:
        name, host, port = key
        opening = asyncio.open_connection(
            host, port, ssl=self._verify, server_hostname=name, limit=MAX_HEAD_BYTES
        )
        reader, writer = await _within(opening, timeout, httpx.ConnectTimeout, request)
        return _Connection(reader, writer)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, collections.OrderedDict()
        for conns in idle.values():
            for conn in conns:
                conn.close()


class _Body(httpx.AsyncByteStream):
    """An answer's body, read as the caller reads it; the connection goes back to the pool once the
    whole body was read on a connection the server keeps open."""

    def __init__(
        self,
        transport: NodeTransport,
        key: tuple[str, str, int],
        conn: _Connection,
        headers: list[tuple[bytes, bytes]],
        request: httpx.Request,
        timeout: float | None,
    ) -> None:
        self.transport, self.key, self.conn, self.request, self.timeout = (
            transport,
            key,
            conn,
            request,
            timeout,
        )
        fields = {k.lower(): v for k, v in headers}
        self.keep = fields.get(b"connection", b"").lower() != b"close"
        self.chunked = fields.get(b"transfer-encoding", b"").lower() == b"chunked"
        length = fields.get(b"content-length")
        if length is not None and not length.isdigit():
            raise httpx.RemoteProtocolError(f"bad Content-Length {length!r}", request=request)
        self.left = int(length) if length is not None else None
        if self.left is None and not self.chunked:
            self.keep = False  # the body ends when the server closes the connection
        self.done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read = self._chunked() if self.chunked else self._sized()
        async for piece in read:
            yield piece
        self.done = True

    async def _sized(self) -> AsyncIterator[bytes]:
        reader = self.conn.reader
        while self.left is None or self.left > 0:
            want = _CHUNK if self.left is None else min(_CHUNK, self.left)
            piece = await self._read(reader.read(want))
            if not piece:
                if self.left is None:
                    return
                raise httpx.RemoteProtocolError(
                    "the server closed the connection mid-answer", request=self.request
                )
            if self.left is not None:
                self.left -= len(piece)
            yield piece

    async def _chunked(self) -> AsyncIterator[bytes]:
        reader = self.conn.reader
        while True:
            line = await self._read(reader.readuntil(b"\r\n"))
            size_text = line.split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise httpx.RemoteProtocolError(
                    f"bad chunk size {size_text[:20]!r}", request=self.request
                ) from None
            if size == 0:
                await self._read(_trailers(reader))
                return
            left = size
            while left > 0:
                piece = await self._read(reader.read(min(_CHUNK, left)))
                if not piece:
                    raise httpx.RemoteProtocolError(
                        "the server closed the connection mid-chunk", request=self.request
                    )
                left -= len(piece)
                yield piece
            if await self._read(reader.readexactly(2)) != b"\r\n":
                raise httpx.RemoteProtocolError("a chunk does not end with CRLF", request=self.request)

    async def _read(self, op: Awaitable[T]) -> T:
        try:
            return await _within(op, self.timeout, httpx.ReadTimeout, self.request)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise httpx.RemoteProtocolError(f"malformed answer: {exc}", request=self.request) from exc

    async def aclose(self) -> None:
        if self.done and self.keep:
            self.transport._checkin(self.key, self.conn)
        else:
            self.conn.close()


async def _trailers(reader: asyncio.StreamReader) -> None:
    """Skip a chunked body's trailer fields, up to the empty line."""
    while await reader.readuntil(b"\r\n") != b"\r\n":
        pass


def _request_head(request: httpx.Request, content: bytes) -> bytes:
    target = request.url.raw_path or b"/"
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    lines += [
        k + b": " + v
        for k, v in request.headers.raw
        if k.lower() not in (b"content-length", b"transfer-encoding")
    ]
    if content or request.method in ("PUT", "POST"):
        lines.append(b"Content-Length: " + str(len(content)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _write(conn: _Connection, data: bytes) -> None:
    conn.writer.write(data)
    await conn.writer.drain()


async def _read_head(conn: _Connection) -> tuple[int, list[tuple[bytes, bytes]]]:
    """The status and the header fields of an answer (1xx interim answers skipped)."""
    while True:
        try:
            head = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise httpx.RemoteProtocolError("the server closed the connection without an answer") from exc
        except asyncio.LimitOverrunError as exc:
            raise httpx.RemoteProtocolError(f"answer headers over {MAX_HEAD_BYTES} bytes") from exc
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if (
            len(parts) < 2
            or not parts[0].startswith(b"HTTP/1.")
            or not parts[1].isdigit()
            or len(parts[1]) != 3
        ):
            raise httpx.RemoteProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise httpx.RemoteProtocolError(f"malformed header line {line[:80]!r}")
            headers.append((name, value.strip()))
        status = int(parts[1])
        if status >= 200 or status < 100:
            return status, headers


_timeout: Any = getattr(asyncio, "timeout", None)
"""``asyncio.timeout`` (3.11): a timer, where ``wait_for`` before 3.12 makes a task of every read."""


async def _within(
    op: Awaitable[T], timeout: float | None, error: type[httpx.TransportError], request: httpx.Request
) -> T:
    """``op`` within ``timeout`` seconds (None: no limit); connection failures as httpx's errors."""
    try:
        if _timeout is None:
            return await asyncio.wait_for(op, timeout)
        async with _timeout(timeout):
            return await op
    except asyncio.TimeoutError as exc:
        raise error(f"timed out after {timeout} s", request=request) from exc
    except httpx.TransportError:
        raise
    except (OSError, ssl.SSLError, EOFError) as exc:
        kind: type[httpx.TransportError] = httpx.ReadError
        if error is httpx.ConnectTimeout:
            kind = httpx.ConnectError
        elif error is httpx.WriteTimeout:
            kind = httpx.WriteError
        raise kind(f"{type(exc).__name__}: {exc}", request=request) from exc
