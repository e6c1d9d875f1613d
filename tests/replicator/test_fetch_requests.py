"""Fetch requests from training ranks (``restore.requests``): untrusted files, read safely, checked
against what the job holds, answered with a status the client waits on."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
import uuid
from pathlib import Path

import pytest

from tierckpt.protocol.control import (
    MAX_FETCH_RANKS,
    FetchRequest,
    FetchStatus,
    NodeInventory,
    PeerAssignment,
    PeerNode,
    RankHoldings,
    RestorePlan,
    RestoreState,
    Tier,
    fetch_request_name,
    read_fetch_status,
    read_restore_status,
)
from tierckpt.protocol.errors import FormatError, RetryableError
from tierckpt.protocol.format import commit_step, dcp_save_id, read_manifest, replica_rank_dir, requests_dir
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.inventory import InventoryScanner
from tierckpt_replicator.replication.ipc import FetchTask, Outcome, TaskResult
from tierckpt_replicator.restore.requests import FetchRequests, check_request

JOB = "job-a"


def _request(step: int = 5, ranks: tuple[int, ...] = (1,), rank: int = 0, job: str = JOB) -> FetchRequest:
    return FetchRequest(job, rank, uuid.uuid4().hex, step, ranks, time.time())


def _inventory(node: str, held: dict[int, tuple[int, ...]], world: dict[int, int], gcs=()) -> NodeInventory:
    ranks = {r: RankHoldings(local=s) for r, s in held.items()}
    return NodeInventory(JOB, node, "", 0.0, ranks, world_sizes=world, gcs=tuple(gcs))


# ------------------------------------------------------------------------------------- the message


@pytest.mark.parametrize(
    "change",
    [
        {"id": "not-hex"},
        {"id": "A" * 32},
        {"ranks": (1, 1)},
        {"ranks": (-1,)},
        {"step": -3},
        {"ranks": tuple(range(MAX_FETCH_RANKS + 1))},
        {"save_id": "a" * 65},
        {"save_id": "../../etc/passwd"},
        {"save_id": "ABCDEF12-3456"},
        {"save_id": "0123\n"},
        {"save_id": 7},
    ],
)
def test_a_malformed_request_does_not_decode(change: dict[str, object]) -> None:
    body = _request().to_dict() | change
    with pytest.raises(FormatError):
        FetchRequest.from_dict(body)


def test_a_request_names_the_save_it_reads_or_none() -> None:
    save = str(uuid.uuid4())
    named = dataclasses.replace(_request(), save_id=save)
    assert FetchRequest.from_bytes(named.to_bytes()).save_id == save
    older = _request().to_dict()
    del older["save_id"]  # a request of a client that names no save
    assert FetchRequest.from_dict(older).save_id == ""
    with pytest.raises(FormatError, match="save_id"):
        dataclasses.replace(_request(), save_id="x" * 64)


# ------------------------------------------------------------------------------------- admission


def test_only_a_known_step_and_existing_ranks_of_the_files_job_and_rank_are_admitted() -> None:
    invs = [_inventory("a", {0: (5,), 1: (5,)}, {5: 4}), _inventory("b", {2: (5,), 3: (5,)}, {5: 4})]
    assert check_request(_request(ranks=(2, 3)), job=JOB, rank=0, plan=None, inventories=invs) == 4
    refused = {
        "another job's request": (_request(job="job-b"), JOB, 0),
        "another rank's file": (_request(rank=1), JOB, 0),
        "a step nobody holds": (_request(step=6), JOB, 0),
        "a rank beyond the world": (_request(ranks=(4,)), JOB, 0),
    }
    for why, (req, job, rank) in refused.items():
        with pytest.raises(FormatError):
            check_request(req, job=job, rank=rank, plan=None, inventories=invs)
            pytest.fail(why)
    # world sizes that disagree make the step unusable
    odd = [*invs, _inventory("c", {4: (5,)}, {5: 8})]
    with pytest.raises(FormatError, match="world size"):
        check_request(_request(), job=JOB, rank=0, plan=None, inventories=odd)
    # the restore plan names a step that only the bucket holds
    plan = RestorePlan(JOB, 9, 4, {r: Tier.GCS for r in range(4)})
    assert check_request(_request(step=9, ranks=(3,)), job=JOB, rank=0, plan=plan, inventories=invs) == 4


# ------------------------------------------------------------------------------------- serving


def _requests(root: Path) -> FetchRequests:
    scanner = InventoryScanner(root, node="n0", endpoint="http://127.0.0.1:1")

    async def own(job: str) -> NodeInventory:
        return scanner.inventory(job)

    return FetchRequests(
        root=root,
        node="n0",
        assignments=AssignmentStore(root),
        supervisor=None,  # type: ignore[arg-type]  # nothing here needs a transfer
        peers=None,  # type: ignore[arg-type]
        own_inventory=own,
        plan_of=lambda job: None,
        heartbeat=0.05,
    )


async def _answer(requests: FetchRequests, root: Path, rank: int, request_id: str) -> FetchStatus:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        await requests.scan()
        status = read_fetch_status(root, JOB, rank)
        if (
            isinstance(status, FetchStatus)
            and status.id == request_id
            and status.state in (RestoreState.READY, RestoreState.FAILED)
        ):
            return status
        await asyncio.sleep(0.05)
    raise AssertionError(f"no final status for request {request_id}")


def _write(root: Path, request: FetchRequest, name: str | None = None) -> Path:
    path = requests_dir(root, JOB) / (name or fetch_request_name(request.rank))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(request.to_bytes())
    return path


async def test_steps_already_here_are_ready_and_unknown_ones_refused(tmp_path: Path) -> None:
    for rank in (0, 1):
        write_step(tmp_path, JOB, rank, 5, world_size=2, sizes=(1000,))
    write_step(tmp_path, JOB, 3, 5, world_size=4, sizes=(1000,))  # a step of another world size...
    requests = _requests(tmp_path)
    try:
        ok = _request(ranks=(0, 1))
        _write(tmp_path, ok)
        status = await _answer(requests, tmp_path, 0, ok.id)
        assert status.state is RestoreState.READY and status.sources == {0: Tier.LOCAL, 1: Tier.LOCAL}
        bad = _request(step=7, ranks=(1,), rank=1)
        _write(tmp_path, bad)
        status = await _answer(requests, tmp_path, 1, bad.id)
        assert status.state is RestoreState.FAILED and "refused" in status.message
        mixed = _request(ranks=(3,), rank=0)  # ...makes step 5's world size ambiguous: refused
        _write(tmp_path, mixed)
        status = await _answer(requests, tmp_path, 0, mixed.id)
        assert status.state is RestoreState.FAILED and "world size" in status.message
        assert not replica_rank_dir(tmp_path, JOB, 3).exists(), "nothing was fetched"
    finally:
        await requests.close()


async def test_planted_links_oversized_and_misnamed_files_are_ignored(tmp_path: Path) -> None:
    """A pod controls its job directory: nothing it plants there is followed or trusted."""
    write_step(tmp_path, JOB, 0, 5, world_size=1, sizes=(1000,))
    outside = tmp_path / "outside.json"
    outside.write_bytes(_request(ranks=(0,)).to_bytes())
    reqdir = requests_dir(tmp_path, JOB)
    reqdir.mkdir(parents=True)
    os.symlink(outside, reqdir / fetch_request_name(0))  # a link to a file elsewhere
    (reqdir / fetch_request_name(1)).write_bytes(b"{" * 2_000_000)  # oversized
    (reqdir / fetch_request_name(2)).write_bytes(b"not json")
    _write(tmp_path, _request(ranks=(0,), rank=3), name=fetch_request_name(4))  # rank 3's in rank 4's file
    requests = _requests(tmp_path)
    try:
        for _ in range(3):
            await requests.scan()
            await asyncio.sleep(0.05)
        for rank in range(5):
            assert read_fetch_status(tmp_path, JOB, rank) is None, rank
        # the same for a planted requests directory: a link to another job's tree
        other = tmp_path / "job-b" / "requests"
        other.mkdir(parents=True)
        (other / fetch_request_name(0)).write_bytes(_request(ranks=(0,)).to_bytes())
        for name in os.listdir(reqdir):
            (reqdir / name).unlink()
        reqdir.rmdir()
        os.symlink(other, reqdir)
        await requests.scan()
        await asyncio.sleep(0.1)
        assert read_fetch_status(tmp_path, JOB, 0) is None
    finally:
        await requests.close()


async def test_a_new_request_replaces_the_old_one_of_its_rank(tmp_path: Path) -> None:
    write_step(tmp_path, JOB, 0, 5, world_size=1, sizes=(1000,))
    requests = _requests(tmp_path)
    try:
        first = _request(ranks=(0,))
        _write(tmp_path, first)
        assert (await _answer(requests, tmp_path, 0, first.id)).state is RestoreState.READY
        second = dataclasses.replace(first, id=uuid.uuid4().hex)
        _write(tmp_path, second)
        assert (await _answer(requests, tmp_path, 0, second.id)).state is RestoreState.READY
    finally:
        await requests.close()


async def test_a_step_planted_through_a_link_is_not_taken_as_held(tmp_path: Path) -> None:
    """A pod links ``replicas/rank-00001`` to a committed step elsewhere: the request is not answered
    ``ready`` from it (the replicator reads no path through a link)."""
    write_step(tmp_path, JOB, 0, 5, world_size=2, sizes=(1000,))
    elsewhere = tmp_path / "elsewhere"
    write_step(elsewhere, JOB, 1, 5, world_size=2, sizes=(1000,))
    replicas = tmp_path / JOB / "replicas"
    replicas.mkdir()
    os.symlink(elsewhere / JOB / "rank-00001", replicas / "rank-00001")
    requests = _requests(tmp_path)
    try:
        req = _request(ranks=(1,))
        _write(tmp_path, req)
        status = await _answer(requests, tmp_path, 0, req.id)
        assert status.state is RestoreState.FAILED and status.sources == {}, status
    finally:
        await requests.close()


def test_ranks_that_did_not_exist_at_the_plans_step_learn_it_at_once(tmp_path: Path) -> None:
    """The job grew from 4 to 6 ranks: this node's ranks 4 and 5 have nothing to stage, but a DCP load
    reshards into them, so they get a ready status with the plan's step instead of waiting for one."""
    from types import SimpleNamespace

    from tierckpt.protocol.control import RestoreStatus
    from tierckpt_replicator.restore.stage import Stager

    nodes = {n: PeerNode(n, f"http://10.0.0.{i}:8470") for i, n in enumerate(("a", "b", "c"))}
    assignment = PeerAssignment(JOB, 3, nodes, {}, {"a": 0, "b": 1, "c": 2}, procs_per_node=2)
    stager = Stager(
        settings=SimpleNamespace(root=tmp_path, node_name="c", restore_fanout_wait=0.0),  # type: ignore[arg-type]
        assignments=None,  # type: ignore[arg-type]
        supervisor=None,  # type: ignore[arg-type]
        peers=None,  # type: ignore[arg-type]
        metrics=None,  # type: ignore[arg-type]
        own_inventory=None,  # type: ignore[arg-type]
    )
    plan = RestorePlan(JOB, 8, 4, {r: Tier.LOCAL for r in range(4)})
    stager._tell_new_ranks(JOB, plan, assignment, staged=())
    for rank in (4, 5):
        status = read_restore_status(tmp_path, JOB, rank)
        assert isinstance(status, RestoreStatus) and (status.state, status.step) == (RestoreState.READY, 8)
    fresh = dataclasses.replace(plan, step=None)
    stager._tell_new_ranks(JOB, fresh, assignment, staged=())
    status = read_restore_status(tmp_path, JOB, 4)
    assert isinstance(status, RestoreStatus) and status.state is RestoreState.NONE


