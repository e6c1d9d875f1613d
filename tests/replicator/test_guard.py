"""The HTTP servers' guard (``tierckpt_replicator.api.guard``) in process, over real loopback sockets:
the uvicorn seams it relies on, the deadlines its shadow parser keeps, and admission (a pending
connection makes room, one that completed a request does not). TLS and identities are exercised on
real replicators (``test_identity_e2e.py``, ``test_crowded_ports.py``)."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from tierckpt_replicator.api.auth import PEER_SCOPE_KEY
from tierckpt_replicator.api.guard import TESTED_UVICORN, ApiLimits, GuardedServer
from tierckpt_replicator.settings import Settings

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
HEADERS = 1.0
BODY = 1.0
SLACK = 1.5
"""How late a deadline's close may come on this shared 2-core machine."""


def test_uvicorn_is_a_tested_version():
    """The guard builds uvicorn's HTTP protocol itself (an undocumented seam): another uvicorn may have
    changed it. Upgrade only with this module and test_crowded_ports.py passing, then move the range
    here and in pyproject.toml."""
    version = tuple(int(part) for part in uvicorn.__version__.split(".")[:2])
    low, high = TESTED_UVICORN
    assert low <= version < high, f"uvicorn {uvicorn.__version__} is not a version the guard was tested with"
    pin = re.search(r'"uvicorn\[standard\]([^"]*)"', PYPROJECT.read_text())
    assert pin is not None and pin.group(1) == ">={}.{},<{}.{}".format(*low, *high), "pyproject.toml's pin"


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Reads the whole body, answers with its length and what the guard put in the scope."""
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = f"{size} {scope.get(PEER_SCOPE_KEY, 'absent')}".encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]}
    )
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def serve() -> Iterator:
    servers: list[tuple[GuardedServer, threading.Thread]] = []

    def start(
        total: int = 8,
        per_source: int = 8,
        header: float = HEADERS,
        body: float = BODY,
        keepalive: float = 5.0,
    ) -> GuardedServer:
        limits = ApiLimits("test server", header, body, total, per_source, keepalive)
        server = GuardedServer(app, limits, host="127.0.0.1", port=0)
        thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        servers.append((server, thread))
        return server

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(10)


def connect(server: GuardedServer, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))


def request(sock: socket.socket, body: bytes = b"") -> bytes:
    """One request on ``sock`` (kept alive), its whole answer (b"" if the server closed it)."""
    sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    answer = b""
    while True:
        head, _, rest = answer.partition(b"\r\n\r\n")
        length = re.search(rb"content-length: (\d+)", head, re.I)
        if length and len(rest) >= int(length.group(1)):
            return answer
        chunk = sock.recv(1 << 16)
        if not chunk:
            return answer
        answer += chunk


def closed_after(sock: socket.socket, trickle: bytes, every: float = 0.1, limit: float = 10.0) -> float:
    """Seconds until the server closes ``sock`` while ``trickle`` goes out a byte every ``every`` s."""
    started = time.monotonic()
    sock.settimeout(every)
    for i in range(int(limit / every)):
        try:
            sock.send(trickle[i % len(trickle) : i % len(trickle) + 1])
            if sock.recv(1 << 16) == b"":
                break
        except TimeoutError:
            continue
        except OSError:
            break
    return time.monotonic() - started


def test_requests_are_served_and_carry_no_identity_without_tls(serve):
    server = serve()
    with connect(server) as sock:
        assert request(sock, b"x" * 1000).endswith(b"1000 None")
        assert request(sock).endswith(b"0 None")  # kept alive: a second request


def test_each_request_of_a_kept_alive_connection_has_its_header_deadline(serve):
    server = serve()
    with connect(server) as sock:
        time.sleep(HEADERS / 2)
        assert request(sock).startswith(b"HTTP/1.1 200")  # within the connection's deadline
        lived = closed_after(sock, b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 1000)
    assert HEADERS - 0.2 <= lived <= HEADERS + SLACK


def test_an_idle_kept_alive_connection_lives_its_keepalive_past_the_header_deadline(serve):
    """The operator calls each replicator every 30 to 60 s over one kept-alive TLS connection: the
    connection waits idle longer than a request's header deadline, and closes once idle ``keepalive``."""
    server = serve(keepalive=3.0)
    with connect(server) as sock:
        assert request(sock).startswith(b"HTTP/1.1 200")
        time.sleep(HEADERS + 1.0)  # idle past the header deadline, within the keep-alive
        assert request(sock).startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed by the server, idle
    assert 3.0 - 0.2 <= time.monotonic() - started <= 3.0 + SLACK


def test_the_replicators_control_api_keeps_connections_its_api_keepalive(tmp_path):
    from tierckpt_replicator.daemon import api_server

    daemon = types.SimpleNamespace(
        app=app,
        settings=Settings(node_name="n", root=tmp_path, auth="token", api_keepalive=120.0),
        tls=None,
    )
    assert api_server(daemon).config.timeout_keep_alive == 120  # type: ignore[arg-type]


def test_a_body_must_arrive_within_its_deadline(serve):
    server = serve()
    with connect(server) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n")
        lived = closed_after(sock, b"x" * 1000)
    assert BODY - 0.2 <= lived <= BODY + SLACK


def test_a_pending_connection_makes_room_but_one_that_completed_a_request_does_not(serve):
    server = serve(total=4, per_source=2, header=5.0)
    served = connect(server, "127.0.0.2")
    assert request(served).startswith(b"HTTP/1.1 200")  # authenticated (no TLS: a whole request)
    crowd = [connect(server, "127.0.0.3"), connect(server, "127.0.0.3"), connect(server, "127.0.0.4")]
    deadline = time.monotonic() + 5
    while server.connections.open < 4:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with connect(server, "127.0.0.5") as newcomer:
        assert request(newcomer).startswith(b"HTTP/1.1 200")
        crowd[0].settimeout(5)
        assert crowd[0].recv(1) == b""  # the oldest of the source with the most pending connections
        assert request(served).startswith(b"HTTP/1.1 200")  # still open
    assert server.connections.shed == 1
    for sock in (served, *crowd):
        sock.close()
