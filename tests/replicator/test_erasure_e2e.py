"""Erasure-coded redundancy end to end on five real nodes (network namespaces, a tmpfs each, real
replicators, a fake GCS bucket behind a counting proxy): a job with k=2 data and m=2 parity fragments
places the four fragments of each rank's step on the four other nodes; two nodes lost at once come
back empty and rebuild their ranks from the survivors' fragments, bit-exact, without reading the
bucket (which holds the step too); then the fragments are placed again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.cluster import TEST_REPLICATOR_ARGS, committed, new_job, wait, wait_restored
from tests.replicator.test_cluster_e2e import bucket_complete, lose
from tierckpt.protocol.control import JobPolicy, RestoreState, Tier
from tierckpt.protocol.format import rank_dir, replica_rank_dir, step_dir
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.replication.erasure import read_erasure_manifest

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

K, M, STEP = 2, 2, 10


@pytest.fixture(scope="module")
def cluster5() -> Iterator[LocalCluster]:
    with LocalCluster(
        nodes=5,
        job=new_job("static"),
        k=1,
        gcs=True,
        count_gcs_reads=True,
        ramdisk_size="96m",
        replicator_args=TEST_REPLICATOR_ARGS,
    ) as cluster:
        yield cluster


def fragment_dir(node: Node, job: str, rank: int, step: int) -> Path:
    return step_dir(node.root / job / "fragments" / f"rank-{rank:05d}", step)


def placed(cluster: LocalCluster, job: str, rank: int) -> dict[str, int]:
    """Node -> index of the committed fragment of the rank's step it holds."""
    out = {}
    for node in cluster.nodes:
        path = fragment_dir(node, job, rank, STEP)
        if node.running and committed(path):
            (name,) = [p.name for p in path.glob("fragment-*.bin")]
            out[node.name] = int(name[len("fragment-") : -len(".bin")])
    return out


def fully_placed(cluster: LocalCluster, job: str) -> bool:
    return all(
        sorted(placed(cluster, job, r).values()) == list(range(K + M))
        and f"node-{r}" not in placed(cluster, job, r)
        for r in range(cluster.size)
    )


def test_two_nodes_lost_at_once_are_rebuilt_from_fragments_without_the_bucket(cluster5):
    cluster = cluster5
    job = new_job("ec")
    policy = JobPolicy(job=job, generation=1, erasure_data=K, erasure_parity=M, backup_interval_minutes=0)
    for node in cluster.nodes:
        assert cluster.api.put_policy(node.endpoint, policy, node=node.name) == policy
    cluster.assign(job)
    world = cluster.size
    saved = {
        node.index: step_files(
            write_step(node.root, job, node.index, STEP, world_size=world, sizes=(1 << 20, 3000), files=2)
        )
        for node in cluster.nodes
    }
    wait(cluster, lambda: fully_placed(cluster, job), 60, f"{K + M} fragments of every rank on other nodes")
    for node in cluster.nodes:  # fragments, not replicas: (k+m)/k of the step on the peers, not m copies
        assert not any(committed(step_dir(replica_rank_dir(node.root, job, r), STEP)) for r in range(world))
        em = read_erasure_manifest(fragment_dir(node, job, (node.index + 1) % world, STEP))
        assert (em.layout.k, em.layout.m) == (K, M)

    def reported(node: Node) -> bool:
        (st,) = [j for j in cluster.api.status(node.endpoint, node=node.name).jobs if j.job == job]
        return st.redundancy is not None and (st.redundancy.factor, st.redundancy.copies) == (M, M)

    wait(cluster, lambda: all(reported(n) for n in cluster.nodes), 20, "every node reporting 2 of 2")

    # the bucket holds the step too: a restore that read it instead of the fragments would be seen
    answers: list[object] = []
    threads = [
        threading.Thread(target=lambda n=n: answers.append(cluster.api.backup(n.endpoint, job, timeout=60)))
        for n in cluster.nodes
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait(cluster, lambda: bucket_complete(cluster, job, STEP), 30, "the step complete in the bucket")

    a, b = cluster.nodes[0], cluster.nodes[1]
    lose(a)
    lose(b)  # m = 2 nodes at once: ranks 0 and 1 and their fragments of every other rank are gone
    since = time.time()
    a.start_replicator(wait=False)
    b.start_replicator(wait=False)
    a.wait_ready()
    b.wait_ready()
    for node in (a, b):
        assert cluster.api.put_policy(node.endpoint, policy, node=node.name) == policy
    cluster.assign(job, generation=2)
    for node in (a, b):
        st = wait_restored(node, job, node.index)
        assert (st.state, st.step, st.source) == (RestoreState.READY, STEP, Tier.ERASURE)
        assert step_files(step_dir(rank_dir(node.root, job, node.index), STEP)) == saved[node.index]
    assert cluster.bucket_rank_reads(since) == 0  # rebuilt from the survivors' fragments alone
    # and back at full redundancy: every rank's fragments on four other live nodes again
    wait(cluster, lambda: fully_placed(cluster, job), 60, "every rank's fragments placed again")
