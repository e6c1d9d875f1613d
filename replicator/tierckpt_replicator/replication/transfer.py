"""The client side of the data protocol: push a local step to a peer, or stage a step from a source.

``push_step`` copies this node's primary of a step to one peer (``put``), holding a lease on the
primary while it reads it (checked before connecting, sent once connected), never while it connects.
``fetch_step`` stages a step as this node's primary from a local replica (a copy within the ramdisk) or
from a peer (``get``), or as a replica from a peer (another rank's step that a load on this node reads),
verifying every file's crc32c as it arrives; a corrupt copy is reported to its holder, which re-verifies
and drops it. Both return an ``Outcome`` and never raise for the failures a network, a peer or a
tampered job tree can cause: every file is read and written through the job's confined tree
(``stepio.open_job``), so a symlink a pod planted is refused ("failed", logged), never followed. A step
that declares more bytes than its job's quota is neither pushed (checked before connecting) nor staged
(checked before any byte is reserved): "too_large".
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

from tenacity import RetryCallState, Retrying, retry_if_exception_type, stop_after_attempt, wait_incrementing

from tierckpt.protocol import leases
from tierckpt.protocol.errors import (
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    RamdiskFullError,
    UnsafePathError,
)
from tierckpt.protocol.format import dcp_save_id, discard_step, read_commit
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.quota import OverQuotaError
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.context import DataContext, connect, unique_holder
from tierckpt_replicator.replication.ipc import FetchSource, Outcome, OutcomeStatus, PeerAddress, StepTask
from tierckpt_replicator.replication.stream import copy_file, receive_file, send_file
from tierckpt_replicator.replication.wire import (
    DataReply,
    DataRequest,
    ProtocolError,
    Status,
    recv_exact,
    recv_frame,
    send_frame,
)
from tierckpt_replicator.stepio import (
    Copy,
    StepHeader,
    StepWriter,
    is_data_file,
    open_files,
    open_job,
    parse_header,
    rank_tree,
    read_header,
    step_name,
)

__all__ = ["fetch_step", "outcome_status", "push_step", "report_corrupt", "retire_copy"]

log = logging.getLogger(__name__)

OnProgress = Callable[[int, int], None]

_STATUS_NAMES: dict[int, OutcomeStatus] = {
    Status.OK: "ok",
    Status.ALREADY: "already",
    Status.UNAUTHORIZED: "unauthorized",
    Status.FORBIDDEN: "unauthorized",
    Status.NOT_FOUND: "missing",
    Status.CONFLICT: "busy",
    Status.BUSY: "busy",
    Status.CORRUPT: "corrupt",
    Status.NO_SPACE: "full",
    Status.TOO_LARGE: "too_large",
}


def outcome_status(status: int) -> OutcomeStatus:
    return _STATUS_NAMES.get(status, "failed")


def log_outcome(logger: logging.Logger, what: str, task: StepTask, link: str, out: Outcome) -> None:
    """One line per transfer of a task (``link``: ``-> peer`` or ``<- source``): INFO when it delivered
    (``ok``, ``already``), WARNING otherwise."""
    level = logging.INFO if out.status in ("ok", "already") else logging.WARNING
    where = (task.job, task.rank, task.step)
    logger.log(level, "%s %s rank %d step %d %s: %s %s", what, *where, link, out.status, out.message)


def _read_header(ctx: DataContext, path: Beneath, job: str, rank: int, step: int) -> StepHeader:
    return read_header(path, job=job, rank=rank, step_no=step, limit=ctx.config.transfer.max_manifest_bytes)


# ------------------------------------------------------------------------------------ push


def push_step(
    ctx: DataContext, job: str, rank: int, step: int, peer: PeerAddress, *, base_rank: int = -1
) -> Outcome:
    """Copy this node's primary of ``job``/``rank``/``step`` to ``peer``. ``base_rank``: a replica
    group member whose identical step ``peer`` holds: it may link those data files (only the rest is
    sent)."""
    started = time.monotonic()
    try:
        tree = open_job(ctx.root, job)
    except FileNotFoundError:
        return Outcome(peer.node, "missing", "the job has no directory here")
    with tree:
        parent = rank_tree(tree, "primary", rank)
        return _push_from(ctx, parent, job, rank, step, peer, started, base_rank)


def _push_from(
    ctx: DataContext,
    parent: Beneath,
    job: str,
    rank: int,
    step: int,
    peer: PeerAddress,
    started: float,
    base_rank: int = -1,
) -> Outcome:
    """Check the primary (leased: committed, readable, within the quota; nothing connects for one that
    is not), connect with no lease held, then send it under a lease of its own. A peer that does not
    answer (a partition that drops its connections: the connect waits out ``--connect-timeout``) holds
    no lease on the primary, so training may save that step again meanwhile: a job that went back saves
    over the step of the run it left that this send started on (found by the chaos soak, seed
    1512564371, round 24: that save was skipped, the step leased by a send waiting on a partitioned
    peer, and the job was left with the step of the run it left, which no node sends)."""
    path = parent.at(step_name(step))
    try:
        with _primary(ctx, parent, path, job, rank, step):
            pass
        try:
            sock = connect(ctx, peer)
        except ssl.SSLError as exc:
            return Outcome(peer.node, "unauthorized", f"TLS with {peer.host}:{peer.port}: {exc}")
        except OSError as exc:
            return Outcome(peer.node, "unreachable", f"connect {peer.host}:{peer.port}: {exc}")
        with sock, _primary(ctx, parent, path, job, rank, step) as (header, fds):
            reply, nbytes, linked = _push(ctx, sock, header, path, fds, base_rank)
    except MissingCheckpointError:
        return Outcome(peer.node, "missing", "the primary is no longer committed")
    except _CannotLease as exc:  # writing the lease on this node's ramdisk (ENOSPC: it is full)
        return Outcome(peer.node, "local", f"cannot lease the primary here: {exc.__cause__}")
    except UnsafePathError as exc:
        log.warning("refusing to push %s rank %d step %d: %s", job, rank, step, exc)
        return Outcome(peer.node, "failed", f"refused: {exc}")
    except OverQuotaError as exc:
        return Outcome(peer.node, "too_large", f"not sent: {exc}")
    except FormatError as exc:
        return Outcome(peer.node, "failed", f"local primary unreadable: {exc}")
    except (OSError, ProtocolError) as exc:
        return Outcome(
            peer.node, "failed", f"transfer to {peer.node} broke: {exc}", seconds=time.monotonic() - started
        )
    status = outcome_status(reply.status)
    return Outcome(
        peer.node,
        status,
        reply.message,
        bytes=nbytes,
        seconds=time.monotonic() - started,
        saved=linked if status == "ok" else 0,
    )


class _CannotLease(Exception):
    """This node cannot write the lease (its ``__cause__``: the ``OSError``)."""


@contextlib.contextmanager
def _primary(
    ctx: DataContext, parent: Beneath, path: Beneath, job: str, rank: int, step: int
) -> Iterator[tuple[StepHeader, list[int]]]:
    """The primary leased, its header read, its files open (all of them, before anything goes out) and
    its quota checked, for the block."""
    try:
        lease = leases.hold(parent, step, unique_holder(ctx.config.holder))
    except OSError as exc:
        raise _CannotLease() from exc
    with lease:
        header = _read_header(ctx, path, job, rank, step)
        with open_files(path, header.manifest) as fds:
            ctx.quotas.check(header.manifest, fds=fds)
            yield header, fds


def step_request(
    ctx: DataContext, op: Literal["put", "fragment"], header: StepHeader, **extra: Any
) -> DataRequest:
    """The request that sends ``header``'s step (or a fragment of it) to a peer, from this node."""
    m = header.manifest
    return DataRequest(
        op=op,
        token=ctx.token(),
        job=m.job,
        rank=m.rank,
        step=m.step,
        node=ctx.config.node,
        commit_size=len(header.commit_bytes),
        manifest_size=len(header.manifest_bytes),
        **extra,
    )


