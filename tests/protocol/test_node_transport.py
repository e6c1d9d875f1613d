"""The asyncio client's transport to named nodes (``tierckpt.protocol.node_transport``), through the client
as the operator calls it, against a scripted mutual-TLS server: every framing of an answer, kept-alive
connections and when not to reuse one, bounded and malformed answers, timeouts, the node's identity."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.protocol.test_identity import ca, issue  # noqa: F401  # the CA fixture and node identities
from tierckpt.protocol.certs import Authority
from tierckpt.protocol.client import ReplicatorClient, ReplicatorError, RetryPolicy
from tierckpt.protocol.control import NodeInventory
from tierckpt.protocol.errors import ContractError
from tierckpt.protocol.identity import TlsCredentials
from tierckpt.protocol.node_transport import MAX_HEAD_BYTES

JOB = "team_train_1234abcd"
INVENTORY = NodeInventory(job=JOB, node="n1", endpoint="", updated_at=1.0, ranks={}).to_bytes()


def sized(body: bytes = INVENTORY, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n" % (len(body), extra) + body


def chunked(body: bytes = INVENTORY) -> bytes:
    half = len(body) // 2
    parts = (body[:half], body[half:])
    framed = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\nX-Trailer: t\r\n\r\n"


CLOSE = object()
"""Script entry: close the connection instead of answering."""
SILENT = object()
"""Script entry: never answer."""
DROP = object()
"""Script entry: close the connection after the previous answer, unannounced (an idle connection the
server closed)."""


class Scripted:
    """A mutual-TLS server as node ``n1`` answering each request with the next scripted bytes."""

    def __init__(self, ctx: ssl.SSLContext, script: list[object]) -> None:
        self.ctx, self.script = ctx, script
        self.connections = self.requests = 0
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.script:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                await reader.readexactly(int(length[0].split(b":")[1]) if length else 0)
                self.requests += 1
                answer = self.script.pop(0)
                if answer is SILENT:
                    await asyncio.sleep(30)
                if answer is CLOSE or answer is SILENT:
                    break
                assert isinstance(answer, bytes)
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer.split(b"\r\n\r\n")[0]:
                    break
                if self.script and self.script[0] is DROP:
                    self.script.pop(0)
                    break
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self.serve, "127.0.0.1", 0, ssl=self.ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"https://127.0.0.1:{port}"
        finally:
            server.close()


@pytest.fixture
def creds(ca: Authority, tmp_path: Path) -> tuple[TlsCredentials, TlsCredentials]:  # noqa: F811
    """n1's server identity and the operator's."""
    n1 = TlsCredentials(issue(ca, tmp_path, "n1"))
    return n1, TlsCredentials(issue(ca, tmp_path, "operator", role="operator"))


async def test_every_framing_of_an_answer_and_when_a_connection_is_kept(creds):
    node, operator = creds
    interim = b"HTTP/1.1 100 Continue\r\n\r\n" + sized()
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + INVENTORY  # the body ends with the connection
    server = Scripted(
        node.server(), [sized(), chunked(), interim, sized(extra=b"Connection: close\r\n"), closing]
    )
    client = ReplicatorClient(tls=operator, retry=RetryPolicy(attempts=1), keepalive=30)
    try:
        async with server.running() as endpoint:
            for _ in range(5):
                inventory = await client.inventory(endpoint, JOB, node="n1")
                assert inventory == NodeInventory.from_bytes(INVENTORY)
        # sized, chunked and interim answers kept the first connection; each "close" needed a new one
        assert (server.requests, server.connections) == (5, 2)
    finally:
        await client.aclose()


async def test_a_connection_the_server_closed_while_idle_is_not_reused(creds):
    node, operator = creds
    server = Scripted(node.server(), [sized(), DROP, sized(), CLOSE, sized()])
    client = ReplicatorClient(tls=operator, retry=RetryPolicy(attempts=1), keepalive=30)
    try:
        async with server.running() as endpoint:
            assert await client.inventory(endpoint, JOB, node="n1") is not None
            await asyncio.sleep(0.1)  # the server's EOF arrived: that idle connection is not taken
            assert await client.inventory(endpoint, JOB, node="n1") is not None
            assert server.connections == 2
            with pytest.raises(ReplicatorError) as dropped:  # closed at the request: retryable, no status
                await client.inventory(endpoint, JOB, node="n1")
            assert dropped.value.status is None
            assert await client.inventory(endpoint, JOB, node="n1") is not None
            assert server.connections == 3
    finally:
        await client.aclose()


@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"x" * MAX_HEAD_BYTES + b"\r\n\r\n", ReplicatorError),
        (b"SSH-2.0-OpenSSH\r\n\r\n", ReplicatorError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 12x\r\n\r\n", ReplicatorError),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", ReplicatorError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 999\r\n\r\n{}", ReplicatorError),  # cut short
        (sized(b"x" * 5000), ContractError),  # over the client's answer limit, declared
        (chunked(b"x" * 5000), ContractError),  # over it, undeclared
    ],
)
async def test_a_malformed_or_oversized_answer_is_refused(creds, answer, error):
    node, operator = creds
    server = Scripted(node.server(), [answer])
    client = ReplicatorClient(tls=operator, retry=RetryPolicy(attempts=1), max_answer_bytes=4096)
    try:
        async with server.running() as endpoint:
            with pytest.raises(error):
                await client.inventory(endpoint, JOB, node="n1")
    finally:
        await client.aclose()


async def test_a_silent_server_times_out(creds):
    node, operator = creds
    server = Scripted(node.server(), [SILENT])
    client = ReplicatorClient(tls=operator, retry=RetryPolicy(attempts=1), timeout=0.3)
    try:
        async with server.running() as endpoint:
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(ReplicatorError, match="timed out"):
                await client.inventory(endpoint, JOB, node="n1")
            assert loop.time() - started < 5
    finally:
        await client.aclose()


async def test_a_server_that_is_another_node_is_refused_before_the_request(ca, tmp_path, creds):  # noqa: F811
    _, operator = creds
    other = TlsCredentials(issue(ca, tmp_path, "n2"))
    server = Scripted(other.server(), [sized()])
    client = ReplicatorClient(tls=operator, retry=RetryPolicy(attempts=1))
    try:
        async with server.running() as endpoint:
            with pytest.raises(ReplicatorError, match=r"(?i)certificate|hostname"):
                await client.inventory(endpoint, JOB, node="n1")
        assert server.requests == 0
    finally:
        await client.aclose()
