"""Replica groups across real nodes: four netns nodes with real replicators, four gloo training ranks
(one per node) saving a DTensor with a replicate dimension through the real ``Checkpointer``: groups
{0, 2} and {1, 3}. The replicators see the groups, send each rank only to a node that holds an identical
member step (which links its data files), count what that saved, and never deduplicate a group whose
members differ.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import pytest

from tests.backup.helpers import chunk_list
from tests.dcp.dcp_dist import run_ranks
from tests.fixtures.cluster import TEST_REPLICATOR_ARGS, committed, new_job, replica_path, wait_restored
from tests.replicator import group_ranks
from tests.replicator.test_cluster_e2e import backup_everywhere, lose
from tierckpt.protocol.bucket_layout import BucketLayout, ChunkList, RankBackup
from tierckpt.protocol.control import JobStatus, RestoreState, Tier
from tierckpt.protocol.format import rank_dir, read_manifest, step_dir
from tierckpt.verify import verify_step
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import step_files
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore
from tierckpt_replicator.backup.spread import data_rank

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

WORLD = 4
MEMBER = {0: 2, 2: 0, 1: 3, 3: 1}
"""Rank -> the other member of its replica group (groups {0, 2} and {1, 3})."""


@pytest.fixture(scope="module")
def cluster4() -> Iterator[LocalCluster]:
    with LocalCluster(
        nodes=4,
        job=new_job("groups"),
        k=1,
        gcs=True,
        count_gcs_reads=True,
        ramdisk_size="64m",
        replicator_args=TEST_REPLICATOR_ARGS,
    ) as cluster:
        yield cluster


def _assign(cluster: LocalCluster, job: str, generation: int = 1) -> None:
    """Each node's peer is the node of its rank's other group member, as the operator places them
    (``plan_peers(partners=...)``): there the replica can link the member's identical data files."""
    peers = {n.name: (cluster.nodes[MEMBER[n.index]].name,) for n in cluster.nodes}
    cluster.assign(job, generation, peers=peers)


def _save(cluster: LocalCluster, job: str, steps: list[int], *, drift: bool = False) -> None:
    _assign(cluster, job)
    run_ranks(WORLD, group_ranks.save_steps, [str(n.root) for n in cluster.nodes], job, steps, drift)


def _job_status(cluster: LocalCluster, node: Node, job: str) -> JobStatus:
    status = cluster.api.status(node.endpoint, node=node.name)
    return next(j for j in status.jobs if j.job == job)


def _replicated(cluster: LocalCluster, job: str, step: int) -> dict[int, Node]:
    """Rank -> the node holding its committed replica of ``step``, once every rank has one."""

    def holders() -> dict[int, Node] | None:
        found = {}
        for rank in range(WORLD):
            node = next((n for n in cluster.nodes if committed(replica_path(n, job, rank, step))), None)
            if node is None:
                return None
            found[rank] = node
        return found

    result: dict[int, Node] = cluster.wait_for(holders, timeout=60, what=f"replicas of step {step}")
    return result


def _inodes(step: Path) -> set[tuple[int, int]]:
    return {(s.st_dev, s.st_ino) for s in (os.stat(p) for p in step.glob("data-*.bin"))}


def _data_bytes(step: Path) -> int:
    return sum(p.stat().st_size for p in step.glob("data-*.bin"))


