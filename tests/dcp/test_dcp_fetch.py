"""The client side of a fetch request (``tierckpt.dcp.fetch``): ask, wait on progress, clean up."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tierckpt.dcp.fetch import fetch_rank_steps
from tierckpt.protocol.control import (
    FetchRequest,
    FetchStatus,
    RestoreState,
    Tier,
    fetch_request_name,
    write_fetch_status,
)
from tierckpt.protocol.errors import MissingCheckpointError
from tierckpt.protocol.format import job_dir, requests_dir

JOB = "fetch-job"


def _replicator(root: Path, final: RestoreState, *, beats: int = 3, message: str = "") -> threading.Thread:
    """Answers the one request it finds like the replicator: a few progress beats, then ``final``."""

    def serve() -> None:
        path = requests_dir(root, JOB) / fetch_request_name(2)
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        req = FetchRequest.from_bytes(path.read_bytes())
        assert (req.job, req.rank, req.step, req.ranks) == (JOB, 2, 7, (4, 5))
        for i in range(beats):
            status = FetchStatus(JOB, 2, req.id, 7, RestoreState.STAGING, i, beats, updated_at=time.time())
            write_fetch_status(job_dir(root, JOB), status)
            time.sleep(0.05)
        sources = {4: Tier.PEER, 5: Tier.GCS} if final is RestoreState.READY else {}
        done = FetchStatus(JOB, 2, req.id, 7, final, beats, beats, sources, time.time(), message)
        write_fetch_status(job_dir(root, JOB), done)

    t = threading.Thread(target=serve)
    t.start()
    return t


def test_a_fetch_waits_for_the_replicators_answer_and_removes_its_request(tmp_path: Path) -> None:
    stale = FetchStatus(JOB, 2, "0" * 32, 7, RestoreState.READY, updated_at=time.time())
    write_fetch_status(job_dir(tmp_path, JOB), stale)  # an old answer is not this request's
    t = _replicator(tmp_path, RestoreState.READY)
    status = fetch_rank_steps(tmp_path, JOB, 2, 7, [5, 4, 5], stall_timeout=5)
    t.join()
    assert status.state is RestoreState.READY and status.sources == {4: Tier.PEER, 5: Tier.GCS}
    assert not (requests_dir(tmp_path, JOB) / fetch_request_name(2)).exists()


def test_a_failed_fetch_raises_with_the_replicators_reason(tmp_path: Path) -> None:
    t = _replicator(tmp_path, RestoreState.FAILED, message="rank 4: no node holds it")
    with pytest.raises(MissingCheckpointError, match="rank 4: no node holds it"):
        fetch_rank_steps(tmp_path, JOB, 2, 7, [4, 5], stall_timeout=5)
    t.join()
    assert not (requests_dir(tmp_path, JOB) / fetch_request_name(2)).exists()


def test_without_a_replicator_the_wait_ends_once_nothing_moves(tmp_path: Path) -> None:
    now = [0.0]
    with pytest.raises(MissingCheckpointError, match="is a replicator running on this node"):
        fetch_rank_steps(
            tmp_path,
            JOB,
            2,
            7,
            [4],
            stall_timeout=30,
            clock=lambda: now[0],
            sleep=lambda s: now.__setitem__(0, now[0] + 10),
        )
    assert now[0] > 30
    assert not (requests_dir(tmp_path, JOB) / fetch_request_name(2)).exists()
