"""End to end on three real nodes (network namespaces on a bridge, a tmpfs each, real replicator
processes, fake-gcs-server): replication, node loss, pair loss, and every failure the spec names.

The nodes form a ring with K=1: node-i holds rank i and sends it to node-(i+1). Each test uses its own
job id on the shared cluster and leaves every node running and reachable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import socket
import threading
import time

import httpx
import pytest

from tests.fixtures.cluster import (
    cluster3,
    commit_everywhere,
    committed,
    new_job,
    replica_path,
    wait_restored,
)
from tierckpt.protocol.api import ENDPOINTS
from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt.protocol.client import ONE_ATTEMPT, ReplicatorError, SyncReplicatorClient
from tierckpt.protocol.control import BackupResult, PeerAssignment, PeerNode, RestorePlan, RestoreState, Tier
from tierckpt.protocol.format import committed_steps, rank_dir, replica_rank_dir, state_dir, step_dir
from tierckpt.protocol.identity import TlsCredentials, node_server_name
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, recv_frame, send_frame

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

__all__ = ["cluster3"]  # the module-scoped fixture, re-exported for pytest


def leftovers(root, job: str | None = None) -> list:
    """Staging directories of transfers under way or torn, on a node's ramdisk (of ``job`` only: an
    earlier test's transfer that a fault tore may still be waiting out its timeout)."""
    return list((root / job if job else root).rglob(".incoming-*"))


def wait_replica(cluster, node, job: str, rank: int, step: int, timeout: float = 30.0):
    path = replica_path(node, job, rank, step)
    try:
        cluster.wait_for(
            lambda: committed(path), timeout=timeout, what=f"replica of rank {rank} on {node.name}"
        )
    except TimeoutError:
        raise TimeoutError("\n".join(n.log_text()[-3000:] for n in cluster.nodes)) from None
    return path


def wait_replicated(cluster, job: str, rank: int, step: int, timeout: float = 30.0):
    """The node holding a committed replica: the ring peer normally, the next candidate if that peer
    failed recently (then it is in backoff for a few seconds)."""
    return cluster.wait_for(
        lambda: next((n for n in cluster.nodes if committed(replica_path(n, job, rank, step))), None),
        timeout=timeout,
        what=f"a replica of rank {rank} step {step}",
    )


def intact_or_gone(path, source) -> bool:
    """No committed copy at ``path``, or one equal to ``source`` byte for byte (never the corrupt one)."""
    try:
        return not committed(path) or step_files(path) == step_files(source)
    except FileNotFoundError:  # being dropped or committed right now
        return False


def lose(node) -> None:
    """The node is gone: its replicator and worker killed, its ramdisk empty."""
    node.kill_replicator()
    node.wipe_ramdisk()


def bucket_complete(cluster, job: str, step: int) -> bool:
    """The step's completion object is in the bucket (read directly, past every node's cache)."""
    store = GcsStore(GcsSettings(bucket=cluster.bucket, endpoint=cluster.gcs.url))
    return store.stat(BucketLayout("tierckpt").complete_key(job, step)) is not None


