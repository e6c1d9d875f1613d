"""``put``: receive a replica of a rank's step.

Parse and cross-check COMMIT + manifest, within the job's quota (413), already held (208; another save
of the step number replaces an older one), in progress (409), room (507, after dropping what retention
allows), link the data files of an identical replica group member's step held here, then the receive
envelope (``Transfers.receive``) with crc32c on every file; retention after a commit.
"""

from __future__ import annotations

import logging
import os
import time

from tierckpt.protocol import leases
from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError, UnsafePathError
from tierckpt.protocol.format import discard_step, read_commit
from tierckpt.protocol.replica import content_key
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.context import unique_holder
from tierckpt_replicator.replication.handlers.envelope import Reject, Transfers
from tierckpt_replicator.replication.pacing import RateFloor
from tierckpt_replicator.replication.replicas import apply_retention
from tierckpt_replicator.replication.stream import receive_file
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, recv_exact
from tierckpt_replicator.stepio import (
    StepHeader,
    StepWriter,
    find_committed,
    open_job,
    parse_header,
    rank_tree,
    read_header,
    step_name,
)

__all__ = ["handle"]

log = logging.getLogger(__name__)


def handle(t: Transfers, conn: DataConnection, req: DataRequest) -> None:
    header = _read_header(t, conn, req)
    t.within_quota(req, header.manifest)
    with open_job(t.ctx.root, req.job, create=True) as job:
        parent = rank_tree(job, "replica", req.rank)
        if read_commit(parent.at(step_name(req.step))) is not None and _holds_this_save(
            t, req, parent, header
        ):
            t.reply(conn, DataReply(status=Status.ALREADY, message="replica already committed"))
            return
        total = header.manifest.total_bytes
        with t.claim((req.job, req.rank, req.step)):
            writer = StepWriter(parent, header)
            linked = _link_base(t, job, req, writer)
            need = total - linked + len(header.commit_bytes) + len(header.manifest_bytes)
            try:
                t.ensure_room(req.job, need)
            except Reject:
                writer.abort()
                raise
            started = time.monotonic()
            status, message = _receive_replica(t, conn, req, writer, linked > 0)
            if status == Status.OK:  # before the reply: once the sender hears "committed", retention ran
                apply_retention(t.ctx.root, req.job, t.ctx.config.transfer.replica_keep)
            t.reply(conn, DataReply(status=status, message=message, total_bytes=total))
    seconds = time.monotonic() - started
    log.info(
        "replica %s rank %d step %d from %s: %s (%d bytes received, %d linked, %.2fs)",
        req.job,
        req.rank,
        req.step,
        req.node or "?",
        message,
        total - linked,
        linked,
        seconds,
    )
    t.event(req, status, bytes=total - linked, seconds=seconds, message=message)


def _holds_this_save(t: Transfers, req: DataRequest, parent: Beneath, header: StepHeader) -> bool:
    """Whether the committed replica of ``req``'s step held here is the save being sent (its COMMIT,
    byte for byte). A step saved again (the job went back to an older step and trained on) is another
    save of that number: the earlier one is dropped here, and the caller receives the new one. 409
    if the one held is the newer save, or is being read (leased)."""
    held = parent.at(step_name(req.step))
    mine = read_header(
        held, job=req.job, rank=req.rank, step_no=req.step, limit=t.ctx.config.transfer.max_manifest_bytes
    )
    if mine.commit_bytes == header.commit_bytes:
        return True
    if mine.manifest.created_at >= header.manifest.created_at:
        raise Reject(Status.CONFLICT, f"this node holds a newer save of step {req.step}")
    with leases.lock(parent):
        if req.step in leases.leased_steps(parent):
            raise Reject(Status.CONFLICT, f"an earlier save of step {req.step} is being read here")
        discard_step(held)
    log.info(
        "replica %s rank %d step %d: dropped the earlier save of the step (%s saves it again)",
        req.job,
        req.rank,
        req.step,
        req.node or "its node",
    )
    return False


def _link_base(t: Transfers, job: Beneath, req: DataRequest, writer: StepWriter) -> int:
    """With ``req.base_rank``: link the data files of that replica group member's step held here
    when its content key equals the incoming manifest's (recomputed on both, never taken from a
    record) and neither save diverged. Returns the bytes linked (0: every file is to be received)."""
    if req.base_rank < 0:
        return 0
    mine = writer.header.manifest
    record = mine.replica
    found = None
    if record is None or not record.known or record.diverged or req.base_rank not in record.members:
        why = "the step's replica record does not allow it"
    elif req.base_rank == req.rank:
        why = "the base is the rank itself"
    else:
        found = find_committed(job, req.base_rank, req.step)
        why = f"no committed step of rank {req.base_rank} here"
    if found is not None and record is not None:
        base_rank, base = found
        try:
            with leases.hold(base_rank, req.step, unique_holder(t.ctx.config.holder)):
                theirs = read_header(
                    base,
                    job=req.job,
                    rank=req.base_rank,
                    step_no=req.step,
                    limit=t.ctx.config.transfer.max_manifest_bytes,
                ).manifest
                other = theirs.replica
                if other is None or other.group != record.group or other.diverged:
                    why = f"rank {req.base_rank}'s step is not an undiverged member of the group"
                elif content_key(theirs.files, theirs.tensors) != content_key(mine.files, mine.tensors):
                    why = f"rank {req.base_rank}'s step holds other content"
                else:
                    linked = writer.link_data(base, theirs)
                    log.info(
                        "replica %s rank %d step %d: %d data bytes linked from rank %d's identical step",
                        req.job,
                        req.rank,
                        req.step,
                        linked,
                        req.base_rank,
                    )
                    return linked
        except (MissingCheckpointError, FormatError, UnsafePathError, OSError) as exc:
            why = f"rank {req.base_rank}'s step could not be linked: {exc}"
    log.info("replica %s rank %d step %d: receiving every file (%s)", req.job, req.rank, req.step, why)
    return 0


def _read_header(t: Transfers, conn: DataConnection, req: DataRequest) -> StepHeader:
    limit = t.ctx.config.transfer.max_manifest_bytes
    for what, size in (("commit", req.commit_size), ("manifest", req.manifest_size)):
        if not 0 < size <= limit:
            raise Reject(Status.TOO_LARGE, f"{what} size {size} outside 1..{limit}")
    floor = t.floor()
    commit_bytes = recv_exact(conn, req.commit_size, progress=floor)
    manifest_bytes = recv_exact(conn, req.manifest_size, progress=floor)
    try:
        return parse_header(commit_bytes, manifest_bytes, job=req.job, rank=req.rank, step=req.step)
    except FormatError as exc:
        raise Reject(Status.BAD_REQUEST, f"bad step header: {exc}") from exc


def _receive_replica(
    t: Transfers, conn: DataConnection, req: DataRequest, writer: StepWriter, linked: bool = False
) -> tuple[int, str]:
    """Preallocate, say continue, receive and verify, commit. Returns (status, message)."""
    return t.receive(conn, req, writer, lambda: _receive_all(conn, writer, t.floor()), "committed", linked)


def _receive_all(conn: DataConnection, writer: StepWriter, floor: RateFloor) -> None:
    """Receive every file; a crc mismatch is raised only after the stream is drained (protocol in sync)."""
    bad: CorruptShardError | None = None
    for f in writer.pending():
        fd = writer.open(f.name)
        try:
            crc = receive_file(conn, fd, f.size, where=writer.where(f.name), pace=floor)
        finally:
            os.close(fd)
        try:
            writer.record(f.name, crc)
        except CorruptShardError as exc:
            bad = bad or exc
    if bad is not None:
        raise bad
