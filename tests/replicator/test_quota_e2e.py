"""Sparse files cost a pod nothing and a peer everything (hardening issue, item 8): a per-job quota on
the sending and the receiving side, on two real replicators (netns nodes, tmpfs ramdisks, mutual TLS)
and a fake GCS bucket.

Job A's policy sets its quota to 8 MiB (the operator sends the job's ramdisk size). A's pod on node-0
commits a step whose data file is one 48 MiB hole: it takes nothing on node-0's tmpfs, but its manifest
declares (and checksums) 48 MiB of zeros, which node-1 and the bucket would store for real. node-0
refuses to send it or upload it, says why in its log, inventory and metrics; a put of such a step sent
straight to node-1 (as node-0, a member of A) is refused there with 413 before anything is reserved.
Nothing of it reaches node-1 or the bucket; A's other rank, A's older and later steps and job B are
replicated and backed up as usual.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.cluster import (
    TEST_REPLICATOR_ARGS,
    committed,
    metric,
    new_job,
    replica_path,
    wait,
    write_sparse_step,
)
from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt.protocol.control import JobPolicy
from tierckpt.protocol.format import COMMIT_NAME, MANIFEST_NAME, replica_rank_dir
from tierckpt.protocol.identity import TlsCredentials, node_server_name
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, recv_frame, send_frame

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

MiB = 1 << 20
QUOTA = 8 * MiB
SPARSE = 48 * MiB
"""Fits node-1's ramdisk and the bucket (so without a quota both would store it), not A's quota."""
LAYOUT = BucketLayout("tierckpt")


@pytest.fixture(scope="module")
def pair() -> Iterator[LocalCluster]:
    """node-0 and node-1 (each the other's peer), 160 MiB ramdisks, a fake GCS bucket."""
    with LocalCluster(
        nodes=2,
        job=new_job("quota-static"),
        k=1,
        gcs=True,
        ramdisk_size="160m",
        replicator_args=TEST_REPLICATOR_ARGS,
    ) as cluster:
        yield cluster


def bucket_keys(cluster: LocalCluster, prefix: str) -> list[str]:
    assert cluster.gcs is not None
    return [b.name for b in cluster.gcs.client().list_blobs(cluster.bucket, prefix=prefix)]


def complete_in_bucket(cluster: LocalCluster, job: str, step: int) -> bool:
    return bool(bucket_keys(cluster, LAYOUT.complete_key(job, step)))


def replicated(cluster: LocalCluster, job: str, step: int) -> bool:
    """Each node's rank of ``step`` (node-0 runs rank 0, node-1 rank 1) is committed at the other."""
    a, b = cluster.nodes
    return committed(replica_path(b, job, 0, step)) and committed(replica_path(a, job, 1, step))


def incoming(node: Node, job: str, rank: int) -> list[str]:
    """Staging directories of replicas being received (or left behind) on ``node``."""
    parent = replica_rank_dir(node.root, job, rank)
    return [p.name for p in parent.iterdir() if p.name.startswith(".incoming")] if parent.exists() else []


def put_as(sender: Node, receiver: Node, step_path: Path, *, job: str, rank: int, step: int) -> DataReply:
    """A put of the committed step at ``step_path`` from ``sender``'s identity straight to ``receiver``'s
    data port: the request and its COMMIT and manifest, then the receiver's answer (no data follows)."""
    commit, manifest = (step_path / COMMIT_NAME).read_bytes(), (step_path / MANIFEST_NAME).read_bytes()
    req = DataRequest(
        op="put",
        token="",
        job=job,
        rank=rank,
        step=step,
        node=sender.name,
        commit_size=len(commit),
        manifest_size=len(manifest),
    )
    ctx = TlsCredentials(sender.tls_files).client(named=True)
    with (
        socket.create_connection((receiver.ip, receiver.data_port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=node_server_name(receiver.name)) as sock,
    ):
        send_frame(sock, req, commit + manifest)
        return recv_frame(sock, DataReply)


def test_a_sparse_step_over_the_jobs_quota_is_refused_on_both_sides(
    pair: LocalCluster, tmp_path: Path
) -> None:
    a, b = pair.nodes
    job, other = new_job("quota"), new_job("bystander")
    for j in (job, other):
        pair.assign(j)
    policy = JobPolicy(
        job=job, generation=1, backup_interval_steps=1, backup_interval_minutes=0, quota_bytes=QUOTA
    )
    for node in pair.nodes:
        pair.api.put_policy(node.endpoint, policy, node=node.name)

    # step 1, within the quota: replicated both ways and backed up
    for node in pair.nodes:
        write_step(node.root, job, node.index, 1, world_size=2, sizes=(MiB,))
    wait(pair, lambda: replicated(pair, job, 1), 30, "step 1 replicated")
    wait(pair, lambda: complete_in_bucket(pair, job, 1), 30, "step 1 in the bucket")

    # step 2: node-0's rank is one 48 MiB hole, node-1's an ordinary step
    sparse = write_sparse_step(a.root, job, 0, 2, declared=SPARSE, world_size=2)
    assert (sparse / "data-00000.bin").stat().st_blocks == 0
    write_step(b.root, job, 1, 2, world_size=2, sizes=(MiB,))
    refusal = f"job {job} rank 0 step 2 declares 48.0Mi, over the job's quota of 8.0Mi"
    sparse_here = "(its files take 0B on this node's ramdisk: sparse)"
    wait(
        pair,
        lambda: f"{refusal} {sparse_here}: not replicated, not backed up" in a.log_text(),
        30,
        "node-0 refusing to send the sparse step",
    )
    wait(pair, lambda: f"backup of {job} failed: {refusal}" in a.log_text(), 30, "node-0 refusing its upload")
    wait(pair, lambda: committed(replica_path(a, job, 1, 2)), 30, "node-1's rank of step 2 replicated")
    wait(
        pair, lambda: bucket_keys(pair, LAYOUT.refused_key(job, 2)), 30, "step 2 marked refused in the bucket"
    )
    inv = pair.api.inventory(a.endpoint, job, node=a.name)
    assert inv is not None and len(inv.over_quota) == 1
    over = inv.over_quota[0]
    assert (over.rank, over.step, over.bytes, over.quota, over.allocated) == (0, 2, SPARSE, QUOTA, 0)
    (mine,) = [j for j in pair.api.status(a.endpoint, node=a.name).jobs if j.job == job]
    assert mine.over_quota == inv.over_quota and refusal in mine.backup_error
    assert metric(a, "tierckpt_replicator_quota_refusals_total", op="send") == 1

    # the same kind of step put straight to node-1 by node-0 (a member of the job): refused up front
    forged = write_sparse_step(tmp_path, job, 0, 3, declared=SPARSE, world_size=2)
    reply = put_as(a, b, forged, job=job, rank=0, step=3)
    assert reply.status == Status.TOO_LARGE, reply
    assert f"job {job} rank 0 step 3 declares 48.0Mi, over the job's quota of 8.0Mi" in reply.message
    assert metric(b, "tierckpt_replicator_quota_refusals_total", op="receive") == 1
    assert f"put from {a.name}: refused: job {job} rank 0 step 3 declares 48.0Mi" in b.log_text()

    # nothing of either reached node-1 or the bucket; the rank's older step is still there
    for step in (2, 3):
        assert not committed(replica_path(b, job, 0, step))
        assert not bucket_keys(pair, LAYOUT.rank_dir(job, step, 0))
        assert not bucket_keys(pair, LAYOUT.rank_commit_key(job, step, 0))
    assert incoming(b, job, 0) == []
    assert committed(replica_path(b, job, 0, 1)) and complete_in_bucket(pair, job, 1)

    # the job's next step within the quota, and another job, go out as usual: replicated, backed up
    for node in pair.nodes:
        write_step(node.root, job, node.index, 4, world_size=2, sizes=(MiB,))
        write_step(node.root, other, node.index, 1, world_size=2, sizes=(MiB,))
    wait(pair, lambda: replicated(pair, job, 4) and replicated(pair, other, 1), 30, "step 4 and job B")
    wait(pair, lambda: complete_in_bucket(pair, job, 4), 30, "step 4 in the bucket")
    inv = pair.api.inventory(a.endpoint, job, node=a.name)
    assert inv is not None and inv.over_quota == ()