def _push(
    ctx: DataContext, sock: DataConnection, header: StepHeader, path: Beneath, fds: list[int], base_rank: int
) -> tuple[DataReply, int, int]:
    """Send the step; (final reply, bytes sent, bytes the peer linked instead of receiving)."""
    req = step_request(ctx, "put", header, base_rank=base_rank)
    send_frame(sock, req, header.commit_bytes + header.manifest_bytes)
    reply = recv_frame(sock, DataReply)
    if reply.status != Status.CONTINUE:
        return reply, 0, 0
    sent = 0
    linked = 0

    def on_bytes(n: int) -> None:
        nonlocal sent
        sent += n

    for f, fd in zip(header.manifest.files, fds, strict=True):
        if reply.linked and is_data_file(f.name):
            linked += f.size
            continue
        send_file(
            sock,
            fd,
            f.size,
            where=f"{path.where}/{f.name}",
            bucket=ctx.bucket,
            on_bytes=on_bytes,
            method=ctx.config.transfer.send_method,
        )
    return recv_frame(sock, DataReply), sent, linked


# ------------------------------------------------------------------------------------ fetch


def fetch_step(
    ctx: DataContext,
    job: str,
    rank: int,
    step: int,
    source: FetchSource,
    on_progress: OnProgress,
    *,
    into: str = "primary",
    save_id: str = "",
) -> Outcome:
    """Stage ``job``/``rank``/``step`` on this node from ``source``: as its committed primary, or
    (``into="replica"``) as a committed replica, unless a committed copy is here already. With a
    ``save_id`` (a DCP save), only a copy whose manifest names it: one here of another save does not
    count, and a source's copy of another save is refused ("missing") before a byte of it is received."""
    started = time.monotonic()
    kinds: tuple[Copy, ...] = ("primary", "replica") if into == "replica" else ("primary",)
    try:
        with open_job(ctx.root, job, create=True) as tree:
            for kind in kinds:
                here = rank_tree(tree, kind, rank).at(step_name(step))
                if read_commit(here) is not None and _of_save(ctx, here, job, rank, step, save_id):
                    return Outcome(
                        source.node, "already", f"already committed here as a {kind} ({into} wanted)"
                    )
            if source.kind == "replica":
                if into == "replica":
                    raise _Refused("missing", "no committed local replica")
                nbytes = _copy_replica(ctx, tree, job, rank, step, on_progress)
            else:
                nbytes = _download(ctx, tree, job, rank, step, source, on_progress, into, save_id)
    except UnsafePathError as exc:
        log.warning("refusing to stage %s rank %d step %d: %s", job, rank, step, exc)
        return Outcome(source.node, "failed", f"refused: {exc}")
    except RamdiskFullError as exc:
        return Outcome(source.node, "full", str(exc))
    except OverQuotaError as exc:
        log.warning("refusing to stage %s rank %d step %d from %s: %s", job, rank, step, source.node, exc)
        return Outcome(source.node, "too_large", f"not staged: {exc}")
    except CorruptShardError as exc:
        log.warning(
            "%s rank %d step %d from %s (%s) is corrupt: %s", job, rank, step, source.node, source.kind, exc
        )
        if source.kind == "peer":
            report_corrupt(ctx, job, rank, step, source)
        return Outcome(source.node, "corrupt", str(exc))
    except _Refused as exc:
        return Outcome(source.node, exc.status, str(exc))
    except FormatError as exc:
        return Outcome(source.node, "corrupt", f"unreadable step header: {exc}")
    except (OSError, ProtocolError) as exc:
        return Outcome(source.node, "failed", f"fetch from {source.node} broke: {exc}")
    return Outcome(source.node, "ok", bytes=nbytes, seconds=time.monotonic() - started)


