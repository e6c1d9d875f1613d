"""``get``: serve a committed step (primary or replica) to a restoring node, leased while it is read,
within the job's quota; every file is opened before a byte goes out."""

from __future__ import annotations

import logging
import time

from tierckpt.protocol import leases
from tierckpt.protocol.errors import FormatError, MissingCheckpointError
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.quota import OverQuotaError
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.context import unique_holder
from tierckpt_replicator.replication.handlers.envelope import Reject, Transfers
from tierckpt_replicator.replication.stream import send_file
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, send_frame
from tierckpt_replicator.stepio import find_committed, open_files, open_job, read_header

__all__ = ["handle", "send_step"]

log = logging.getLogger(__name__)


def handle(t: Transfers, conn: DataConnection, req: DataRequest) -> None:
    missing = Reject(Status.NOT_FOUND, f"no committed copy of {req.job} rank {req.rank} step {req.step}")
    try:
        job = open_job(t.ctx.root, req.job)
    except FileNotFoundError:
        raise missing from None
    with job:
        found = find_committed(job, req.rank, req.step)
        if found is None:
            raise missing
        rank, path = found
        send_step(t, conn, req, rank, path)


def send_step(t: Transfers, conn: DataConnection, req: DataRequest, rank: Beneath, path: Beneath) -> None:
    started = time.monotonic()
    try:
        lease = leases.hold(rank, req.step, unique_holder(t.ctx.config.holder))
    except MissingCheckpointError as exc:
        raise Reject(Status.NOT_FOUND, "the step was deleted meanwhile") from exc
    with lease:
        try:
            header = read_header(
                path,
                job=req.job,
                rank=req.rank,
                step_no=req.step,
                limit=t.ctx.config.transfer.max_manifest_bytes,
            )
        except FormatError as exc:
            raise Reject(Status.CORRUPT, f"local copy unreadable: {exc}") from exc
        with open_files(path, header.manifest) as fds:  # all of them, before a byte goes out
            try:
                t.ctx.quotas.check(header.manifest, fds=fds)
            except OverQuotaError as exc:
                log.warning("not serving a step to %s: %s", req.node or "?", exc)
                raise Reject(Status.TOO_LARGE, f"not served: {exc}") from exc
            reply = DataReply(
                status=Status.OK,
                commit_size=len(header.commit_bytes),
                manifest_size=len(header.manifest_bytes),
                total_bytes=header.manifest.total_bytes,
            )
            send_frame(conn, reply, header.commit_bytes + header.manifest_bytes)
            for f, fd in zip(header.manifest.files, fds, strict=True):
                where = f"{path.where}/{f.name}"
                send_file(conn, fd, f.size, where=where, method=t.ctx.config.transfer.send_method)
    seconds = time.monotonic() - started
    log.info(
        "served %s rank %d step %d to %s (%d bytes, %.2fs)",
        req.job,
        req.rank,
        req.step,
        req.node or "?",
        header.manifest.total_bytes,
        seconds,
    )
    t.event(req, Status.OK, bytes=header.manifest.total_bytes, seconds=seconds)
