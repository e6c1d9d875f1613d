"""Many hostile sources cannot keep a legitimate caller out: a real replicator in its default
configuration (mutual TLS, default connection limits), attacked over real sockets from many loopback
addresses (127.0.0.x: one source each, as pods have one IP each), each holding its share of
connections that trickle a TLS ClientHello and come back when dropped.

* Control API: ten sources, more than the connections kept in total; the operator's
  ``GET /v1/status`` from another address succeeds on its first try, at once, every time; a
  connection whose handshake is done (authenticated) is not closed for the newcomers.
* Data port: six sources, more than its total; a member node's ``get`` from another address is
  served on its first try, at once, every time.

Before the pending connections were shed to make room, every new connection past the total was
refused, whatever its source: the operator failed 40 of 40 tries.
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.fixtures.cluster import TEST_REPLICATOR_ARGS, new_job, wait
from tests.fixtures.trickle import Trickle, client_hello
from tierckpt.protocol.identity import TlsCredentials, TlsFiles, node_server_name
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, recv_frame, send_frame
from tierckpt_replicator.settings import Settings

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

DEFAULTS = Settings()
API_TOTAL, API_PER_SOURCE = DEFAULTS.api_max_connections, DEFAULTS.api_connections_per_source
DATA_TOTAL = 4 * DEFAULTS.transfer.max_incoming + 8
DATA_PER_SOURCE = DEFAULTS.transfer.data_connections_per_source
CALLER = "127.0.0.250"
"""The legitimate caller's address (the operator's, a peer node's): a source of its own."""
AT_ONCE = 2.0
"""How long one legitimate call may take under attack (a TLS handshake and a small request: milliseconds
unloaded; seconds of slack for this shared 2-core machine)."""
CALLS = 5
STEP_BYTES = 1 << 20


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    job = new_job("crowd")
    with LocalCluster(
        nodes=2, job=job, netns=False, ramdisk_size="64m", replicator_args=TEST_REPLICATOR_ARGS
    ) as c:
        yield c


@contextlib.contextmanager
def crowd(node: Node, port: int, sources: int, each: int) -> Iterator[list[Trickle]]:
    """``sources`` addresses, ``each`` connections from each, trickling a ClientHello to ``port``,
    reconnecting half a second after each drop."""
    hello = client_hello()
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                Trickle(
                    node.ip,
                    port,
                    hello,
                    count=each,
                    interval=0.5,
                    reconnect=True,
                    reconnect_after=0.5,
                    source=f"127.0.0.{10 + i}",
                )
            )
            for i in range(sources)
        ]


def operator_tls(cluster: LocalCluster) -> ssl.SSLContext:
    return TlsCredentials(cluster.identity_files("operator")).client(named=True)


def status_once(cluster: LocalCluster, node: Node) -> tuple[int, str, float]:
    """One ``GET /v1/status`` as the operator from ``CALLER``, no retry: (status, node, seconds)."""
    transport = httpx.HTTPTransport(verify=operator_tls(cluster), local_address=CALLER, retries=0)
    started = time.monotonic()
    with httpx.Client(transport=transport, timeout=10, trust_env=False) as http:
        r = http.get(f"{node.endpoint}/v1/status", extensions={"sni_hostname": node_server_name(node.name)})
    return r.status_code, r.json().get("node"), time.monotonic() - started


def get_once(files: TlsFiles, server: Node, req: DataRequest) -> tuple[DataReply, float]:
    """One data-plane request to ``server`` from ``CALLER`` over mutual TLS, no retry: (reply, seconds)."""
    ctx = TlsCredentials(files).client(named=True)
    started = time.monotonic()
    with (
        socket.create_connection(
            (server.ip, server.data_port), timeout=10, source_address=(CALLER, 0)
        ) as raw,
        ctx.wrap_socket(raw, server_hostname=node_server_name(server.name)) as sock,
    ):
        send_frame(sock, req)
        reply = recv_frame(sock, DataReply)
    return reply, time.monotonic() - started


def under_attack(cluster: LocalCluster, crowds: list[Trickle], at_least: int) -> None:
    wait(cluster, lambda: sum(t.open for t in crowds) >= at_least, 10, f"{at_least} hostile connections open")


def made_room(node: Node, server: str) -> bool:
    """Whether ``server`` on ``node`` closed pending connections to make room (it says so in its log)."""
    return re.search(rf"{server}: closed [1-9][0-9]* pending connection", node.log_text()) is not None


def test_the_operator_gets_through_a_crowd_on_the_control_api(cluster):
    node = cluster.nodes[0]
    each = API_PER_SOURCE + 4  # past the per-source limit too
    sources = API_TOTAL // API_PER_SOURCE + 2  # together, more than the total
    with crowd(node, node.api_port, sources, each) as crowds:
        under_attack(cluster, crowds, API_TOTAL)
        # a connection whose handshake is done is never closed for the newcomers
        authenticated = operator_tls(cluster).wrap_socket(
            socket.create_connection((node.ip, node.api_port), timeout=10, source_address=(CALLER, 0)),
            server_hostname=node_server_name(node.name),
        )
        with authenticated:
            time.sleep(1.0)  # meanwhile the crowd's connections are dropped and come back
            authenticated.sendall(f"GET /v1/status HTTP/1.1\r\nHost: {node.name}\r\n\r\n".encode())
            assert authenticated.recv(64).startswith(b"HTTP/1.1 200")
        for _ in range(CALLS):
            status, name, seconds = status_once(cluster, node)
            assert (status, name) == (200, node.name)
            assert seconds < AT_ONCE, f"the operator waited {seconds:.1f}s"
            time.sleep(0.2)
        assert sum(t.open for t in crowds) >= API_TOTAL // 2  # still under attack then
    assert made_room(node, "control API")  # the crowd did fill it: pending connections made room


def test_a_member_node_gets_through_a_crowd_on_the_data_port(cluster):
    a, b = cluster.nodes
    job = cluster.job
    write_step(a.root, job, 0, 10, world_size=2, sizes=(STEP_BYTES,))
    get = DataRequest(op="get", token="", job=job, rank=0, step=10, node=b.name)
    each = DATA_PER_SOURCE + 2
    sources = DATA_TOTAL // DATA_PER_SOURCE + 3
    with crowd(a, a.data_port, sources, each) as crowds:
        under_attack(cluster, crowds, DATA_TOTAL)
        for _ in range(CALLS):
            reply, seconds = get_once(b.tls_files, a, get)
            assert reply.status == Status.OK and reply.total_bytes == STEP_BYTES, reply
            assert seconds < AT_ONCE, f"the peer waited {seconds:.1f}s"
            time.sleep(0.2)
        assert sum(t.open for t in crowds) >= DATA_TOTAL // 2
    assert made_room(a, "data endpoint")