# ------------------------------------------------------------------------------------- holders unknown


class _Peers:
    """The other node's control API: ``n1`` holds rank 1's step 5 (its primary, unless ``holds`` is
    cleared), and answers only while ``reachable`` (a partition: every ask fails as a connect timeout
    does)."""

    def __init__(self) -> None:
        self.reachable, self.holds = False, True
        self.asked = 0

    async def inventory(self, endpoint: str, job: str, *, node: str | None = None) -> NodeInventory:
        self.asked += 1
        if not self.reachable:
            raise RetryableError(f"replicator {endpoint}: GET inventory failed: ConnectTimeout")
        return _inventory("n1", {1: (5,)} if self.holds else {}, {5: 2})


class _Worker:
    """The replication worker's fetch: stages rank 1's step 5 as a replica, as a peer's copy would (a DCP
    step of save ``hands_over``, if set)."""

    def __init__(self, root: Path) -> None:
        self.root, self.tasks = root, 0
        self.hands_over = ""
        self.asked_for: list[str] = []

    def next_id(self) -> int:
        return self.tasks + 1

    async def run_task(self, task: FetchTask, progress: object) -> TaskResult:
        assert [s.node for s in task.sources] == ["n1"], task
        self.tasks += 1
        self.asked_for.append(task.save_id)
        replicas = replica_rank_dir(self.root, JOB, 1)
        if self.hands_over:
            _dcp_step(self.root, 1, self.hands_over, parent=replicas)
        else:
            write_step(self.root, JOB, 1, 5, world_size=2, sizes=(1000,), parent=replicas)
        return TaskResult(task.id, True, (Outcome("n1", "ok"),))


