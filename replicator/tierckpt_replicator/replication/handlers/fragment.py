"""``fragment``: receive one erasure-coded fragment of a rank's step (a node holds at most one per
step), within the job's quota, through the receive envelope."""

from __future__ import annotations

import logging
import os
import time

from tierckpt.protocol.errors import FormatError
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.fragments import (
    FragmentHeader,
    FragmentWriter,
    find_fragment,
    fragment_tree,
    held_index,
    parse_fragment_header,
    retain,
)
from tierckpt_replicator.replication.handlers.envelope import Reject, Transfers
from tierckpt_replicator.replication.stream import receive_file
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, recv_exact
from tierckpt_replicator.stepio import open_job

__all__ = ["handle"]

log = logging.getLogger(__name__)


def handle(t: Transfers, conn: DataConnection, req: DataRequest) -> None:
    """Receive one erasure-coded fragment of a rank's step (this node holds at most one per step)."""
    header = _read_header(t, conn, req)
    t.within_quota(req, header.step.manifest, fragment=header.size)
    with open_job(t.ctx.root, req.job, create=True) as job:
        held = find_fragment(job, req.rank, req.step)
        if held is not None:
            index = held_index(held)
            if index == req.index:
                t.reply(conn, DataReply(status=Status.ALREADY, message="fragment held", index=req.index))
                return
            why = f"holds fragment {index} of this step, not {req.index}"
            t.reply(
                conn,
                DataReply(status=Status.CONFLICT, message=why, index=index if index is not None else -1),
            )
            return
        parent = fragment_tree(job, req.rank)
        total = header.size
        with t.claim((req.job, req.rank, req.step)):
            t.ensure_room(req.job, total + req.commit_size + req.manifest_size + req.erasure_size)
            started = time.monotonic()
            status, message = _receive_fragment(t, conn, req, FragmentWriter(parent, header))
            if status == Status.OK:
                retain(parent, t.ctx.config.transfer.replica_keep)
            t.reply(conn, DataReply(status=status, message=message, total_bytes=total, index=req.index))
    seconds = time.monotonic() - started
    log.info(
        "fragment %d of %s rank %d step %d from %s: %s (%d bytes, %.2fs)",
        req.index,
        req.job,
        req.rank,
        req.step,
        req.node or "?",
        message,
        total,
        seconds,
    )
    t.event(req, status, bytes=total, seconds=seconds, message=message)


def _read_header(t: Transfers, conn: DataConnection, req: DataRequest) -> FragmentHeader:
    limit = t.ctx.config.transfer.max_manifest_bytes
    sizes = (("commit", req.commit_size), ("manifest", req.manifest_size), ("erasure", req.erasure_size))
    for what, size in sizes:
        if not 0 < size <= limit:
            raise Reject(Status.TOO_LARGE, f"{what} size {size} outside 1..{limit}")
    floor = t.floor()
    parts = [recv_exact(conn, size, progress=floor) for _, size in sizes]
    try:
        return parse_fragment_header(*parts, job=req.job, rank=req.rank, step=req.step, index=req.index)
    except FormatError as exc:
        raise Reject(Status.BAD_REQUEST, f"bad fragment header: {exc}") from exc


def _receive_fragment(
    t: Transfers, conn: DataConnection, req: DataRequest, writer: FragmentWriter
) -> tuple[int, str]:
    def body() -> None:
        fd = writer.open()
        try:
            crc = receive_file(conn, fd, writer.header.size, where=writer.where, pace=t.floor())
        finally:
            os.close(fd)
        writer.record(crc)

    return t.receive(conn, req, writer, body, "fragment committed")
