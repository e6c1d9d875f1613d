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
    RankHoldings,
    RestorePlan,
    RestoreState,
    Tier,
    fetch_request_name,
    read_fetch_status,
    read_restore_status,
)
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import replica_rank_dir, requests_dir
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.inventory import InventoryScanner
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
    ],
)
def test_a_malformed_request_does_not_decode(change: dict[str, object]) -> None:
    body = _request().to_dict() | change
    with pytest.raises(FormatError):
        FetchRequest.from_dict(body)


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

    from tierckpt.protocol.control import PeerAssignment, PeerNode, RestoreStatus
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
