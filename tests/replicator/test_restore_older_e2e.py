"""Restoring to an older step, end to end on three real nodes (network namespaces, a tmpfs each, real
replicators, a fake GCS bucket) with real ``Checkpointer`` clients loading what the replicators staged.

The nodes form a ring with K=1: node-i runs rank i and sends it to node-(i+1). Step 5 is backed up, then
10 and 15 are saved and replicated. Losing node-0 and node-1 together (rank 0's primary and its only
replica) leaves step 5, in the bucket, as the newest step every rank can restore, while the survivor
node-2 still holds rank 2's steps 10 and 15. The operator's plan (computed here as the operator does,
from every node's inventory, and published to every node) falls back to step 5. The last test sends a
rank to the bucket for a step that is not there (a stale plan): it must fail with the reason.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

from tests.fixtures.cluster import cluster3, new_job, wait
from tests.replicator.test_cluster_e2e import backup_everywhere, lose, wait_replicated
from tierckpt import Checkpointer
from tierckpt.planning.restore_plan import choose_restore
from tierckpt.protocol.control import RestorePlan, RestoreState, Tier, read_restore_status
from tierckpt.protocol.format import committed_steps, rank_dir
from tierckpt_demo.cluster import LocalCluster

pytestmark = [pytest.mark.root, pytest.mark.e2e, pytest.mark.slow]

__all__ = ["cluster3"]  # the module-scoped fixture, re-exported for pytest

WORLD = 3
BACKED_UP = 5


def state(rank: int, step: int) -> dict[str, torch.Tensor]:
    """What rank ``rank`` trains into its state by ``step`` (1 MiB, the same on every call)."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    return {"w": torch.randn(1 << 18, generator=g), "step": torch.tensor(step)}


@contextlib.contextmanager
def trainers(cluster: LocalCluster, job: str) -> Iterator[dict[int, Checkpointer]]:
    """Each node's training process: a ``Checkpointer`` per rank (keep=2), as the operator configures it;
    all of them end with the block (the pods go)."""
    with contextlib.ExitStack() as stack:
        yield {
            node.index: stack.enter_context(
                Checkpointer(
                    root=node.root,
                    job=job,
                    rank=node.index,
                    world_size=WORLD,
                    keep=2,
                    replicator_url=node.endpoint,
                    restore_wait=60,
                )
            )
            for node in cluster.nodes
        }


def save(cks: dict[int, Checkpointer], step: int) -> None:
    for rank, ck in cks.items():
        ck.save(step, state(rank, step), blocking=True)


def publish_plan(cluster: LocalCluster, job: str, generation: int) -> RestorePlan:
    """What the operator does for a new attempt: every node's inventory, the plan, sent to every node."""
    invs = [inv for n in cluster.nodes if (inv := cluster.api.inventory(n.endpoint, job)) is not None]
    plan = choose_restore(invs, job=job, generation=generation, decided_at=time.time())
    for node in cluster.nodes:
        assert cluster.api.put_restore_plan(node.endpoint, plan, node=node.name) == plan
    return plan


def lose_peer_group(cluster: LocalCluster, job: str, generation: int) -> RestorePlan:
    """node-0 and node-1 lost together and replaced (empty); the new attempt's ranks and plan sent."""
    a, b, _ = cluster.nodes
    lose(a)
    lose(b)
    a.start_replicator(wait=False)
    b.start_replicator(wait=False)
    a.wait_ready()
    b.wait_ready()
    cluster.assign(job, generation=generation)
    return publish_plan(cluster, job, generation)


def load_everywhere(cluster: LocalCluster, job: str, plan: RestorePlan) -> None:
    """Once every rank's restore status is final, a new trainer on every rank loads the plan's step, bit
    for bit; every status says that step and was written after the plan (once a replicator accepted a
    plan it shows no older status)."""
    statuses = {
        node.index: wait(
            cluster,
            lambda n=node: (
                (s := read_restore_status(n.root, job, n.index)) is not None
                and s.state in (RestoreState.READY, RestoreState.NONE, RestoreState.FAILED)
                and s
            ),
            timeout=60,
            what=f"rank {node.index} staged for the plan of generation {plan.generation}",
        )
        for node in cluster.nodes
    }
    loaded = {}
    with trainers(cluster, job) as cks:
        for rank, ck in cks.items():
            dest = {"w": torch.zeros(1 << 18), "step": torch.tensor(0)}
            step = loaded[rank] = ck.load(dest)
            assert step is not None and torch.equal(dest["w"], state(rank, step)["w"])
            assert int(dest["step"]) == step
    assert loaded == {rank: plan.step for rank in range(WORLD)}, statuses
    for st in statuses.values():
        assert st.state == RestoreState.READY and st.updated_at > plan.decided_at, st


def saved_then_backed_up_then_newer(cluster: LocalCluster, job: str) -> None:
    """Step 5 everywhere and in the bucket, then 10 and 15 everywhere and replicated."""
    cluster.assign(job)
    with trainers(cluster, job) as cks:
        save(cks, BACKED_UP)
        backup_everywhere(cluster, job, BACKED_UP)
        for step in (10, 15):
            save(cks, step)
    for rank in range(WORLD):
        wait_replicated(cluster, job, rank, 15)