def test_members_replicate_to_each_other_by_linking(cluster4: LocalCluster) -> None:
    job = new_job("dedup")
    _save(cluster4, job, [1, 2])
    holders = _replicated(cluster4, job, 2)
    for rank, node in holders.items():
        # Each rank's replica lives on the node of the other member of its group, its data files the
        # very inodes of that member's primary: no second copy in memory, none sent over the network.
        assert node.index == MEMBER[rank], (rank, node.name)
        replica = replica_path(node, job, rank, 2)
        primary = step_dir(rank_dir(node.root, job, MEMBER[rank]), 2)
        assert _inodes(replica) == _inodes(primary) and _inodes(replica)
        assert verify_step(replica).step == 2 and read_manifest(replica).rank == rank  # every crc32c
        source = step_dir(rank_dir(cluster4.nodes[rank].root, job, rank), 2)
        assert step_files(replica) == step_files(source)
    for node in cluster4.nodes:
        st = _job_status(cluster4, node, job)
        assert st.replicated_to == {node.index: (cluster4.nodes[MEMBER[node.index]].name,)}
        assert st.groups and st.diverged == ()
        acc = st.step_bytes
        assert acc is not None and acc.step == 2
        data = _data_bytes(step_dir(rank_dir(node.root, job, node.index), 2))
        assert data >= 1 << 20
        # Without dedup the replica would have cost the whole step; with it only the small files.
        assert acc.replicated_logical >= data
        assert acc.replicated * 2 <= acc.replicated_logical, acc
        assert acc.replicated < 64 << 10, acc
        # The inventory the operator and the peers read: the group and the recomputed content key.
        inv = cluster4.api.inventory(node.endpoint, job, node=node.name)
        assert inv is not None and inv.step_bytes == acc and inv.diverged == ()
        manifest = read_manifest(step_dir(rank_dir(node.root, job, node.index), 2))
        (mine,) = [c for c in inv.contents if c.copy == "local" and c.step == 2]
        assert manifest.replica is not None
        assert (mine.rank, mine.group, mine.content) == (
            node.index,
            manifest.replica.group,
            manifest.replica.content,
        )


def test_a_lost_node_comes_back_from_the_other_members_node(cluster4: LocalCluster) -> None:
    job = new_job("grouploss")
    _save(cluster4, job, [5])
    holders = _replicated(cluster4, job, 5)
    lost, member = cluster4.nodes[0], cluster4.nodes[2]
    # Rank 0's only replica is the one the other member's node holds by linking rank 2's data files.
    assert [n for n in cluster4.nodes if committed(replica_path(n, job, 0, 5))] == [member] == [holders[0]]
    assert _inodes(replica_path(member, job, 0, 5)) == _inodes(step_dir(rank_dir(member.root, job, 2), 5))
    before = step_files(step_dir(rank_dir(lost.root, job, 0), 5))
    lost.kill_replicator()
    lost.wipe_ramdisk()
    lost.start_replicator()
    _assign(cluster4, job, generation=2)
    st = wait_restored(lost, job, 0)
    assert (st.state, st.step, st.source) == (RestoreState.READY, 5, Tier.PEER)
    assert step_files(step_dir(rank_dir(lost.root, job, 0), 5)) == before  # bit-exact


def test_members_that_differ_are_reported_and_not_deduplicated(cluster4: LocalCluster) -> None:
    job = new_job("drift")
    _save(cluster4, job, [3], drift=True)
    holders = _replicated(cluster4, job, 3)
    for rank in (1, 3):
        record = read_manifest(step_dir(rank_dir(cluster4.nodes[rank].root, job, rank), 3)).replica
        assert record is not None and record.diverged
        replica = replica_path(holders[rank], job, rank, 3)
        member = step_dir(rank_dir(holders[rank].root, job, MEMBER[rank]), 3)
        assert not (_inodes(replica) & _inodes(member))  # a copy of its own
        assert step_files(replica) == step_files(step_dir(rank_dir(cluster4.nodes[rank].root, job, rank), 3))
        st = _job_status(cluster4, cluster4.nodes[rank], job)
        assert st.diverged == (rank,)
        assert st.step_bytes is not None and st.step_bytes.replicated >= 1 << 20
    for rank in (0, 2):  # the other group agrees: still linked
        assert holders[rank].index == MEMBER[rank]
        assert _job_status(cluster4, cluster4.nodes[rank], job).diverged == ()
    assert any("hold other content" in cluster4.nodes[r].log_text() for r in (1, 3))
    # In the bucket too: the diverged group's members each upload their own data files (as chunks,
    # each rank its own chunk list).
    backup_everywhere(cluster4, job, 3)
    store = GcsStore(GcsSettings(bucket=cluster4.bucket, endpoint=cluster4.gcs.url))
    layout = BucketLayout("tierckpt")
    for rank in (1, 3):
        commit = RankBackup.from_bytes(
            store.get_bytes(layout.rank_commit_key(job, 3, rank), max_size=1 << 20)
        )
        assert commit.data is None and commit.chunks is not None
        assert _listed(store, layout, job, 3, rank).files


