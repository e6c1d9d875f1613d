"""``corrupt``: a peer reports the replica of a step held here corrupt: verify it again, drop it if
it is."""

from __future__ import annotations

import contextlib
import logging

from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import discard_step, read_commit
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.handlers.envelope import Transfers
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status
from tierckpt_replicator.stepio import open_job, rank_tree, step_name, verify_step

__all__ = ["handle"]

log = logging.getLogger(__name__)


def handle(t: Transfers, conn: DataConnection, req: DataRequest) -> None:
    message = "no replica held"
    try:
        job = open_job(t.ctx.root, req.job)
    except FileNotFoundError:
        job = None
    with contextlib.ExitStack() as stack:
        if job is not None:
            stack.enter_context(job)
            message = _check_reported(t, job, req)
    t.event(req, Status.OK, message=message)
    t.reply(conn, DataReply(status=Status.OK, message=message))


def _check_reported(t: Transfers, job: Beneath, req: DataRequest) -> str:
    """Re-verify the replica a peer reported corrupt; drop it if it is. Returns what was found."""
    path = rank_tree(job, "replica", req.rank).at(step_name(req.step))
    message = "no replica held"
    try:
        committed = read_commit(path) is not None
    except FormatError as exc:  # an unreadable COMMIT, or a symlink planted as the step: dropped
        discard_step(path)
        return f"replica dropped: {exc}"
    if committed:
        problems = verify_step(path, limit=t.ctx.config.transfer.max_manifest_bytes)
        if problems:
            discard_step(path)
            message = f"replica dropped: {'; '.join(problems)}"
            log.warning(
                "%s rank %d step %d reported corrupt by %s: %s",
                req.job,
                req.rank,
                req.step,
                req.node or "?",
                message,
            )
        else:
            message = "replica verified intact"
    return message
