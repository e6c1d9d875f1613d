"""Ask the node's replicator for other ranks' steps, and wait until they are on this node.

A DCP load under another sharding (or on a node that lost its copies) reads chunks that ranks of other
nodes wrote. Training pods cannot call the replicator's API, so the request is a file: this rank writes a
``control.FetchRequest`` into ``<job>/requests/fetch-rank-NNNNN.json`` naming the step, the ranks it
needs and the DCP save it reads (a copy here of another save of the step does not count); the replicator
(``tierckpt_replicator.restore.requests``) fetches each missing one once for the whole node, from a peer
or the bucket, and writes its progress as a ``control.FetchStatus`` into
``<job>/control/fetch-rank-NNNNN.json``. The client waits while that status moves, like a restore wait
(``snapshot.restore_wait``), and removes its request when it is answered.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from tierckpt.protocol.control import (
    FetchRequest,
    FetchStatus,
    RestoreState,
    fetch_request_name,
    read_fetch_status,
)
from tierckpt.protocol.errors import FormatError, MissingCheckpointError
from tierckpt.protocol.format import requests_dir, write_atomic

__all__ = ["fetch_rank_steps"]

log = logging.getLogger(__name__)


def fetch_rank_steps(
    root: Path,
    job: str,
    rank: int,
    step: int,
    ranks: Iterable[int],
    *,
    save_id: str = "",
    stall_timeout: float,
    poll: float = 0.1,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> FetchStatus:
    """Have ``step`` of every rank in ``ranks`` committed on this node; returns the replicator's answer.

    ``save_id``: the DCP save the load reads (its metadata's ``save_id``): a copy here of another save of
    the step does not count, the replicator fetches the save's (``""``: any committed copy).
    ``MissingCheckpointError`` when the replicator cannot fetch one of them, or its status does not move
    for ``stall_timeout`` seconds (no replicator watches this node, or it is stuck).
    """
    wanted = tuple(sorted(set(ranks)))
    request = FetchRequest(job, rank, uuid.uuid4().hex, step, wanted, time.time(), save_id)
    path = requests_dir(root, job) / fetch_request_name(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, request.to_bytes())
    log.info("rank %d: asked the replicator for step %d of ranks %s", rank, step, list(wanted))
    started = clock()
    try:
        last_seen, last_progress = None, started
        while True:
            try:
                status = read_fetch_status(root, job, rank)
            except FormatError:  # being replaced
                status = None
            if isinstance(status, FetchStatus) and status.id == request.id:
                if status.state is RestoreState.READY:
                    log.info(
                        "rank %d: step %d of ranks %s is on this node (%d bytes fetched in %.2f s)",
                        rank,
                        step,
                        list(wanted),
                        status.bytes_done,
                        clock() - started,
                    )
                    return status
                if status.state is RestoreState.FAILED:
                    raise MissingCheckpointError(
                        f"the replicator could not bring step {step} of ranks {list(wanted)} to this node: "
                        f"{status.message}"
                    )
                if status.updated_at != last_seen:
                    last_seen, last_progress = status.updated_at, clock()
            if clock() - last_progress > stall_timeout:
                raise MissingCheckpointError(
                    f"no progress for {stall_timeout:.0f} s on fetching step {step} of ranks {list(wanted)} "
                    f"(requested in {path}): is a replicator running on this node?"
                )
            sleep(poll)
    finally:
        path.unlink(missing_ok=True)
