"""Nothing sent before authentication can stall a node: real replicator processes on three network
namespaces (tierckpt_demo.cluster), attacked from the host's address on the bridge.

* Data port: idle and trickling connections hold no transfer slot, so a real push to the assigned peer
  and a real restore fetch from it go through while they are open; each trickler is closed at the
  handshake deadline; the node stays healthy.
* Control API: 200 connections trickling their headers (slowloris) do not starve the probes, which
  have a port and server of their own; a real API call from another node still succeeds; every
  trickling connection is closed by the header deadline (or at once, past the per-source limit).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.fixtures.cluster import (
    TEST_REPLICATOR_ARGS,
    commit_everywhere,
    committed,
    new_job,
    replica_path,
    wait_restored,
)
from tests.fixtures.trickle import Trickle, client_hello
from tierckpt.protocol.control import RestoreState, Tier
from tierckpt.protocol.format import rank_dir, step_dir
from tierckpt_demo.cluster import LocalCluster, has_netns
from tierckpt_demo.step_writer import step_files
from tierckpt_replicator.replication.wire import MAGIC

pytestmark = [
    pytest.mark.root,
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(not has_netns(), reason="needs root and network namespaces (a source per node)"),
]

HANDSHAKE = 2.0
HEADERS = 4.0
"""Long enough that a real API call made during the attack finishes inside it on a loaded machine."""
API_PER_SOURCE = 32
SLACK = 2.5
"""How late a deadline's close may come on this shared 2-core machine (the accept loop, the reaper)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    args = (
        *TEST_REPLICATOR_ARGS,
        "--handshake-timeout",
        str(HANDSHAKE),
        "--api-header-timeout",
        str(HEADERS),
        "--api-body-timeout",
        str(HEADERS),
        "--api-connections-per-source",
        str(API_PER_SOURCE),
    )
    with LocalCluster(nodes=3, job=new_job("bounded"), k=1, ramdisk_size="96m", replicator_args=args) as c:
        yield c


# a request frame whose body never ends (one byte at a time), and HTTP headers that never end
FRAME = MAGIC + struct.pack("!I", 60000) + b"x" * 60000
HEADERS_FOREVER = b"GET /v1/status HTTP/1.1\r\nHost: replicator\r\nX-Slow: " + b"a" * 60000


def slow_request(cluster: LocalCluster) -> bytes:
    """What a slowloris sends the control API: a ClientHello over mutual TLS, else HTTP headers."""
    return client_hello() if cluster.auth == "tls" else HEADERS_FOREVER


def healthy(cluster: LocalCluster, node) -> bool:
    probes = httpx.get(f"{node.probe_endpoint}/readyz", timeout=2, trust_env=False)
    return node.running and probes.status_code == 200 and cluster.api.status(node.endpoint).node == node.name


def test_idle_and_trickling_data_connections_do_not_stop_a_push_or_a_restore(cluster):
    a, b, _ = cluster.nodes
    job = new_job("idle")
    cluster.assign(job)
    # the attacker is the host (its address on the bridge): a source of its own, like a pod
    with Trickle(b.ip, b.data_port, FRAME, count=6, interval=0.5, reconnect=True) as trickle:
        time.sleep(0.5)  # the crowd is connected before the push starts (more than --max-incoming)
        sources = commit_everywhere(cluster, job, 10)
        # the push goes to the ASSIGNED peer (b), not around it: b served it despite the crowd
        replica = replica_path(b, job, 0, 10)
        cluster.wait_for(lambda: committed(replica), timeout=20, what=f"rank 0's replica on {b.name}")
        assert step_files(replica) == step_files(sources[0])
        # a restore fetch from b, while the crowd goes on: a loses its ramdisk and comes back
        a.kill_replicator()
        a.wipe_ramdisk()
        a.start_replicator()
        cluster.assign(job, generation=2)
        st = wait_restored(a, job, 0, timeout=30)
        assert st.state == RestoreState.READY and st.source == Tier.PEER and st.step == 10
        assert step_files(step_dir(rank_dir(a.root, job, 0), 10)) == step_files(sources[0])
        assert trickle.open > 0  # still being attacked all along
        # every one of the crowd is dropped at the handshake deadline (and replaced: reconnect)
        cluster.wait_for(lambda: len(trickle.lifetimes) >= 6, timeout=HANDSHAKE + SLACK + 1, what="drops")
    # every trickler was closed at the handshake deadline (never earlier, never much later)
    lived = [t for t in trickle.lifetimes if t > 0]
    assert len(lived) >= 6, trickle.lifetimes
    assert all(HANDSHAKE - 0.3 <= t <= HANDSHAKE + SLACK for t in lived), trickle.lifetimes
    assert healthy(cluster, b)


def test_slowloris_on_the_api_does_not_starve_the_probes(cluster):
    _, b, c = cluster.nodes
    # the real API call comes from another node (another source), with the operator's certificate; its
    # process starts (and imports) before the attack, so during the attack only the request has to fit
    operator = cluster.identity_files("operator")
    caller = c.popen_in_node(
        [sys.executable, "-c", _STATUS_CALL, b.endpoint, b.name, str(operator.cert), str(operator.ca)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert caller.stdout is not None and caller.stdin is not None
    assert caller.stdout.readline().strip() == "ready"
    with Trickle(b.ip, b.api_port, slow_request(cluster), count=200, interval=0.5) as trickle:
        started = time.monotonic()
        time.sleep(0.5)
        assert trickle.open >= API_PER_SOURCE - 2  # the attack is on: up to its per-source share is held
        with httpx.Client(base_url=b.probe_endpoint, timeout=2, trust_env=False) as probes:
            for _ in range(5):
                t0 = time.monotonic()
                assert probes.get("/healthz").status_code == 200
                assert probes.get("/readyz").status_code == 200
                assert probes.get("/metrics").status_code == 200
                assert time.monotonic() - t0 < 1.0
                time.sleep(0.1)
        # a real API call goes through meanwhile
        out, err = caller.communicate("go\n", timeout=60)
        assert out.split() == ["200", b.name], err
        assert trickle.open > 0 and time.monotonic() - started < HEADERS  # still under attack then
        trickle.wait_all_closed(HEADERS + SLACK)
    refused = [t for t in trickle.lifetimes if t < 1.0]
    held = [t for t in trickle.lifetimes if t >= 1.0]
    assert len(refused) >= 200 - API_PER_SOURCE  # past the per-source limit: closed at once
    assert held and all(HEADERS - 0.3 <= t <= HEADERS + SLACK for t in held), trickle.lifetimes
    assert healthy(cluster, b)


_STATUS_CALL = """
import ssl, sys, httpx
endpoint, node, cert, ca = sys.argv[1:5]
tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # the operator's mutual TLS
tls.load_cert_chain(cert)
tls.load_verify_locations(ca)
print("ready", flush=True)
sys.stdin.readline()
with httpx.Client(verify=tls, timeout=10, trust_env=False) as http:
    r = http.get(endpoint + "/v1/status", extensions={"sni_hostname": node + ".node.tierckpt.io"})
print(r.status_code, r.json().get("node"))
"""