def _of_save(ctx: DataContext, step_tree: Beneath, job: str, rank: int, step: int, save_id: str) -> bool:
    """Whether the committed step ``step_tree`` is a copy of DCP save ``save_id`` (any copy without one)."""
    if not save_id:
        return True
    try:
        header = _read_header(ctx, step_tree, job, rank, step)
    except (OSError, FormatError, UnsafePathError):
        return False
    return dcp_save_id(header.manifest) == save_id


class _Refused(Exception):
    def __init__(self, status: OutcomeStatus, message: str) -> None:
        super().__init__(message)
        self.status = status


def _copy_replica(
    ctx: DataContext, tree: Beneath, job: str, rank: int, step: int, on_progress: OnProgress
) -> int:
    parent = rank_tree(tree, "replica", rank)
    src = parent.at(step_name(step))
    try:
        lease = leases.hold(parent, step, unique_holder(ctx.config.holder))
    except MissingCheckpointError as exc:
        raise _Refused("missing", "no committed local replica") from exc
    with lease:
        header = _read_header(ctx, src, job, rank, step)
        ctx.quotas.check(header.manifest)  # the replicas directory is the pod's to write, too
        total, done = header.manifest.total_bytes, 0
        try:
            with StepWriter(rank_tree(tree, "primary", rank), header) as writer:
                writer.prepare()
                for f in header.manifest.files:
                    writer.record(f.name, _copy_one(src, writer, f.name, f.size))
                    done += f.size
                    on_progress(done, total)
                writer.commit()
        except CorruptShardError:
            discard_step(src)  # our own replica is bad: drop it so nobody fetches it again
            raise
    return total