def _dcp_step(root: Path, rank: int, save_id: str, parent: Path | None = None) -> Path:
    """Rank ``rank``'s step 5 as DCP writes it for save ``save_id`` (its manifest names the save)."""
    path = write_step(root, JOB, rank, 5, world_size=2, sizes=(1000,), parent=parent)
    manifest = read_manifest(path)
    commit_step(path, dataclasses.replace(manifest, manifest_kind="dcp", extra={"dcp": {"save_id": save_id}}))
    return path


def _cut_off_peer(root: Path, attempts: int) -> tuple[FetchRequests, _Peers, _Worker]:
    """Node ``n0`` of a two-node job, holding rank 0's step 5; rank 1's is on ``n1``, cut off."""
    write_step(root, JOB, 0, 5, world_size=2, sizes=(1000,))
    nodes = {n: PeerNode(n, f"http://10.0.0.{i}:8470") for i, n in enumerate(("n0", "n1"))}
    peers_of = {"n0": ("n1",), "n1": ("n0",)}
    AssignmentStore(root).put(PeerAssignment(JOB, 1, nodes, peers_of, {"n0": 0, "n1": 1}))
    peers, worker = _Peers(), _Worker(root)
    scanner = InventoryScanner(root, node="n0", endpoint="http://127.0.0.1:1")

    async def own(job: str) -> NodeInventory:
        return scanner.inventory(job)

    plan = RestorePlan(JOB, 5, 2, {0: Tier.LOCAL, 1: Tier.PEER})
    served = FetchRequests(
        root=root,
        node="n0",
        assignments=AssignmentStore(root),
        supervisor=worker,  # type: ignore[arg-type]
        peers=peers,  # type: ignore[arg-type]
        own_inventory=own,
        plan_of=lambda job: plan,
        heartbeat=0.05,
        attempts=attempts,
        backoff=0.2,
    )
    return served, peers, worker


