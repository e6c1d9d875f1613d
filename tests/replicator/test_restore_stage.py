"""Restore staging on one node (``tierckpt_replicator.restore.stage.Stager``) with a bucket whose
downloads the test releases: what a new plan does to a run that is still staging."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tierckpt.protocol.control import (
    PeerAssignment,
    PeerNode,
    RestorePlan,
    RestoreState,
    RestoreStatus,
    Tier,
    read_restore_status,
    write_control,
)
from tierckpt.protocol.format import read_commit
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.restore.stage import Stager, published_plan

JOB = "ns_job_0123abcd"
STEP = 8


class HeldBucket:
    """A bucket holding ``STEP`` complete, whose downloads wait until ``release`` is set."""

    def __init__(self, root: Path, world: int = 2) -> None:
        self.root, self.world = root, world
        self.release = asyncio.Event()
        self.fetched: list[int] = []

    async def complete_steps(self, job: str) -> tuple[int, ...]:
        return (STEP,)

    async def data_source(self, job: str, step: int, rank: int) -> int | None:
        return None

    async def fetch_rank(self, job: str, step: int, rank: int, dest: Any, *rest: Any) -> None:
        self.fetched.append(rank)
        await self.release.wait()
        write_step(self.root, job, rank, step, world_size=self.world, sizes=(4096,))


def status(root: Path, rank: int) -> RestoreStatus:
    st = read_restore_status(root, JOB, rank)
    assert isinstance(st, RestoreStatus)
    return st


async def wait_state(root: Path, rank: int, state: RestoreState) -> RestoreStatus:
    deadline = time.monotonic() + 10
    while (st := read_restore_status(root, JOB, rank)) is None or st.state is not state:
        assert time.monotonic() < deadline, f"rank {rank}: {st}"
        await asyncio.sleep(0.01)
    return st


def _offline_stager(
    root: Path,
    assignments: AssignmentStore,
    backup: Any,
    own_inventory: Any = None,
    *,
    fanout_wait: float = 0.0,
) -> Stager:
    """Node ``a``'s stager with no worker and no peers (plans that transfer nothing between nodes), one
    attempt per restore."""
    return Stager(
        settings=SimpleNamespace(  # type: ignore[arg-type]
            root=root,
            node_name="a",
            transfer=SimpleNamespace(concurrency=4),
            restore_attempts=1,
            retry_max=1.0,
            restore_fanout_wait=fanout_wait,
        ),
        assignments=assignments,
        supervisor=None,  # type: ignore[arg-type]
        peers=None,  # type: ignore[arg-type]
        metrics=Metrics(),
        own_inventory=own_inventory,
        backup=backup,
    )


async def test_a_new_plan_for_the_step_a_run_still_stages_confirms_the_ranks_it_finished(tmp_path: Path):
    """Rank 0 is here (ready at once), rank 1 still downloads. The client of rank 0 saved since its
    status was written; then a new plan for the same step comes. The run goes on (nothing is fetched
    twice), and rank 0's status is written again, so its client loads the plan's step, not its own."""
    store = AssignmentStore(tmp_path)
    store.put(
        PeerAssignment(JOB, 1, {"a": PeerNode("a", "http://10.0.0.1:8470")}, {}, {"a": 0}, procs_per_node=2)
    )
    bucket = HeldBucket(tmp_path)
    stager = _offline_stager(tmp_path, store, bucket)  # the plan names no peer: nothing to transfer
    write_step(tmp_path, JOB, 0, STEP, world_size=2, sizes=(4096,))
    first = RestorePlan(JOB, STEP, 2, {0: Tier.LOCAL, 1: Tier.GCS}, generation=1)
    run = stager.start(JOB, first)
    before = await wait_state(tmp_path, 0, RestoreState.READY)
    while not bucket.fetched:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.01)
    saved = read_commit(write_step(tmp_path, JOB, 0, STEP + 1, world_size=2, sizes=(4096,)))
    assert saved is not None and saved.committed_at > before.updated_at  # rank 0's client saved since:
    # to it, this status is stale (``restore_wait.restore_target``); it would load its own step 9

    stager.start_for_plan(JOB, RestorePlan(JOB, STEP, 2, {0: Tier.LOCAL, 1: Tier.GCS}, generation=2))
    assert stager._tasks[JOB] is run and not run.done()  # the run goes on
    confirmed = status(tmp_path, 0)
    assert (confirmed.state, confirmed.step) == (RestoreState.READY, STEP)
    assert confirmed.updated_at > saved.committed_at and stager.plans[JOB].generation == 2
    bucket.release.set()
    await asyncio.wait_for(run, 10)
    assert status(tmp_path, 1).state is RestoreState.READY and bucket.fetched == [1]
    await stager.close()


class UnreachableBucket(HeldBucket):
    """A bucket the node cannot reach: asking it which rank holds a rank's data files hangs (a client
    retrying a partitioned bucket) until the test lets it go."""

    async def data_source(self, job: str, step: int, rank: int) -> int | None:
        await self.release.wait()
        raise OSError("the bucket does not answer")


async def test_a_rank_reads_a_moving_pending_status_while_its_node_cannot_ask_the_bucket(tmp_path: Path):
    """A node lost and back empty stages rank 0 from the bucket, but it is cut off from the bucket: the
    run's first question (which ranks' data files are another member's, ``FanOut.order``) hangs. Its
    client must see a status that moves meanwhile (with none, it waited out its stall timeout and
    loaded what the empty ramdisk holds: nothing, so the whole job started afresh; found by the chaos
    harness, seed 21)."""
    store = AssignmentStore(tmp_path)
    store.put(PeerAssignment(JOB, 1, {"a": PeerNode("a", "http://10.0.0.1:8470")}, {}, {"a": 0}))
    bucket = UnreachableBucket(tmp_path, world=1)
    stager = _offline_stager(tmp_path, store, bucket, fanout_wait=1.0)
    run = stager.start(JOB, RestorePlan(JOB, STEP, 1, {0: Tier.GCS}, generation=1))
    first = await wait_state(tmp_path, 0, RestoreState.PENDING)
    await asyncio.sleep(2.5)
    later = status(tmp_path, 0)
    assert not run.done() and not bucket.fetched  # still asking the bucket
    assert later.state is RestoreState.PENDING and later.updated_at >= first.updated_at + 1.5
    bucket.release.set()
    await asyncio.wait_for(run, 10)
    assert status(tmp_path, 0).state is RestoreState.READY and bucket.fetched == [0]
    await stager.close()


def test_a_published_plan_stands_for_every_assignment_of_its_attempt_and_no_later_one(tmp_path: Path):
    """A plan's generation is the attempt it is for, an assignment's generation milliseconds: the plan is
    staged under any assignment of its attempt (or of none known), never under a later attempt's or
    one that names no attempt (then the replicator computes its own)."""
    plan = RestorePlan(JOB, STEP, 1, {0: Tier.PEER}, {0: ("b",)}, generation=2)
    write_control(tmp_path, JOB, RestorePlan.FILE, plan)
    nodes = {n: PeerNode(n, f"http://10.0.0.{i}:8470") for i, n in enumerate("ab", 1)}

    def under(generation: int, attempt: int) -> RestorePlan | None:
        assignment = PeerAssignment(JOB, generation, nodes, {}, {"a": 0}, procs_per_node=1, attempt=attempt)
        return published_plan(tmp_path, JOB, assignment)

    ms = int(time.time() * 1000)
    assert under(ms, 2) == plan and under(ms + 1, 2) == plan  # the attempt's later peer generations
    assert under(ms, 1) == plan  # an older attempt's node ranks (the new ones on their way)
    assert under(ms, 3) is None and under(1, 0) is None and under(ms, 0) is None
    assert published_plan(tmp_path, JOB, None) == plan


async def test_a_restarted_replicator_stages_the_standing_plan_until_training_saves_past_it(tmp_path: Path):
    """Soak seed 1123556854, round 22: a replicator restarted while it staged computed its own plan
    (step 45) instead of staging the operator's (48), the plan's generation being the attempt and the
    assignment's milliseconds. Now it stages the plan of its assignment's attempt, without asking for
    any inventory; once a rank here saved another step after the plan was decided, that restore is
    over and a restart computes the newest restorable step again (nothing above it is dropped)."""
    store = AssignmentStore(tmp_path)
    node = {"a": PeerNode("a", "http://10.0.0.1:8470")}
    store.put(PeerAssignment(JOB, int(time.time() * 1000), node, {}, {"a": 0}, procs_per_node=1, attempt=2))
    asked: list[str] = []

    async def own_inventory(job: str) -> Any:
        asked.append(job)
        raise RuntimeError("this test computes no plan")

    def restarted() -> Stager:
        # the plan's step is here: nothing to transfer
        return _offline_stager(
            tmp_path, AssignmentStore(tmp_path), HeldBucket(tmp_path, world=1), own_inventory
        )

    write_step(tmp_path, JOB, 0, STEP, sizes=(4096,))
    write_step(tmp_path, JOB, 0, STEP + 4, sizes=(4096,))  # newer, but the job restores STEP
    plan = RestorePlan(JOB, STEP, 1, {0: Tier.LOCAL}, {0: ("a",)}, generation=2, decided_at=time.time())
    write_control(tmp_path, JOB, RestorePlan.FILE, plan)
    stager = restarted()
    await asyncio.wait_for(stager.start(JOB), 10)
    ready = status(tmp_path, 0)
    assert (ready.state, ready.step, asked) == (RestoreState.READY, STEP, [])
    assert stager.plans[JOB] == plan
    await stager.close()

    await asyncio.sleep(0.01)
    write_step(tmp_path, JOB, 0, STEP + 1, sizes=(4096,))  # the job trained on from the plan's step
    stager = restarted()
    await asyncio.wait_for(stager.start(JOB), 10)
    assert asked == [JOB] and JOB not in stager.plans  # it computed a plan (this test's own fails)
    await stager.close()


class EmptyBucket(HeldBucket):
    """A bucket that holds no complete step of the job."""

    async def complete_steps(self, job: str) -> tuple[int, ...]:
        return ()


async def test_a_rank_the_plans_step_did_not_have_is_told_the_step_though_its_primary_is_here(tmp_path: Path):
    """A DCP job grew from 2 nodes to 3 onto node ``a`` (node rank 2, rank 2), saved step 11 there (3
    ranks), and went back to step 8 (saved by 2 ranks; step 11 was not committed on every rank). Rank 2
    has nothing to stage and learns step 8 at once. The stager took the ranks whose primaries live here
    (rank 2's step 11) for this node's ranks, since its node rank gives none below the plan's world size,
    and failed rank 2's restore of a step that never had it, every attempt (``step 8 is not complete in
    the bucket``; found replaying the soak of seed 1212452211)."""
    nodes = {n: PeerNode(n, f"http://10.0.0.{i}:8470") for i, n in enumerate(("b", "c", "a"))}
    store = AssignmentStore(tmp_path)
    store.put(PeerAssignment(JOB, 1, nodes, {}, {"b": 0, "c": 1, "a": 2}, procs_per_node=1, attempt=3))
    write_step(tmp_path, JOB, 2, STEP + 3, world_size=3, sizes=(4096,))
    bucket = EmptyBucket(tmp_path)
    stager = _offline_stager(tmp_path, store, bucket)
    plan = RestorePlan(JOB, STEP, 2, {0: Tier.LOCAL, 1: Tier.LOCAL}, {0: ("b",), 1: ("c",)}, generation=3)
    await asyncio.wait_for(stager.start(JOB, plan), 10)
    told = status(tmp_path, 2)
    assert (told.state, told.step) == (RestoreState.READY, STEP), told
    assert bucket.fetched == []
    await stager.close()


async def test_a_fresh_start_drops_the_replicas_of_the_run_the_job_left(tmp_path: Path):
    """A DCP job started afresh (no step restorable by every rank) while node ``a`` held a replica of
    rank 2's step 3 of the run it left; the job saved step 3 again, sent it to another node, and went
    back to it: rank 0's resharding load read the stale replica here and failed every attempt ("not the
    step rank 2 wrote for this DCP checkpoint"; replaying the soak of seed 613830794). Staging a fresh
    start drops every replica of the job here, as staging a step drops those above it; a leased one
    stays until its reader is done."""
    from tierckpt.protocol import leases
    from tierckpt.protocol.format import replica_rank_dir

    nodes = {n: PeerNode(n, f"http://10.0.0.{i}:8470") for i, n in enumerate(("a", "b", "c"))}
    store = AssignmentStore(tmp_path)
    store.put(PeerAssignment(JOB, 1, nodes, {}, {"a": 0, "b": 1, "c": 2}, procs_per_node=1, attempt=2))
    write_step(tmp_path, JOB, 0, 3, world_size=3, sizes=(4096,))
    for rank, step in ((2, 3), (1, 6)):
        write_step(
            tmp_path,
            JOB,
            rank,
            step,
            world_size=3,
            sizes=(4096,),
            parent=replica_rank_dir(tmp_path, JOB, rank),
        )
    leased = replica_rank_dir(tmp_path, JOB, 1)
    read = leases.acquire(leased, 6, "reader", ttl=60)
    stager = _offline_stager(tmp_path, store, EmptyBucket(tmp_path))
    plan = RestorePlan(JOB, None, 0, {}, generation=2, decided_at=time.time())
    await asyncio.wait_for(stager.start(JOB, plan), 10)
    assert status(tmp_path, 0).state is RestoreState.NONE
    assert read_commit(replica_rank_dir(tmp_path, JOB, 2) / "step-000000000003") is None
    assert read_commit(replica_rank_dir(tmp_path, JOB, 1) / "step-000000000006") is not None  # leased
    leases.release(leased, read)
    await stager.close()


async def test_staging_drops_the_steps_the_run_the_job_left_saved_of_a_rank_no_longer_run_here(
    tmp_path: Path,
):
    """A DCP job grew to 4 nodes, where node ``a`` ran rank 2 and saved steps 66 to 72, then shrank to 3
    and went back to step 63: ``a`` now runs rank 0, so no client here retires rank 2's steps above 63.
    Once training saved 72 again (rank 2 on another node), ``a``'s old rank 2 step 72 counted as the
    rank's newest here: it was sent to a peer, and rank 0's load read it and failed every attempt ("not
    the step rank 2 wrote for this DCP checkpoint"; soak, seed 1512564371, round 41). Staging the plan
    drops them (a leased one stays until its reader is done), and only them: the plan's step and the
    node's own rank's steps (its client retires those) stay."""
    from tierckpt.protocol import leases
    from tierckpt.protocol.format import rank_dir, step_dir

    nodes = {n: PeerNode(n, f"http://10.0.0.{i}:8470") for i, n in enumerate(("a", "b", "c"))}
    store = AssignmentStore(tmp_path)
    store.put(PeerAssignment(JOB, 1, nodes, {}, {"a": 0, "b": 1, "c": 2}, procs_per_node=1, attempt=2))
    for rank, step in ((0, 63), (0, 66), (2, 63), (2, 66), (2, 69), (2, 72)):
        write_step(tmp_path, JOB, rank, step, world_size=3 if step == 63 else 4, sizes=(4096,))
    leased = rank_dir(tmp_path, JOB, 2)
    read = leases.acquire(leased, 69, "reader", ttl=60)
    stager = _offline_stager(tmp_path, store, EmptyBucket(tmp_path))
    plan = RestorePlan(JOB, 63, 3, {0: Tier.LOCAL}, generation=2, decided_at=time.time())
    await asyncio.wait_for(stager.start(JOB, plan), 10)
    await wait_state(tmp_path, 0, RestoreState.READY)

    def held(rank: int, step: int) -> bool:
        return read_commit(step_dir(rank_dir(tmp_path, JOB, rank), step)) is not None

    assert not held(2, 66) and not held(2, 72)
    assert held(2, 69)  # leased
    assert held(2, 63) and held(0, 63) and held(0, 66)
    leases.release(leased, read)
    await stager.close()