def _copy_one(src: Beneath, writer: StepWriter, name: str, size: int) -> int:
    """Copy file ``name`` of the step ``src`` into the writer's staging; returns its crc32c."""
    sfd = src.open_fd(name)
    try:
        dfd = writer.open(name)
        try:
            return copy_file(sfd, dfd, size, where=f"{src.where}/{name}")
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _download(
    ctx: DataContext,
    tree: Beneath,
    job: str,
    rank: int,
    step: int,
    source: FetchSource,
    on_progress: OnProgress,
    into: str,
    save_id: str = "",
) -> int:
    try:
        sock = connect(ctx, PeerAddress(source.node, source.host, source.port))
    except ssl.SSLError as exc:
        raise _Refused("unauthorized", f"TLS with {source.host}:{source.port}: {exc}") from exc
    except OSError as exc:
        raise _Refused("unreachable", f"connect {source.host}:{source.port}: {exc}") from exc
    with sock:
        send_frame(
            sock,
            DataRequest(op="get", token=ctx.token(), job=job, rank=rank, step=step, node=ctx.config.node),
        )
        reply = recv_frame(sock, DataReply)
        if reply.status != Status.OK:
            raise _Refused(outcome_status(reply.status), reply.message)
        limit = ctx.config.transfer.max_manifest_bytes
        if not (0 < reply.commit_size <= limit and 0 < reply.manifest_size <= limit):
            raise ProtocolError(f"header sizes {reply.commit_size}/{reply.manifest_size} out of bounds")
        header = parse_header(
            recv_exact(sock, reply.commit_size),
            recv_exact(sock, reply.manifest_size),
            job=job,
            rank=rank,
            step=step,
        )
        if save_id and dcp_save_id(header.manifest) != save_id:
            raise _Refused("missing", f"{source.node} holds another save of the step, not {save_id}")
        ctx.quotas.check(header.manifest)  # before a byte of it is reserved here
        total, done = header.manifest.total_bytes, 0

        def on_bytes(n: int) -> None:
            nonlocal done
            done += n
            on_progress(done, total)

        kind: Copy = "replica" if into == "replica" else "primary"
        with StepWriter(rank_tree(tree, kind, rank), header) as writer:
            writer.prepare()
            for f in header.manifest.files:
                fd = writer.open(f.name)
                try:
                    crc = receive_file(sock, fd, f.size, where=writer.where(f.name), on_bytes=on_bytes)
                finally:
                    os.close(fd)
                writer.record(f.name, crc)
            writer.commit()
    return total


def report_corrupt(
    ctx: DataContext, job: str, rank: int, step: int, source: FetchSource, tries: int = 3
) -> bool:
    """Tell the holder its copy failed verification (a few quick tries; True once it answered)."""
    peer = PeerAddress(source.node, source.host, source.port)
    req = DataRequest(op="corrupt", token=ctx.token(), job=job, rank=rank, step=step, node=ctx.config.node)

    def report() -> DataReply:
        with connect(ctx, peer) as sock:
            send_frame(sock, req)
            return recv_frame(sock, DataReply)

    def failed(attempt: RetryCallState) -> None:
        exc = attempt.outcome.exception() if attempt.outcome is not None else None
        log.warning(
            "could not report the corrupt copy to %s (try %d): %s", source.node, attempt.attempt_number, exc
        )

    attempts = Retrying(  # 0.2 s, 0.4 s, ... between tries
        stop=stop_after_attempt(tries),
        wait=wait_incrementing(start=0.2, increment=0.2),
        retry=retry_if_exception_type((OSError, ProtocolError)),
        after=failed,
        retry_error_callback=lambda _: None,  # every try failed
    )
    reply: DataReply | None = attempts(report)  # None: retry_error_callback, every try failed
    if reply is None:
        return False
    log.info("reported corrupt copy to %s: %s", source.node, reply.message)
    return True


def retire_copy(ctx: DataContext, job: str, rank: int, step: int, peer: PeerAddress) -> Outcome:
    """Ask ``peer`` to drop its replica of the step (a surplus copy): "ok" once it has none."""
    req = DataRequest(op="retire", token=ctx.token(), job=job, rank=rank, step=step, node=ctx.config.node)
    try:
        with connect(ctx, peer) as sock:
            send_frame(sock, req)
            reply = recv_frame(sock, DataReply)
    except (OSError, ProtocolError) as exc:
        return Outcome(peer.node, "unreachable", str(exc))
    return Outcome(peer.node, outcome_status(reply.status), reply.message)
