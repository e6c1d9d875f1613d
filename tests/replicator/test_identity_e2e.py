"""Credentials per node and per job, end to end on three real nodes (mutual TLS, the rig's CA).

Job J is assigned to node-0 (A) and node-1 (B) only; node-2 (C) runs its own replicator with a valid
node certificate of the same CA, as a compromised node would. C must not read J's data or inventory
from A, act as B, or act as the operator; a pod-chosen endpoint gets no credential at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import socket
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.cluster import api_get, cluster3, committed, new_job, replica_path
from tierckpt.protocol.certs import Authority, new_key, write_identity
from tierckpt.protocol.client import ONE_ATTEMPT, ReplicatorError, SyncReplicatorClient
from tierckpt.protocol.control import PeerAssignment, PeerNode
from tierckpt.protocol.errors import ContractError
from tierckpt.protocol.format import rank_dir, state_dir, step_dir
from tierckpt.protocol.identity import TlsCredentials, TlsFiles, node_server_name
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, recv_frame, send_frame

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

__all__ = ["cluster3"]

HOUR = datetime.timedelta(hours=1)
STEPS = "tierckpt_replicator_steps"


def two_node_job(cluster: LocalCluster, job: str, generation: int = 1) -> PeerAssignment:
    """J on A and B only (each the other's peer), sent to every node as the operator would."""
    a, b, _ = cluster.nodes
    assignment = PeerAssignment(
        job=job,
        generation=generation,
        nodes={n.name: PeerNode(n.name, n.peer_endpoint, n.domain) for n in (a, b)},
        peers={a.name: (b.name,), b.name: (a.name,)},
        node_ranks={a.name: 0, b.name: 1},
        procs_per_node=1,
    )
    for node in (a, b):
        cluster.api.put_peers(node.endpoint, assignment, node=node.name)
    return assignment


def api_as(cluster: LocalCluster, identity: str) -> SyncReplicatorClient:
    """The control API client presenting ``identity``'s certificate (a node's, here)."""
    return SyncReplicatorClient(tls=TlsCredentials(cluster.identity_files(identity)), retry=ONE_ATTEMPT)


def data_request(files: TlsFiles, server: Node, req: DataRequest) -> DataReply:
    """One data-plane request to ``server`` over mutual TLS with ``files``' certificate."""
    ctx = TlsCredentials(files).client(named=True)
    with (
        socket.create_connection((server.ip, server.data_port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=node_server_name(server.name)) as sock,
    ):
        send_frame(sock, req)
        return recv_frame(sock, DataReply)


@pytest.fixture
def job_on_a_and_b(cluster3):
    """J assigned to A and B, with A's rank 0 step 10 committed and replicated to B."""
    a, b, _ = cluster3.nodes
    job = new_job("scoped")
    two_node_job(cluster3, job)
    src = write_step(a.root, job, 0, 10, world_size=2, sizes=(1 << 20,))
    rep = replica_path(b, job, 0, 10)
    cluster3.wait_for(lambda: committed(rep), what="A's step replicated to B")
    assert step_files(rep) == step_files(src)
    return job


def test_a_node_outside_the_job_reads_nothing_of_it(cluster3, job_on_a_and_b):
    a, b, c = cluster3.nodes
    job = job_on_a_and_b
    get = DataRequest(op="get", token="", job=job, rank=0, step=10)
    # C, a valid node of the cluster, is not in J: refused on the data plane and the control API
    reply = data_request(c.tls_files, a, dataclasses.replace(get, node=c.name))
    assert reply.status == Status.FORBIDDEN and "not a member" in reply.message
    with api_as(cluster3, c.name) as as_c, pytest.raises(ReplicatorError) as refused:
        as_c.inventory(a.endpoint, job, node=a.name)
    assert refused.value.status == 403
    # B, a member, may do both
    reply = data_request(b.tls_files, a, dataclasses.replace(get, node=b.name))
    assert reply.status == Status.OK and reply.total_bytes == 1 << 20
    with api_as(cluster3, b.name) as as_b:
        inv = as_b.inventory(a.endpoint, job, node=a.name)
    assert inv is not None and inv.ranks[0].local == (10,)


def test_a_node_certificate_cannot_act_as_another_node_or_the_operator(cluster3, job_on_a_and_b):
    a, b, c = cluster3.nodes
    job = job_on_a_and_b
    # C claims to be B (a member): the certificate names C
    claim = DataRequest(op="get", token="", job=job, rank=0, step=10, node=b.name)
    reply = data_request(c.tls_files, a, claim)
    assert reply.status == Status.FORBIDDEN and "claims to be" in reply.message
    # C puts a forged replica claiming to be B: refused before a byte of it is stored
    forged = DataRequest(
        op="put", token="", job=job, rank=1, step=99, node=b.name, commit_size=5, manifest_size=5
    )
    assert data_request(c.tls_files, a, forged).status == Status.FORBIDDEN
    assert not step_dir(rank_dir(a.root, job, 1), 99).exists()
    # C tries the operator's endpoints: peers, purge
    peers = state_dir(a.root, job) / "peers.json"
    before = peers.read_bytes()
    with api_as(cluster3, c.name) as as_c:
        takeover = PeerAssignment.from_bytes(before)
        takeover = PeerAssignment(
            job=job,
            generation=takeover.generation + 1,
            nodes={**takeover.nodes, c.name: PeerNode(c.name, c.peer_endpoint, c.domain)},
            peers={a.name: (c.name,)},
            node_ranks=takeover.node_ranks,
        )
        for call in (
            lambda: as_c.put_peers(a.endpoint, takeover, node=a.name),
            lambda: as_c.purge(a.endpoint, job, node=a.name),
            lambda: as_c.status(a.endpoint, node=a.name),
        ):
            with pytest.raises(ReplicatorError) as refused:
                call()
            assert refused.value.status == 403
    assert peers.read_bytes() == before
    assert committed(step_dir(rank_dir(a.root, job, 0), 10))
    # C's certificate served where B's endpoint is: A's client refuses it before sending anything
    impostor = Node(cluster3, 9, ip=c.ip, api_port=c.api_port, data_port=c.data_port, probe_port=c.probe_port)
    with pytest.raises(ReplicatorError, match=r"(?i)certificate|hostname"):
        cluster3.api.inventory(impostor.endpoint, job, node=b.name)


def test_the_metrics_name_a_job_only_to_the_operator(cluster3, job_on_a_and_b):
    """The probe port (plain HTTP, no credentials) shows the per-job series over the node's jobs, naming
    none; ``GET /v1/metrics`` on the control API has them per job, for the operator only."""
    a, b, c = cluster3.nodes
    job = job_on_a_and_b
    for node in (a, b):
        cluster3.wait_for(  # the holdings are counted (once a second)
            lambda node=node: f'job="{job}"' in api_get(cluster3, node, "/v1/metrics").text,
            what=f"{node.name}'s per-job series",
        )
        page = httpx.get(f"{node.probe_endpoint}/metrics", timeout=5, trust_env=False).text
        assert job not in page and 'job="' not in page
        kind = "local" if node is a else "replica"
        steps = [s for f in text_string_to_metric_families(page) for s in f.samples if s.name == STEPS]
        assert any(s.labels == {"kind": kind} and s.value >= 1 for s in steps), steps
    per_job = api_get(cluster3, a, "/v1/metrics").text
    assert f'{STEPS}{{job="{job}",kind="local"}} 1.0' in per_job
    for node in (b, c):  # nodes, even of the job: refused
        refused = api_get(cluster3, a, "/v1/metrics", identity=node.name)
        assert refused.status_code == 403 and job not in refused.text


def test_an_assignment_cannot_send_data_to_another_node_or_a_plain_listener(cluster3):
    """Every connection starts with a TLS handshake that checks the peer's certificate against the node
    the assignment names: a plain TCP listener (what a pod could open) gets a ClientHello and nothing
    else; another node's replicator at that address is refused as the wrong node."""
    a, b, c = cluster3.nodes
    job = new_job("redirect")
    received = bytearray()
    listener = socket.create_server((cluster3.bridge_ip, 0))
    port = listener.getsockname()[1]

    def record() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(5)
                    while chunk := conn.recv(65536):
                        received.extend(chunk)

    threading.Thread(target=record, daemon=True).start()
    fake = f"https://{cluster3.bridge_ip}:{port}/?data={port}"
    assignment = PeerAssignment(
        job=job,
        generation=1,
        nodes={
            a.name: PeerNode(a.name, a.peer_endpoint, a.domain),
            b.name: PeerNode(b.name, fake, b.domain),  # "B" is a pod's listener
            c.name: PeerNode(c.name, b.peer_endpoint, c.domain),  # "C" is really B's replicator
        },
        peers={a.name: (b.name, c.name)},
        node_ranks={a.name: 0},
        procs_per_node=1,
    )
    cluster3.api.put_peers(a.endpoint, assignment, node=a.name)
    write_step(a.root, job, 0, 20, world_size=1, sizes=(1 << 20,))
    cluster3.wait_for(  # the listener never answers the ClientHello: that push times out
        lambda: (
            f"send {job} rank 0 step 20 -> {b.name}: " in a.log_text()
            and f"send {job} rank 0 step 20 -> {c.name}: unauthorized" in a.log_text()
        ),
        what="both pushes stopped at the handshake",
    )
    listener.close()
    assert received[:1] == b"\x16"  # a TLS handshake record: the ClientHello
    assert b"TKR1" not in received and job.encode() not in received  # no frame, no request
    assert not committed(replica_path(b, job, 0, 20)) and not committed(replica_path(c, job, 0, 20))


def test_clients_refuse_plain_http_and_foreign_certificates(cluster3, tmp_path):
    a = cluster3.nodes[0]
    plain = f"http://{a.ip}:{a.api_port}"
    with pytest.raises(ContractError, match="only mutual TLS"):
        cluster3.api.status(plain, node=a.name)
    # no client certificate: the handshake fails, the app never sees a request
    with (
        httpx.Client(verify=str(a.tls_files.ca), trust_env=False) as anonymous,
        pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)),
    ):
        anonymous.get(f"{a.endpoint}/v1/status", extensions={"sni_hostname": node_server_name(a.name)})
    # a certificate of another CA naming the operator: refused at the handshake too
    other, key = Authority.create("not-tierckpt"), new_key()
    write_identity(tmp_path / "op.pem", key, other.operator_certificate(key.public_key(), HOUR))
    (tmp_path / "ca.crt").write_bytes(cluster3.ca.pem)
    files = TlsFiles(tmp_path / "op.pem", tmp_path / "ca.crt")
    foreign = SyncReplicatorClient(tls=TlsCredentials(files), retry=ONE_ATTEMPT)
    with foreign, pytest.raises(ReplicatorError) as refused:
        foreign.status(a.endpoint, node=a.name)
    assert refused.value.status is None  # no HTTP answer at all
    # plain TCP to the data port: no TLS, no request served
    with socket.create_connection((a.ip, a.data_port), timeout=5) as s:
        send_frame(s, DataRequest(op="get", token="", job="j", rank=0, step=1, node="node-1"))
        with contextlib.suppress(ConnectionResetError):
            assert not s.recv(100).startswith(b"TKR1")