async def test_a_request_after_a_partition_ends_asks_the_nodes_again(tmp_path: Path) -> None:
    """Soak seed 1212452211, rounds 4 and 38: a DCP job grew while the holder of rank 1's step was cut
    off; the load failed ("no node holds it") until the partition ended, and once more after: the request
    made just after it ended was answered from the inventories gathered while the holder did not answer
    (cached for a second). A gather some node did not answer is not served again."""
    requests, peers, worker = _cut_off_peer(tmp_path, attempts=1)
    try:
        during = _request(ranks=(1,))
        _write(tmp_path, during)
        status = await _answer(requests, tmp_path, 0, during.id)
        assert status.state is RestoreState.FAILED, status
        peers.reachable = True  # the partition ends; the job restarts at once
        after = _request(ranks=(1,))
        _write(tmp_path, after)
        status = await _answer(requests, tmp_path, 0, after.id)
        assert status.state is RestoreState.READY and status.sources == {1: Tier.PEER}, status
        assert worker.tasks == 1
    finally:
        await requests.close()


async def test_a_fetch_asks_again_while_a_holder_does_not_answer(tmp_path: Path) -> None:
    """ "No node holds it" is a verdict only once every node answered: while the holder is cut off, the
    fetch makes its rounds, each gathering the inventories again, and fetches once the holder answers."""
    requests, peers, worker = _cut_off_peer(tmp_path, attempts=4)
    try:
        req = _request(ranks=(1,))
        _write(tmp_path, req)

        async def partition_ends() -> None:
            while peers.asked < 2:  # it asked, failed, and asked again
                await asyncio.sleep(0.01)
            peers.reachable = True

        ending = asyncio.create_task(partition_ends())
        status = await _answer(requests, tmp_path, 0, req.id)
        ending.cancel()
        assert status.state is RestoreState.READY and status.sources == {1: Tier.PEER}, status
        assert worker.tasks == 1 and peers.asked >= 3
    finally:
        await requests.close()