def backup_everywhere(cluster, job: str, step: int) -> None:
    """POST /backup on every node at once; once all answered, the step is complete in the bucket.

    The backup service spreads a step's uploads over every node holding a copy (primary or replica),
    so the replicas are awaited first, as an operator would after a save. Each node's answer comes
    once its share is uploaded and it tried to complete the step, so the last one to finish completed
    it: no waiting on a takeover timer or a cache."""
    for rank in range(cluster.size * cluster.procs_per_node):
        wait_replicated(cluster, job, rank, step)
    answers: dict[str, BackupResult] = {}

    def post(node) -> None:
        answers[node.name] = cluster.api.backup(node.endpoint, job, timeout=60)

    threads = [threading.Thread(target=post, args=(n,)) for n in cluster.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == {n.name: BackupResult(job=job, step=step) for n in cluster.nodes}, answers
    assert bucket_complete(cluster, job, step)


def test_committed_step_is_replicated_bit_exact(cluster3):
    job = new_job("repl")
    cluster3.assign(job)
    sources = commit_everywhere(cluster3, job, 10)
    for i in range(3):
        peer = cluster3.nodes[(i + 1) % 3]
        rep = wait_replica(cluster3, peer, job, i, 10)
        assert step_files(rep) == step_files(sources[i])  # data, manifest and COMMIT, byte for byte
        assert not leftovers(peer.root)
    status = cluster3.api.status(cluster3.nodes[0].endpoint)
    (job_status,) = [j for j in status.jobs if j.job == job]
    assert job_status.local == {0: (10,)} and job_status.replicas == {2: (10,)}


def test_lost_node_is_restored_from_its_peer(cluster3):
    a = cluster3.nodes[0]
    job = new_job("loss")
    cluster3.assign(job)
    sources = commit_everywhere(cluster3, job, 20)
    wait_replicated(cluster3, job, 0, 20)
    lose(a)
    a.start_replicator()
    cluster3.assign(job, generation=2)  # the operator re-sends peers.json to the replacement node
    st = wait_restored(a, job, 0)
    assert st.state == RestoreState.READY and st.step == 20 and st.source == Tier.PEER
    assert st.bytes_done == st.bytes_total > 0
    assert step_files(step_dir(rank_dir(a.root, job, 0), 20)) == step_files(sources[0])


def test_pair_lost_is_restored_from_the_bucket(cluster3):
    a = cluster3.nodes[0]
    job = new_job("pair")
    cluster3.assign(job)
    sources = commit_everywhere(cluster3, job, 30)
    b = wait_replicated(cluster3, job, 0, 30)  # the node holding rank 0's only replica
    rank_b = b.index
    wait_replicated(cluster3, job, rank_b, 30)
    backup_everywhere(cluster3, job, 30)
    lose(a)
    lose(b)  # rank 0's primary (a) and its only replica (b) are gone
    a.start_replicator(wait=False)
    b.start_replicator(wait=False)
    a.wait_ready()
    b.wait_ready()
    cluster3.assign(job, generation=2)
    st0, st_b = wait_restored(a, job, 0), wait_restored(b, job, rank_b)
    assert (st0.state, st0.step, st0.source) == (RestoreState.READY, 30, Tier.GCS)
    assert (st_b.state, st_b.step) == (RestoreState.READY, 30)  # from the third node (or the bucket)
    assert st_b.source in (Tier.PEER, Tier.GCS)
    assert step_files(step_dir(rank_dir(a.root, job, 0), 30)) == step_files(sources[0])
    assert step_files(step_dir(rank_dir(b.root, job, rank_b), 30)) == step_files(sources[rank_b])


def test_replicas_on_fallback_peers_are_backed_up_at_once(cluster3):
    """Every rank's assigned peer refuses it, so each replica goes to the other node (the ring
    reversed). The upload split still follows peers.json, but the primaries know where their replicas
    went: an on-demand backup completes the step at once, with no rank left to a takeover timer."""
    job = new_job("fallback")
    cluster3.assign(job)
    nodes = cluster3.nodes
    for i, node in enumerate(nodes):
        nodes[(i + 1) % 3].drop_port(nodes[(i + 1) % 3].data_port, source=node)
    try:
        commit_everywhere(cluster3, job, 33)
        for i in range(3):
            wait_replica(cluster3, nodes[(i + 2) % 3], job, i, 33)
    finally:
        for node in nodes:
            node.clear_drops()
    backup_everywhere(cluster3, job, 33)
    for node in nodes:
        assert f"step 33 of {job}: taking over" not in node.log_text()


def test_whole_cluster_lost_restores_from_the_bucket(cluster3):
    """No node holds anything any more: the plan, its world size and each node's ranks come from the
    bucket alone (a new cluster after a zone outage)."""
    job = new_job("zone")
    cluster3.assign(job)
    sources = commit_everywhere(cluster3, job, 35)
    backup_everywhere(cluster3, job, 35)
    for node in cluster3.nodes:
        lose(node)
    for node in cluster3.nodes:
        node.start_replicator(wait=False)
    for node in cluster3.nodes:
        node.wait_ready()
    cluster3.assign(job, generation=2)
    for node in cluster3.nodes:
        st = wait_restored(node, job, node.index)
        assert (st.state, st.step, st.source) == (RestoreState.READY, 35, Tier.GCS)
        staged = step_dir(rank_dir(node.root, job, node.index), 35)
        assert step_files(staged) == step_files(sources[node.index])


def test_corrupt_replica_is_detected_and_fetched_again(cluster3):
    a = cluster3.nodes[0]
    job = new_job("rot")
    cluster3.assign(job)
    sources = commit_everywhere(cluster3, job, 40)
    b = wait_replicated(cluster3, job, 0, 40)
    rep = replica_path(b, job, 0, 40)
    backup_everywhere(cluster3, job, 40)
    data = rep / "data-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # one flipped bit in b's replica
    data.write_bytes(raw)
    lose(a)
    a.start_replicator()
    # the operator's plan names b as rank 0's holder (so b is tried even if it answers slowly)
    plan = RestorePlan(
        job=job,
        step=40,
        world_size=3,
        sources={0: Tier.REPLICA, 1: Tier.LOCAL, 2: Tier.LOCAL},
        holders={0: (b.name,), 1: ("node-1",), 2: ("node-2",)},
        generation=2,
    )
    assert cluster3.api.put_restore_plan(a.endpoint, plan) == plan  # 202: staging started
    cluster3.assign(job, generation=2)  # a learns its node rank and stages with the published plan
    st = wait_restored(a, job, 0)
    assert (st.state, st.source) == (RestoreState.READY, Tier.GCS)  # b's copy failed its crc32c
    assert step_files(step_dir(rank_dir(a.root, job, 0), 40)) == step_files(sources[0])
    # b drops its corrupt copy; a holds rank 0 again and replicates it, so an intact replica comes back,
    # possibly to b within a few milliseconds of the drop (a put of a step b still held would be 208
    # "already held", so intact bytes at b's path prove the corrupt copy was dropped)
    dropped = f"{job} rank 0 step 40 reported corrupt by node-0: replica dropped"
    cluster3.wait_for(
        lambda: dropped in b.log_text() and intact_or_gone(rep, sources[0]),
        what="the corrupt replica dropped by its holder",
    )
    holder = wait_replicated(cluster3, job, 0, 40)
    assert step_files(replica_path(holder, job, 0, 40)) == step_files(sources[0])


def test_peer_killed_mid_transfer_leaves_no_torn_replica(cluster3):
    a, b, c = cluster3.nodes
    job = new_job("kill")
    cluster3.assign(job)
    b.limit_rate("64mbit")  # 8 MB/s towards b: the 24 MiB send takes ~3 s
    try:
        src = write_step(a.root, job, 0, 50, world_size=3, sizes=(24 << 20,))
        incoming = replica_rank_dir(b.root, job, 0)
        cluster3.wait_for(lambda: incoming.is_dir() and leftovers(incoming), what="transfer under way")
        b.kill_replicator()  # the receiver dies mid-transfer
        assert committed_steps(incoming) == []  # nothing torn is visible: only the hidden staging dir
    finally:
        b.unlimit_rate()
    rep = wait_replica(cluster3, c, job, 0, 50)  # the sender moved on to the next candidate
    assert step_files(rep) == step_files(src)
    b.start_replicator()
    # healing copies the step back to b, the assigned peer, and retires c's copy; waiting for that
    # here keeps this job's copy-back out of the next tests (it would run under their rate limits)
    assert step_files(wait_replica(cluster3, b, job, 0, 50)) == step_files(src)
    cluster3.wait_for(lambda: not committed(rep), what="the fallback's copy retired")
    assert not leftovers(b.root) and committed_steps(incoming) == [50]  # the restart cleaned up the torn one


def test_link_cut_then_restored(cluster3):
    a, b, c = cluster3.nodes
    job = new_job("cut")
    cluster3.assign(job)
    b.cut_link()
    try:
        src0 = write_step(a.root, job, 0, 60, world_size=3, sizes=(2 << 20,))
        src1 = write_step(b.root, job, 1, 60, world_size=3, sizes=(2 << 20,))
        assert step_files(wait_replica(cluster3, c, job, 0, 60)) == step_files(src0)  # around b
        assert not committed(replica_path(c, job, 1, 60))  # b cannot send while cut off
    finally:
        b.restore_link()
    holder = wait_replicated(cluster3, job, 1, 60)  # retried once the link is back
    assert holder is not b and step_files(replica_path(holder, job, 1, 60)) == step_files(src1)
    for node in cluster3.nodes:  # a transfer the cut tore is removed once it times out: none stays
        cluster3.wait_for(
            lambda node=node: not leftovers(node.root, job), timeout=120, what="torn transfers gone"
        )


def test_port_blocked_by_nft_is_routed_around(cluster3):
    a, b, c = cluster3.nodes
    job = new_job("nft")
    cluster3.assign(job)
    b.drop_port(b.data_port)
    try:
        src = write_step(a.root, job, 0, 65, world_size=3, sizes=(1 << 20,))
        assert step_files(wait_replica(cluster3, c, job, 0, 65)) == step_files(src)
        assert not replica_path(b, job, 0, 65).exists()
    finally:
        b.clear_drops()


def test_slow_peer_still_gets_an_exact_replica(cluster3):
    a, b, _ = cluster3.nodes
    job = new_job("slow")
    cluster3.assign(job)
    b.limit_rate("40mbit")  # traffic towards b (its veth's egress on the bridge side) at 5 MB/s
    try:
        src = write_step(a.root, job, 0, 67, world_size=3, sizes=(6 << 20,))
        holder = wait_replicated(cluster3, job, 0, 67)
        assert step_files(replica_path(holder, job, 0, 67)) == step_files(src)
        assert not leftovers(holder.root, job)
    finally:
        b.unlimit_rate()


def test_full_receiver_refuses_cleanly(cluster3):
    a, b, c = cluster3.nodes
    job = new_job("full")
    cluster3.assign(job)
    filler = b.fill_ramdisk(leave_bytes=2 << 20)
    try:
        src = write_step(a.root, job, 0, 70, world_size=3, sizes=(8 << 20,))
        assert step_files(wait_replica(cluster3, c, job, 0, 70)) == step_files(src)  # retried elsewhere
        assert (
            not (b.root / job / "replicas").exists()
            or committed_steps(replica_rank_dir(b.root, job, 0)) == []
        )
        assert not leftovers(b.root, job)
        assert step_files(step_dir(rank_dir(a.root, job, 0), 70)) == step_files(src)  # the primary is intact
    finally:
        filler.unlink()


def test_requests_without_credentials_or_malformed_change_nothing(cluster3):
    a, b, c = cluster3.nodes
    job = new_job("sec")
    assignment = cluster3.assign(job)
    newer = assignment.to_bytes().replace(b'"generation":1', b'"generation":9')
    named = {"sni_hostname": node_server_name(a.name)}
    with httpx.Client(base_url=a.endpoint, verify=str(a.tls_files.ca), timeout=10, trust_env=False) as raw:
        for ep in ENDPOINTS:  # what an attacker without a certificate sends: no request gets through
            if not ep.auth:
                continue
            path = ep.url_path(**{p: job for p in ep.path_params})
            with pytest.raises(httpx.TransportError):
                raw.request(ep.method, path, content=newer, extensions=named)
    with SyncReplicatorClient(tls=TlsCredentials(c.tls_files), retry=ONE_ATTEMPT) as as_node:
        with pytest.raises(ReplicatorError) as refused:  # a node's certificate: not the operator
            as_node.put_peers(a.endpoint, PeerAssignment.from_bytes(newer), node=a.name)
        assert refused.value.status == 403
    peers = state_dir(a.root, job) / "peers.json"
    assert json.loads(peers.read_bytes())["generation"] == 1
    operator = TlsCredentials(cluster3.identity_files("operator"))
    with httpx.Client(base_url=a.endpoint, verify=operator.client(named=True), timeout=10) as op:
        resp = op.put(f"/v1/jobs/{job}/peers", content=b'{"kind":"tierckpt.peers"', extensions=named)
        assert resp.status_code == 400
    for path in (
        "/v1/jobs/..%2F..%2Fetc/inventory",
        "/v1/jobs/../../etc/passwd",
        "/v1/jobs/%2e%2e/inventory",
    ):
        conn = http.client.HTTPSConnection(a.ip, a.api_port, timeout=5, context=operator.client())
        conn.request("GET", path)
        assert conn.getresponse().status in (400, 404)
        conn.close()
    with socket.create_connection((a.ip, a.data_port), timeout=5) as s:  # the data endpoint, no TLS
        send_frame(
            s, DataRequest(op="put", token="", job=job, rank=0, step=1, commit_size=10, manifest_size=10)
        )
        with contextlib.suppress(ConnectionResetError):
            assert not s.recv(100).startswith(b"TKR1")  # no answer: the handshake failed
    member = TlsCredentials(b.tls_files).client(named=True)
    for who, req, status in (
        (
            member,
            DataRequest(op="get", token="", job="../x", rank=0, step=1, node=b.name),
            Status.BAD_REQUEST,
        ),
        (
            operator.client(named=True),
            DataRequest(op="get", token="", job=job, rank=0, step=1),
            Status.FORBIDDEN,
        ),
    ):
        with (
            socket.create_connection((a.ip, a.data_port), timeout=5) as s,
            who.wrap_socket(s, server_hostname=node_server_name(a.name)) as tls,
        ):
            send_frame(tls, req)
            assert recv_frame(tls, DataReply).status == status
    assert not (a.root / job / "replicas").exists() and not (a.root / "x").exists()


def test_sigterm_backs_up_the_newest_step(cluster3):
    """Preemption of the whole job: each node backs up what it holds before it exits (runs last)."""
    job = new_job("term")
    cluster3.assign(job)
    commit_everywhere(cluster3, job, 80)
    for rank in range(3):
        wait_replicated(cluster3, job, rank, 80)
    threads = [threading.Thread(target=n.stop_replicator) for n in cluster3.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for node in cluster3.nodes:
        assert "preemption: job " + job + " backed up at step 80" in node.log_text()
        node.start_replicator(wait=False)
    for node in cluster3.nodes:
        node.wait_ready()
    inv = cluster3.api.inventory(cluster3.nodes[0].endpoint, job)
    assert inv is not None and 80 in inv.gcs


class Listener:
    """An attacker's port on the bridge: counts the connections it gets (and keeps what they send)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.seen: list[bytes] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                try:
                    self.seen.append(conn.recv(1 << 16))
                except OSError:
                    self.seen.append(b"")


def test_a_pod_written_control_file_steers_nothing(cluster3):
    """Defect 1: a pod rewrites ``control/peers.json`` in its job directory to name its own endpoint; the
    replicators keep the operator's assignment and never connect there (no token leaves the node)."""
    job = new_job("steer")
    real = cluster3.assign(job)
    api, data = Listener(cluster3.bridge_ip), Listener(cluster3.bridge_ip)
    evil = PeerNode("evil", f"http://{cluster3.bridge_ip}:{api.port}/?data={data.port}")
    forged = dataclasses.replace(
        real,
        generation=10**6,
        nodes={**real.nodes, "evil": evil},
        peers={n: ("evil",) for n in real.nodes},
    )
    for node in cluster3.nodes:  # what the pod on each node writes into its job directory
        (node.root / job / "control").mkdir(parents=True, exist_ok=True)
        (node.root / job / "control" / "peers.json").write_bytes(forged.to_bytes())
    commit_everywhere(cluster3, job, 5)
    for rank in range(cluster3.size):
        wait_replicated(cluster3, job, rank, 5)  # a pass under the operator's assignment ran
    time.sleep(3)  # and a reconcile (every 2 s here), which asks the peers' APIs
    assert api.seen == [] and data.seen == [], "a replicator connected to the endpoint the pod named"
    for node in cluster3.nodes:
        status = next(j for j in cluster3.api.status(node.endpoint).jobs if j.job == job)
        assert status.generation == real.generation


def test_links_into_another_job_are_refused_and_the_node_keeps_serving(cluster3):
    """Defect 2 on a real node: job A's pod links a rank directory into job B. A's inventory, replicas,
    backup and purge touch nothing of B; the replicator says why and keeps serving."""
    a = cluster3.nodes[0]
    tenant, victim = new_job("tenant"), new_job("victim")
    cluster3.assign(tenant)
    secret = write_step(a.root, victim, 0, 7, sizes=(200_000,), seed=11)
    before = step_files(secret)
    commit_everywhere(cluster3, tenant, 7)
    rank_dir(a.root, tenant, 9).symlink_to(rank_dir(a.root, victim, 0))  # "rank 9" of the tenant is B's
    inv = cluster3.api.inventory(a.endpoint, tenant)
    assert inv is not None and 9 not in inv.ranks and inv.ranks[0].local == (7,)
    for rank in range(cluster3.size):
        wait_replicated(cluster3, job=tenant, rank=rank, step=7)
    time.sleep(1.5)  # another pass
    assert not any(replica_rank_dir(n.root, tenant, 9).exists() for n in cluster3.nodes)
    assert cluster3.api.backup(a.endpoint, tenant, timeout=60).step == 7
    store = GcsStore(GcsSettings(bucket=cluster3.bucket, endpoint=cluster3.gcs.url))
    uploaded = store.list(BucketLayout("tierckpt").rank_dir(tenant, 7, 9))[0]
    assert uploaded == []
    assert cluster3.api.purge(a.endpoint, tenant) is not None
    assert not os.path.lexists(a.root / tenant)
    assert step_files(secret) == before and committed_steps(rank_dir(a.root, victim, 0)) == [7]
    assert "refusing" in a.log_text() and "never followed" in a.log_text()
    assert cluster3.api.ready(a.endpoint)
    assert cluster3.api.inventory(a.endpoint, victim).ranks[0].local == (7,)
