"""Healing end to end on four real nodes (network namespaces, a tmpfs each, real replicators, a fake
GCS bucket): a node lost and replaced, a second failure right after, the replication factor changed
while a job runs, and backups that fall due with no new save.

Plans name three of the four nodes at a time (the fourth is the spare that replaces a lost one), in a
ring by node rank with one peer each, as the operator would publish them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fixtures.cluster import (
    TEST_REPLICATOR_ARGS,
    api_get,
    committed,
    new_job,
    replica_path,
    wait,
    wait_restored,
)
from tests.replicator.test_cluster_e2e import bucket_complete, lose
from tierckpt.protocol.control import (
    JobPolicy,
    JobStatus,
    PeerAssignment,
    PeerNode,
    RestorePlan,
    RestoreState,
    Tier,
)
from tierckpt.protocol.format import rank_dir, step_dir
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import step_files, write_step

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

HEAL_WITHIN = 30.0
"""Seconds from a new plan to full redundancy (reconcile 2 s, retries capped at 2 s, in the test rig)."""


@pytest.fixture(scope="module")
def cluster4() -> Iterator[LocalCluster]:
    with LocalCluster(
        nodes=4,
        job=new_job("static"),
        k=1,
        gcs=True,
        ramdisk_size="160m",
        replicator_args=TEST_REPLICATOR_ARGS,
    ) as cluster:
        yield cluster


@pytest.fixture
def every_node_up(cluster4: LocalCluster) -> Iterator[LocalCluster]:
    """Whatever a test killed runs again afterwards (empty, like a replacement)."""
    yield cluster4
    for node in cluster4.nodes:
        if not node.running:
            node.start_replicator()


def ring(job: str, generation: int, members: Sequence[Node]) -> PeerAssignment:
    """``members`` in node-rank order, each sending to the next."""
    names = [n.name for n in members]
    return PeerAssignment(
        job=job,
        generation=generation,
        nodes={n.name: PeerNode(name=n.name, endpoint=n.peer_endpoint, domain=n.domain) for n in members},
        peers={name: (names[(i + 1) % len(names)],) for i, name in enumerate(names)},
        node_ranks={name: i for i, name in enumerate(names)},
    )


def publish(cluster: LocalCluster, assignment: PeerAssignment) -> None:
    for name in assignment.nodes:
        node = cluster.node(name)
        cluster.api.put_peers(node.endpoint, assignment, node=name)


def set_policy(cluster: LocalCluster, members: Sequence[Node], policy: JobPolicy) -> None:
    for node in members:
        assert cluster.api.put_policy(node.endpoint, policy, node=node.name) == policy


def commit(members: Sequence[Node], job: str, step: int, size: int = 1 << 20) -> dict[int, Path]:
    return {
        rank: write_step(
            node.root, job, rank, step, world_size=len(members), sizes=(size, 1000), files=2, seed=rank + step
        )
        for rank, node in enumerate(members)
    }


def replica_holders(cluster: LocalCluster, job: str, rank: int, step: int) -> list[Node]:
    return [n for n in cluster.nodes if n.running and committed(replica_path(n, job, rank, step))]


def job_status(cluster: LocalCluster, node: Node, job: str) -> JobStatus:
    (status,) = [j for j in cluster.api.status(node.endpoint, node=node.name).jobs if j.job == job]
    return status


def counter(node: Node, name: str, **labels: str) -> float:
    """Sum of a counter's samples on the node's ``/v1/metrics`` (the per-job series, for the operator)
    whose labels include ``labels``."""
    text = api_get(node.cluster, node, "/v1/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == f"{name}_total" and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_node_lost_and_replaced_heals_without_a_save_then_survives_a_second_failure(every_node_up):
    cluster = every_node_up
    n0, n1, n2, n3 = cluster.nodes
    job = new_job("heal")
    publish(cluster, ring(job, 1, [n0, n1, n2]))
    saved = {r: step_files(p) for r, p in commit([n0, n1, n2], job, 10).items()}  # before any is lost
    for rank, peer in ((0, n1), (1, n2), (2, n0)):
        path = replica_path(peer, job, rank, 10)
        wait(cluster, lambda p=path: committed(p), 30, f"rank {rank} on {peer.name}")

    lose(n0)  # rank 0's primary and rank 2's only replica are gone
    # node-2 notices (at its next reconcile) that its replica's holder is gone: its job is degraded
    # (possibly only until it sent rank 2 to another node of the plan, so the count is what is checked)
    wait(
        cluster,
        lambda: counter(n2, "tierckpt_replicator_redundancy_changes", job=job, change="degraded") == 1,
        20,
        "node-2 reporting its rank below the factor",
    )

    # the spare replaces node-0 (a new name: node-0 leaves the plan), as the operator publishes it
    served_before = counter(n1, "tierckpt_replicator_transfers", direction="served")
    gen2 = ring(job, 2, [n3, n1, n2])
    started = time.monotonic()
    publish(cluster, gen2)
    plan = RestorePlan(
        job=job,
        step=10,
        world_size=3,
        sources={0: Tier.REPLICA, 1: Tier.LOCAL, 2: Tier.LOCAL},
        holders={0: (n1.name,), 1: (n1.name,), 2: (n2.name,)},
        generation=2,
    )
    assert cluster.api.put_restore_plan(n3.endpoint, plan, node=n3.name) == plan

    st = wait_restored(n3, job, 0)
    assert (st.state, st.step, st.source) == (RestoreState.READY, 10, Tier.PEER)
    assert step_files(step_dir(rank_dir(n3.root, job, 0), 10)) == saved[0]

    def healed() -> bool:
        placed = {r: replica_holders(cluster, job, r, 10) for r in range(3)}
        if not all(placed.values()):
            return False
        statuses = [job_status(cluster, n, job).redundancy for n in (n1, n2, n3)]
        return all(r is not None and not r.degraded and r.copies >= 1 for r in statuses)

    wait(cluster, healed, HEAL_WITHIN, "every rank replicated on a live node again, with no save")
    heal_seconds = time.monotonic() - started
    assert heal_seconds < HEAL_WITHIN
    holder_of_2 = replica_holders(cluster, job, 2, 10)[0]
    assert holder_of_2 is not n2
    assert step_files(replica_path(holder_of_2, job, 2, 10)) == saved[2]
    assert counter(n2, "tierckpt_replicator_redundancy_changes", job=job, change="healed") >= 1
    # the replacement's restore fetched rank 0 once, though both its new node rank and the plan asked
    assert counter(n1, "tierckpt_replicator_transfers", direction="served") - served_before == 1

    # a second failure right after: node-2 (rank 2's primary) goes; node-0 comes back empty for it
    lose(n2)
    n0.start_replicator()
    publish(cluster, ring(job, 3, [n3, n1, n0]))
    st = wait_restored(n0, job, 2)
    assert (st.state, st.step, st.source) == (RestoreState.READY, 10, Tier.PEER)
    assert step_files(step_dir(rank_dir(n0.root, job, 2), 10)) == saved[2]
    # and rank 1, whose replica was on node-2, is replicated on a live node again
    holders = wait(
        cluster, lambda: replica_holders(cluster, job, 1, 10), HEAL_WITHIN, "rank 1 replicated again"
    )
    assert n1 not in holders and step_files(replica_path(holders[0], job, 1, 10)) == saved[1]


def test_replication_factor_changed_while_the_job_runs(every_node_up):
    cluster = every_node_up
    members = cluster.nodes
    job = new_job("factor")
    publish(cluster, ring(job, 1, members))
    commit(members, job, 10)

    def copies(n: int) -> bool:
        return all(len(replica_holders(cluster, job, r, 10)) == n for r in range(len(members)))

    wait(cluster, lambda: copies(1), 30, "one replica of every rank (the node default, --replicas 1)")
    set_policy(
        cluster, members, JobPolicy(job=job, generation=1, replication_factor=2, backup_interval_minutes=0)
    )
    wait(cluster, lambda: copies(2), HEAL_WITHIN, "two replicas of every rank, with no save")

    def reported(factor: int, copies: int) -> bool:
        want = (factor, copies, None)
        return all(
            (r := job_status(cluster, node, job).redundancy) is not None
            and (r.factor, r.copies, r.degraded_since) == want
            for node in members
        )

    wait(cluster, lambda: reported(2, 2), 10, "every node reporting replicas: 2/2")
    before = {r: set(replica_holders(cluster, job, r, 10)) for r in range(len(members))}
    set_policy(
        cluster, members, JobPolicy(job=job, generation=2, replication_factor=1, backup_interval_minutes=0)
    )
    wait(cluster, lambda: copies(1), HEAL_WITHIN, "the surplus replicas retired")
    wait(cluster, lambda: reported(1, 1), 10, "every node reporting replicas: 1/1")
    for r in range(len(members)):  # one of the two copies stays, the other is gone from its holder
        (kept,) = replica_holders(cluster, job, r, 10)
        assert kept in before[r]


def test_steps_due_while_a_backup_runs_reach_the_bucket_with_no_new_save(every_node_up):
    cluster = every_node_up
    members = cluster.nodes[:3]
    job = new_job("due")
    publish(cluster, ring(job, 1, members))
    interval = 3.0
    policy = JobPolicy(
        job=job, generation=1, backup_interval_steps=10, backup_interval_minutes=interval / 60, keep_last=5
    )
    set_policy(cluster, members, policy)
    for step in (10, 20, 30):  # half a second apart: each commits while the one before is backed up
        commit(members, job, step, size=4 << 20)
        time.sleep(0.5)
    last_save = time.monotonic()
    # due by steps (10 after the last complete backup) or by time: within one interval plus one poll
    wait(
        cluster,
        lambda: bucket_complete(cluster, job, 30),
        interval + 2 + 10,
        "step 30 complete in the bucket, with no new save and no SIGTERM",
    )
    assert time.monotonic() - last_save < interval + 2 + 10
    assert all(node.running for node in members)
