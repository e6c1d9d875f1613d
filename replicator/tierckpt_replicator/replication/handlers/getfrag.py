"""``getfrag``: serve this node's fragment of a rank's step (its headers, then its bytes)."""

from __future__ import annotations

import logging
import os
import time

from tierckpt.protocol.errors import FormatError
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.erasure import fragment_name
from tierckpt_replicator.replication.fragments import find_fragment, read_fragment_header
from tierckpt_replicator.replication.handlers.envelope import Reject, Transfers
from tierckpt_replicator.replication.stream import send_file
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, send_frame
from tierckpt_replicator.stepio import open_job

__all__ = ["handle"]

log = logging.getLogger(__name__)


def handle(t: Transfers, conn: DataConnection, req: DataRequest) -> None:
    """Serve this node's fragment of a rank's step: its headers, then its bytes."""
    missing = Reject(Status.NOT_FOUND, f"no fragment of {req.job} rank {req.rank} step {req.step}")
    started = time.monotonic()
    try:
        job = open_job(t.ctx.root, req.job)
    except FileNotFoundError:
        raise missing from None
    with job:
        path = find_fragment(job, req.rank, req.step)
        if path is None:
            raise missing
        limit = t.ctx.config.transfer.max_manifest_bytes
        try:
            header = read_fragment_header(path, job=req.job, rank=req.rank, step_no=req.step, limit=limit)
        except FormatError as exc:
            raise Reject(Status.CORRUPT, f"local fragment unreadable: {exc}") from exc
        fd = path.open_fd(fragment_name(header.index))
        try:
            step = header.step
            reply = DataReply(
                status=Status.OK,
                index=header.index,
                commit_size=len(step.commit_bytes),
                manifest_size=len(step.manifest_bytes),
                erasure_size=len(header.erasure_bytes),
                total_bytes=header.size,
            )
            send_frame(conn, reply, step.commit_bytes + step.manifest_bytes + header.erasure_bytes)
            where = f"{path.where}/{fragment_name(header.index)}"
            send_file(conn, fd, header.size, where=where, method=t.ctx.config.transfer.send_method)
        finally:
            os.close(fd)
    seconds = time.monotonic() - started
    log.info(
        "served fragment %d of %s rank %d step %d to %s",
        header.index,
        req.job,
        req.rank,
        req.step,
        req.node,
    )
    t.event(req, Status.OK, bytes=header.size, seconds=seconds)