async def test_no_holder_among_every_node_fails_at_once(tmp_path: Path) -> None:
    """Every node answered and none holds the step, nor the bucket: the verdict is final, not retried."""
    requests, peers, worker = _cut_off_peer(tmp_path, attempts=4)
    peers.reachable, peers.holds = True, False
    try:
        req = _request(ranks=(1,))
        _write(tmp_path, req)
        started = time.monotonic()
        status = await _answer(requests, tmp_path, 0, req.id)
        assert status.state is RestoreState.FAILED and "no node holds it" in status.message, status
        assert "unknown" not in status.message and worker.tasks == 0
        assert time.monotonic() - started < 0.2 * (1 + 2 + 4), "no rounds were waited out"
    finally:
        await requests.close()


# ------------------------------------------------------------------------------------- another save


SAVE, OTHER = str(uuid.uuid4()), str(uuid.uuid4())


def _of_save(save_id: str) -> FetchRequest:
    return dataclasses.replace(_request(ranks=(1,)), save_id=save_id)


async def test_a_copy_here_of_another_save_is_replaced_by_the_saves(tmp_path: Path) -> None:
    """Issue 20: this node holds rank 1's step 5 only as a replica of another save of the step (the run
    the job left saved it); the checkpoint's save is on ``n1``. The request names the save: the copy
    here is not it (it answered "all here already"), so it is fetched, naming the save, in its place."""
    requests, peers, worker = _cut_off_peer(tmp_path, attempts=1)
    peers.reachable = True
    replica = _dcp_step(tmp_path, 1, OTHER, parent=replica_rank_dir(tmp_path, JOB, 1))
    worker.hands_over = SAVE
    try:
        req = _of_save(SAVE)
        _write(tmp_path, req)
        status = await _answer(requests, tmp_path, 0, req.id)
        assert status.state is RestoreState.READY and status.sources == {1: Tier.PEER}, status
        assert worker.asked_for == [SAVE] and dcp_save_id(read_manifest(replica)) == SAVE
        again = _of_save(SAVE)  # now it is here
        _write(tmp_path, again)
        status = await _answer(requests, tmp_path, 0, again.id)
        assert status.state is RestoreState.READY and status.sources == {1: Tier.LOCAL}, status
        assert worker.tasks == 1
    finally:
        await requests.close()


async def test_a_source_that_hands_over_another_save_fails_the_fetch_naming_it(tmp_path: Path) -> None:
    """The peer's copy is of another save too (and the bucket holds none): the fetch is not ready on it."""
    requests, peers, worker = _cut_off_peer(tmp_path, attempts=1)
    peers.reachable = True
    worker.hands_over = OTHER
    try:
        req = _of_save(SAVE)
        _write(tmp_path, req)
        status = await _answer(requests, tmp_path, 0, req.id)
        assert status.state is RestoreState.FAILED and f"not of save {SAVE}" in status.message, status
    finally:
        await requests.close()