def test_each_shard_is_uploaded_once_and_every_rank_restores_from_it(cluster4: LocalCluster) -> None:
    job = new_job("groupbackup")
    _save(cluster4, job, [7])
    sources = {n.index: step_files(step_dir(rank_dir(n.root, job, n.index), 7)) for n in cluster4.nodes}
    backup_everywhere(cluster4, job, 7)
    store = GcsStore(GcsSettings(bucket=cluster4.bucket, endpoint=cluster4.gcs.url))
    layout = BucketLayout("tierckpt")
    carriers = {data_rank(job, 7, (0, 2)), data_rank(job, 7, (1, 3))}
    uploaded, named = 0, set()
    for rank in range(WORLD):
        objects, _ = store.list(layout.rank_dir(job, 7, rank))
        assert not [o for o in objects if o.name.rsplit("/", 1)[-1].startswith("data-")]  # layout 3
        body = store.get_bytes(layout.rank_commit_key(job, 7, rank), max_size=1 << 20)
        commit = RankBackup.from_bytes(body)
        if rank in carriers:  # its data files are chunks, named by its chunk list
            assert commit.data is None and commit.chunks is not None
            listed = _listed(store, layout, job, 7, rank)
            uploaded += sum(c.size for f in listed.files for c in f.chunks)
            named |= {layout.chunk_key(job, name, codec) for name, codec in listed.names()}
        else:  # its data files are the other member's chunks, named by a typed reference
            assert commit.chunks is None and commit.data is not None and commit.data.rank == MEMBER[rank]
            assert store.list(layout.chunk_lists_of(job, 7, rank))[0] == []
    # One copy per shard in the bucket: half of what four full uploads would hold, and no other chunk.
    saved = sum(_data_bytes(step_dir(rank_dir(n.root, job, n.index), 7)) for n in cluster4.nodes)
    assert uploaded == saved // 2
    assert {o.name for o in store.list(layout.chunks_dir(job))[0]} == named
    accounted = [a for n in cluster4.nodes if (a := _job_status(cluster4, n, job).step_bytes) is not None]
    # The nodes' accounting: what they did not upload is exactly the data files of the referring ranks.
    assert sum(a.uploaded_logical - a.uploaded for a in accounted) == saved // 2
    for node in cluster4.nodes:
        lose(node)
    since = time.time()
    for node in cluster4.nodes:
        node.start_replicator(wait=False)
    for node in cluster4.nodes:
        node.wait_ready()
    _assign(cluster4, job, generation=2)
    for node in cluster4.nodes:
        st = wait_restored(node, job, node.index)
        assert (st.state, st.step, st.source) == (RestoreState.READY, 7, Tier.GCS)
        assert step_files(step_dir(rank_dir(node.root, job, node.index), 7)) == sources[node.index]
    # Restore once, fan out: every rank object was read from the bucket exactly once, and every chunk of
    # the shared data files too (the other member's node took them from the seeder, peer to peer).
    reads = _rank_object_reads(cluster4, since)
    assert reads and all(n == 1 for n in reads.values()), reads
    assert {k for k in reads if k.startswith("chunks/")} == {k.split(layout.job(job), 1)[1] for k in named}
    others = [n for n in cluster4.nodes if n.index not in carriers]
    assert all("(fan-out)" in n.log_text() for n in others)


def _listed(store: GcsStore, layout: BucketLayout, job: str, step: int, rank: int) -> ChunkList:
    return chunk_list(store, layout, job, step, rank)


def _rank_object_reads(cluster: LocalCluster, since: float) -> dict[str, int]:
    """Object (``steps/<step>/rank-<r>/<save>/<file>``, ``chunks/<name>.<codec>``) -> downloads of it through
    the counting proxy."""
    assert cluster.gcs_proxy is not None
    out: dict[str, int] = {}
    for hit in cluster.gcs_proxy.hits:
        target = unquote(hit.target)
        if hit.method != "GET" or hit.at < since or "alt=media" not in target:
            continue
        m = re.search(
            r"/(steps/[0-9]{12,}/rank-[0-9]{5,}/(?:[0-9a-f]{8}/)?[^?/]+|chunks/[0-9a-f]{64}\.[a-z0-9]+)",
            target,
        )
        if m:
            out[m.group(1)] = out.get(m.group(1), 0) + 1
    return out
