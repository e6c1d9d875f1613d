"""A replicator uses only its own identity (hardening issue, item 9): a certificate of the configured
CA, naming the node it runs as, usable as a server and a client.

Given another node's certificate, a node certificate of a foreign CA, or the operator's client-only
one, the real ``tierckpt-replicator`` process exits at start with a message that says so. Files replaced
by one of them while it runs are refused at reload (by the daemon and by its replication worker): the
node keeps its own identity, so its peers still reach it on the data port and the operator on the
control API, and the refusal is in its log.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.cluster import TEST_REPLICATOR_ARGS, committed, new_job, replica_path, wait
from tierckpt.protocol.certs import Authority, new_key, write_identity
from tierckpt_demo.cluster import LocalCluster, _replicator_command
from tierckpt_demo.ports import free_ports
from tierckpt_demo.step_writer import write_step

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DAY = datetime.timedelta(days=1)
NODE = "node-0"

KINDS = ("another node's", "a foreign CA's", "the operator's client-only")


def other_node(node: str) -> str:
    return f"node-{int(node.rsplit('-', 1)[1]) + 1}"


def not_ours(kind: str, ca: Authority, path: Path, node: str = NODE) -> Path:
    """A certificate (with its key, in one file) that is not ``node``'s own identity under ``ca``."""
    key = new_key()
    if kind == "another node's":
        cert = ca.node_certificate(key.public_key(), other_node(node), DAY)
    elif kind == "a foreign CA's":
        cert = Authority.create("tierckpt-ca").node_certificate(key.public_key(), node, DAY)
    else:
        cert = ca.operator_certificate(key.public_key(), DAY)
    write_identity(path, key, cert)
    return path


def why(kind: str, node: str = NODE) -> str:
    """What the replicator says is wrong with ``not_ours(kind, ...)``."""
    if kind == "another node's":
        return f"it is node/{other_node(node)}'s certificate, not this node's (node/{node})"
    if kind == "a foreign CA's":
        return "it is not signed by a CA of the CA bundle"
    return f"it is the operator's certificate, not this node's (node/{node})"


def replace(path: Path, source: Path) -> None:
    """Replace ``path`` atomically with ``source``'s bytes (as a Secret update or a renewal does)."""
    tmp = path.with_name(f".{path.name}.new")
    tmp.write_bytes(source.read_bytes())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


@pytest.mark.parametrize("kind", KINDS)
def test_a_replicator_started_with_a_certificate_not_its_own_exits_saying_why(
    kind: str, tmp_path: Path
) -> None:
    ca = Authority.create("tierckpt-ca")
    (tmp_path / "ca.crt").write_bytes(ca.pem)
    cert = not_ours(kind, ca, tmp_path / "cert.pem")
    api, data, probe = free_ports(3)
    (tmp_path / "root").mkdir()
    args = [
        *("--node-name", NODE, "--root", str(tmp_path / "root"), "--listen-host", "127.0.0.1"),
        *("--api-port", str(api), "--data-port", str(data), "--probe-port", str(probe)),
        *("--auth", "tls", "--tls-ca", str(tmp_path / "ca.crt"), "--tls-cert", str(cert)),
    ]
    proc = subprocess.run(
        [*_replicator_command(), *args], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"tierckpt-replicator: --tls-cert: {cert} does not hold this node's identity" in proc.stderr
    assert why(kind) in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def pair() -> Iterator[LocalCluster]:
    """node-0 and node-1, each the other's peer; static certificate files looked at every half second."""
    with LocalCluster(
        nodes=2,
        job=new_job("own-identity"),
        k=1,
        ramdisk_size="64m",
        replicator_args=(*TEST_REPLICATOR_ARGS, "--tls-reload-interval", "0.5"),
    ) as cluster:
        yield cluster


@pytest.mark.parametrize("kind", KINDS)
def test_certificate_files_replaced_by_one_not_its_own_are_refused_and_the_node_keeps_serving(
    pair: LocalCluster, kind: str, tmp_path: Path
) -> None:
    a, b = pair.nodes
    assert pair.ca is not None
    job = new_job("reload")
    pair.assign(job)
    own = b.tls_files.cert
    bad = not_ours(kind, pair.ca, tmp_path / "bad.pem", node=b.name)
    logged = len(b.log_text())
    replace(own, bad)
    try:
        # the daemon looks at the files within half a second; the worker on its next connection: a push
        # from node-0 makes one
        write_step(a.root, job, 0, 1, sizes=(256 << 10,))
        refused = "refusing the replaced certificate files, keeping this node's"
        wait(
            pair,
            lambda: b.log_text()[logged:].count(refused) >= 2 and why(kind, b.name) in b.log_text()[logged:],
            30,
            "the daemon's and the worker's refusal",
        )
        wait(pair, lambda: committed(replica_path(b, job, 0, 1)), 30, "node-0's step replicated to node-1")
        assert b.running
        status = pair.api.status(b.endpoint, node=b.name)  # the operator's client checks node-1's name
        assert status.node == b.name and status.healthy
        write_step(a.root, job, 0, 2, sizes=(256 << 10,))  # and again: the refusal stays, nothing changed
        wait(pair, lambda: committed(replica_path(b, job, 0, 2)), 30, "the next step replicated too")
    finally:
        pair.issue(b.name)  # a renewed certificate of its own: taken at the next look
    reloaded = "reloaded this node's certificate"
    wait(pair, lambda: reloaded in b.log_text()[logged:], 30, "node-1's own renewed certificate reloaded")