def test_a_restore_to_an_older_step_loads_it_on_every_node_the_survivors_included(cluster3):
    """Issue 16: the survivor's writer start (crash clean-up, keep=2) kept the staged step 5 next to its
    newer 10 and 15; every rank loads step 5 bit-exact, and once training saved after it, the newer
    steps of the abandoned run are gone and a restart loads the new step."""
    job = new_job("older")
    saved_then_backed_up_then_newer(cluster3, job)
    survivor = cluster3.nodes[2]

    plan = lose_peer_group(cluster3, job, generation=2)
    # Rank 0's step 5 is in the bucket, and on the replaced nodes too once they staged it from there (and
    # replicated it) before the operator's inventories were taken: the plan may name either source.
    assert plan.step == BACKED_UP
    load_everywhere(cluster3, job, plan)
    assert committed_steps(rank_dir(survivor.root, job, 2)) == [5, 10, 15]  # kept until a save

    with trainers(cluster3, job) as cks:  # the job resumes from step 5 and saves step 6
        for ck in cks.values():
            assert ck.load({"w": torch.zeros(1 << 18), "step": torch.tensor(0)}) == BACKED_UP
        save(cks, 6)
    assert committed_steps(rank_dir(survivor.root, job, 2)) == [5, 6]
    with trainers(cluster3, job) as cks:  # a crash later, no new plan: each rank's newest step
        for rank, ck in cks.items():
            dest = {"w": torch.zeros(1 << 18), "step": torch.tensor(0)}
            assert ck.load(dest) == 6 and torch.equal(dest["w"], state(rank, 6)["w"])


def test_a_second_plan_for_the_same_step_is_staged_again_on_every_node(cluster3):
    """Issue 17: after a restore to step 5 and training on to step 7, the same peer group is lost again
    and the next plan names step 5 once more. The survivor's run for the previous plan (step 5, the
    same rank) had finished; it stages again, so its status is newer than its commits and its rank loads
    step 5 like the others, not its own newer step 7."""
    job = new_job("again")
    saved_then_backed_up_then_newer(cluster3, job)
    survivor = cluster3.nodes[2]
    first = lose_peer_group(cluster3, job, generation=2)
    assert first.step == BACKED_UP
    load_everywhere(cluster3, job, first)
    with trainers(cluster3, job) as cks:
        for ck in cks.values():
            ck.load({"w": torch.zeros(1 << 18), "step": torch.tensor(0)})
        save(cks, 6)
        save(cks, 7)
    assert committed_steps(rank_dir(survivor.root, job, 2)) == [6, 7]

    plan = lose_peer_group(cluster3, job, generation=3)
    assert plan.step == BACKED_UP and plan.generation == 3
    load_everywhere(cluster3, job, plan)
    assert BACKED_UP in committed_steps(rank_dir(survivor.root, job, 2))


def test_a_plan_naming_a_step_the_bucket_lacks_fails_the_rank_with_the_reason(cluster3):
    """Issue 19: the plan sends a rank to the bucket for a step that is not complete there (a stale plan,
    a backup deleted since). The fan-out's probe of the step's data source finds no completion object;
    the rank tries its rounds and ends ``failed`` saying why, instead of staging failing "unexpectedly"
    and leaving the status for the client to wait out."""
    a = cluster3.nodes[0]
    job = new_job("nobucket")
    cluster3.assign(job)
    plan = RestorePlan(
        job=job,
        step=9,
        world_size=WORLD,
        sources=dict.fromkeys(range(WORLD), Tier.GCS),
        generation=2,
        decided_at=time.time(),
    )
    cluster3.api.put_restore_plan(a.endpoint, plan, node=a.name)
    st = wait(
        cluster3,
        lambda: (
            (s := read_restore_status(a.root, job, 0)) is not None
            and s.updated_at > plan.decided_at
            and s.state in (RestoreState.READY, RestoreState.NONE, RestoreState.FAILED)
            and s
        ),
        timeout=30,
        what="rank 0's staging ends",
    )
    assert st.state == RestoreState.FAILED and "step 9 is not complete in the bucket" in st.message, st
    assert "staging failed unexpectedly" not in a.log_text()


def test_a_replicator_restarted_while_the_operators_plan_stands_stages_that_plan(cluster3):
    """Soak seed 1123556854, round 22: a replicator restarted while it staged computed its own plan
    instead of staging the operator's (restored 45, the plan said 48), the plan's generation being the
    attempt and the peer assignment's milliseconds. Here the operator's scales: the assignment's
    generation in milliseconds naming attempt 2, the plan's generation 2, and the plan names step 5
    while every node holds 10 (what a replicator would compute). node-1's replicator, restarted before
    training resumed, stages step 5 again, and its rank loads step 5 like the others."""
    job = new_job("standing")
    cluster3.assign(job, generation=int(time.time() * 1000), attempt=1)
    with trainers(cluster3, job) as cks:
        save(cks, BACKED_UP)
        save(cks, 10)
    for rank in range(WORLD):
        wait_replicated(cluster3, job, rank, 10)
    cluster3.assign(job, generation=int(time.time() * 1000), attempt=2)  # the restart's node ranks
    plan = RestorePlan(
        job=job,
        step=BACKED_UP,
        world_size=WORLD,
        sources=dict.fromkeys(range(WORLD), Tier.LOCAL),
        holders={n.index: (n.name,) for n in cluster3.nodes},
        generation=2,
        decided_at=time.time(),
    )
    for node in cluster3.nodes:
        cluster3.api.put_restore_plan(node.endpoint, plan, node=node.name)
    b = cluster3.nodes[1]
    wait(
        cluster3,
        lambda: (s := read_restore_status(b.root, job, 1)) is not None and s.state == RestoreState.READY,
        timeout=60,
        what="node-1 staged the plan",
    )
    restarted_at = time.time()
    b.restart_replicator()
    st = wait(
        cluster3,
        lambda: (
            (s := read_restore_status(b.root, job, 1)) is not None
            and s.updated_at > restarted_at
            and s.state in (RestoreState.READY, RestoreState.NONE, RestoreState.FAILED)
            and s
        ),
        timeout=60,
        what="node-1 staged again after its restart",
    )
    assert (st.state, st.step) == (RestoreState.READY, BACKED_UP), st
    load_everywhere(cluster3, job, plan)
