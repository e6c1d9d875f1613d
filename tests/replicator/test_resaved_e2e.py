"""A step saved again after the job went back replaces its earlier copies, end to end on three real
nodes (network namespaces, a tmpfs each, real replicators): found by the chaos harness.

After a restore to an older step, training saves the same step numbers again, with other bytes when
training is not bit-reproducible (a GPU's, or a job resharded to another world size). A replica of the
earlier save must not stand in for the new one: a restore that takes it mixes the two runs (a DCP load
refuses it, "rewritten since?", and the job never restores; a native one loads it). The nodes form a
ring with K=1: node-i runs rank i and sends it to node-(i+1).
"""

from __future__ import annotations

import time

import pytest

from tests.fixtures.cluster import cluster3, committed, new_job, replica_path, wait
from tierckpt.planning.restore_plan import choose_restore
from tierckpt.protocol.format import discard_step, rank_dir, step_dir
from tierckpt.snapshot.pool import SlotPool
from tierckpt.snapshot.rankdir import make_room
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import step_files, write_step

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

__all__ = ["cluster3"]  # the module-scoped fixture, re-exported for pytest

WORLD = 3


def save(cluster: LocalCluster, job: str, rank: int, step: int, seed: int) -> dict[str, bytes]:
    """Rank ``rank`` commits ``step`` on its node (replacing a step of that number, as the client does)."""
    node = cluster.nodes[rank]
    discard_step(step_dir(rank_dir(node.root, job, rank), step))
    path = write_step(node.root, job, rank, step, world_size=WORLD, sizes=(1 << 20, 1000), files=2, seed=seed)
    return step_files(path)


def replica_is(cluster: LocalCluster, job: str, rank: int, step: int, want: dict[str, bytes]) -> bool:
    path = replica_path(cluster.nodes[(rank + 1) % WORLD], job, rank, step)
    try:
        return committed(path) and step_files(path) == want
    except FileNotFoundError:  # being replaced right now
        return False


def test_a_step_saved_again_replaces_its_replica_of_the_earlier_save(cluster3):
    job = new_job("resaved")
    cluster3.assign(job)
    first = {r: save(cluster3, job, r, 10, seed=r) for r in range(WORLD)}
    for r in range(WORLD):
        wait(
            cluster3,
            lambda r=r: replica_is(cluster3, job, r, 10, first[r]),
            30,
            f"rank {r}'s step 10 replicated",
        )
    # rank 0 saves step 10 again, other bytes: its peer held the earlier save and answered "already held"
    second = save(cluster3, job, 0, 10, seed=100)
    assert second != first[0]
    wait(
        cluster3, lambda: replica_is(cluster3, job, 0, 10, second), 30, "node-1's replica of rank 0 replaced"
    )


def test_going_back_drops_the_replicas_of_the_steps_above_the_restore(cluster3):
    """A replica of a step above the restore belongs to the run the job left, and no sender may be left to
    replace it (its node lost, or no longer its rank's peer): every node staging the plan drops it."""
    job = new_job("back")
    cluster3.assign(job)
    for step in (5, 10):
        saved = {r: save(cluster3, job, r, step, seed=step + r) for r in range(WORLD)}
        for r in range(WORLD):
            wait(
                cluster3,
                lambda r=r, s=step, b=saved[r]: replica_is(cluster3, job, r, s, b),
                30,
                f"rank {r}'s step {step} replicated",
            )
    # rank 2's step 10 is lost with node-2's copy and node-0's replica: the job goes back to step 5; and
    # node-0 is down (so it cannot send its rank's step 10 again, nor retire node-1's copy of it)
    a, b, c = cluster3.nodes
    discard_step(step_dir(rank_dir(c.root, job, 2), 10))
    discard_step(replica_path(a, job, 2, 10))
    a.kill_replicator()
    try:
        invs = [inv for n in (b, c) if (inv := cluster3.api.inventory(n.endpoint, job)) is not None]
        plan = choose_restore(invs, job=job, generation=2, decided_at=time.time())
        assert plan.step == 5
        for node in (b, c):
            cluster3.api.put_restore_plan(node.endpoint, plan, node=node.name)
        wait(
            cluster3,
            lambda: not committed(replica_path(b, job, 0, 10)),
            30,
            "node-1's copy of step 10 dropped",
        )
        assert committed(replica_path(b, job, 0, 5)), "the restore's step stays"
    finally:
        a.start_replicator()
    # training saves step 10 again: its replicas are the new save's (a node that held the earlier save
    # of a step replaces it with the new one)
    again = {r: save(cluster3, job, r, 10, seed=1000 + r) for r in range(WORLD)}
    for r in range(WORLD):
        wait(cluster3, lambda r=r: replica_is(cluster3, job, r, 10, again[r]), 30, f"rank {r}'s new step 10")


def connecting(src: Node, dst: Node) -> set[str]:
    """The local addresses of ``src``'s connections to ``dst``'s data port still waiting for an answer."""
    out = src.run_in_node(
        ["ss", "-Htn", "state", "syn-sent", "dst", f"{dst.ip}:{dst.data_port}"],
        capture_output=True,
        text=True,
    ).stdout
    return {line.split()[2] for line in out.splitlines() if line.strip()}


def test_a_step_is_saved_again_while_its_send_waits_on_a_peer_that_drops_its_connections(cluster3):
    """Soak 7 (seed 1512564371, round 24): node-2's replicator was sending rank 0's step 39 to node-3,
    whose one-way partition dropped node-2's new connections, when the job went back to step 36 and
    trained to 39 again; the save of step 39 was skipped (leased by a reader: the send, waiting out its
    connect timeout), the job was held with the run it left's step 39, which no node sends, and the rank
    was never healed. Here node-1 drops node-0's connections to its data port: each time the replicator
    is seen connecting (the same connection before and after), the trainer saves step 39 again."""
    job = new_job("unanswered")
    cluster3.assign(job)
    a, b, _ = cluster3.nodes
    rank_path = rank_dir(a.root, job, 0)
    b.drop_port(b.data_port, source=a)
    try:
        spanned = 0
        for attempt in range(20):
            save(cluster3, job, 0, 39, seed=attempt)
            waiting = wait(cluster3, lambda: connecting(a, b), 30, "node-0 connecting to node-1")
            refused = make_room(rank_path, 39, SlotPool(rank_path, target=2))
            if not waiting & connecting(a, b):
                continue  # that connect ended meanwhile: try again
            spanned += 1
            assert refused is None, (
                f"the trainer could not save step 39 again while it was being sent: {refused}"
            )
            if spanned == 3:
                break
        assert spanned == 3, "never saw the trainer's save within one connect"
    finally:
        b.clear_drops()
    saved = save(cluster3, job, 0, 39, seed=100)
    wait(cluster3, lambda: replica_is(cluster3, job, 0, 39, saved), 30, "node-1's replica of the new save")
