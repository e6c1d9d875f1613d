"""The worker's side of erasure coding: encode a primary and send its fragments (``send_fragments``);
fetch fragments from their holders and rebuild a primary (``rebuild_step``).

Encoding reads the primary through the job's confined tree (leased, every byte checked against the
step's crc32c) and writes the ``k + m`` fragments into a scratch directory in the replicator's own
state directory (``format.state_dir``: no pod reaches it), removed once they are sent. Each fragment
goes to its own node (``fragment``; see ``data_server``), candidates in the manager's order; a node
that already holds a fragment of the step says which (``208``, or ``409`` naming another index). A
step that declares more bytes than its job's quota is not encoded, and no fragment of one is fetched.

Rebuilding fetches fragments (``getfrag``) into a scratch directory, each checked against its crc32c
as it arrives and against the first fragment's erasure manifest and COMMIT (all must describe the same
encoding of the same step), until ``k`` are at hand; then decodes them into a staged primary
(``stepio.StepWriter``) whose every file must match the step's own crc32c, and commits it with the
step's own manifest and COMMIT: byte for byte the step that was encoded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from tierckpt.protocol import leases
from tierckpt.protocol.errors import (
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    RamdiskFullError,
    UnsafePathError,
)
from tierckpt.protocol.format import STATE_DIR_NAME, read_commit, state_dir
from tierckpt_replicator.quota import OverQuotaError
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.context import DataContext, connect, unique_holder
from tierckpt_replicator.replication.erasure import decode_streams, encode_streams, fragment_name
from tierckpt_replicator.replication.fragments import FragmentHeader, parse_fragment_header
from tierckpt_replicator.replication.ipc import (
    ErasureTask,
    FetchSource,
    Outcome,
    PeerAddress,
    RebuildTask,
    TaskResult,
)
from tierckpt_replicator.replication.stream import receive_file, send_file
from tierckpt_replicator.replication.transfer import log_outcome, outcome_status, step_request
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
    StepHeader,
    StepWriter,
    open_files,
    open_job,
    preallocate,
    rank_tree,
    read_header,
    step_name,
)

__all__ = ["rebuild_step", "remove_scratch", "send_fragments"]

log = logging.getLogger(__name__)

OnProgress = Callable[[int, int], None]


_SCRATCH = ("encode-", "rebuild-")


def remove_scratch(root: Path) -> int:
    """Remove the scratch directories an earlier worker left in the jobs' state (it was killed)."""
    removed = 0
    for job in (root / STATE_DIR_NAME / "jobs").glob("*"):
        for entry in job.glob("*"):
            if entry.name.startswith(_SCRATCH) and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
    return removed


@contextlib.contextmanager
def _scratch(ctx: DataContext, job: str, what: str) -> Iterator[Path]:
    """A fresh directory in the replicator's own state of ``job``, removed afterwards."""
    path = state_dir(ctx.root, job) / f"{what}-{secrets.token_hex(4)}"  # what: one of _SCRATCH
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------ send


def send_fragments(ctx: DataContext, task: ErasureTask) -> TaskResult:
    """Encode the primary and send every fragment index not yet placed to a node holding none."""
    placed = dict(task.placed)
    total = task.k + task.m
    if set(placed.values()) >= set(range(total)):
        return TaskResult(id=task.id, ok=True)
    outcomes: list[Outcome] = []
    with _scratch(ctx, task.job, f"encode-{task.rank}-{task.step}") as scratch:
        try:
            header, erasure = _encode(ctx, task, scratch)
        except MissingCheckpointError as exc:
            return TaskResult(id=task.id, ok=False, outcomes=(Outcome("", "missing", str(exc)),))
        except OverQuotaError as exc:
            return TaskResult(
                id=task.id, ok=False, outcomes=(Outcome("", "too_large", f"not encoded: {exc}"),)
            )
        except (FormatError, UnsafePathError, CorruptShardError, OSError) as exc:
            log.warning("cannot encode %s rank %d step %d: %s", task.job, task.rank, task.step, exc)
            return TaskResult(id=task.id, ok=False, message=f"encoding failed: {exc}")
        free = [c for c in task.candidates if c.node not in placed]
        for index in range(total):
            while index not in placed.values() and free:
                peer = free.pop(0)
                out = push_fragment(ctx, peer, header, erasure, index, scratch / fragment_name(index))
                outcomes.append(out)
                log_outcome(log, f"fragment {index} of", task, f"-> {peer.node}", out)
                if out.status in ("ok", "already") and out.index >= 0:
                    placed[peer.node] = out.index
    ok = set(placed.values()) >= set(range(total))
    return TaskResult(id=task.id, ok=ok, outcomes=tuple(outcomes))


def _encode(ctx: DataContext, task: ErasureTask, scratch: Path) -> tuple[StepHeader, bytes]:
    """Encode the leased primary into ``scratch``; returns its header and its erasure manifest's bytes."""
    with open_job(ctx.root, task.job) as tree:
        parent = rank_tree(tree, "primary", task.rank)
        path = parent.at(step_name(task.step))
        with leases.hold(parent, task.step, unique_holder(ctx.config.holder)):
            header = read_header(
                path,
                job=task.job,
                rank=task.rank,
                step_no=task.step,
                limit=ctx.config.transfer.max_manifest_bytes,
            )
            with open_files(path, header.manifest) as fds, contextlib.ExitStack() as stack:
                ctx.quotas.check(header.manifest, fds=fds)  # encoding writes k + m fragments of it
                sources: list[BinaryIO] = [
                    stack.enter_context(open(fd, "rb", buffering=0, closefd=False)) for fd in fds
                ]
                sinks: list[BinaryIO] = [
                    stack.enter_context(open(scratch / fragment_name(i), "xb", buffering=0))
                    for i in range(task.k + task.m)
                ]
                em = encode_streams(
                    sources,
                    header.manifest.files,
                    sinks,
                    job=task.job,
                    rank=task.rank,
                    step=task.step,
                    k=task.k,
                    m=task.m,
                    where=path.where,
                )
    return header, em.to_bytes()


def push_fragment(
    ctx: DataContext, peer: PeerAddress, header: StepHeader, erasure: bytes, index: int, path: Path
) -> Outcome:
    """Send fragment ``index`` (the file at ``path``) of the step to ``peer``."""
    started = time.monotonic()
    req = step_request(ctx, "fragment", header, index=index, erasure_size=len(erasure))
    try:
        sock = connect(ctx, peer)
    except ssl.SSLError as exc:
        return Outcome(peer.node, "unauthorized", f"TLS with {peer.host}:{peer.port}: {exc}", index=index)
    except OSError as exc:
        return Outcome(peer.node, "unreachable", f"connect {peer.host}:{peer.port}: {exc}", index=index)
    except ProtocolError as exc:  # the peer refused a sealed channel
        return Outcome(peer.node, "failed", f"connect {peer.host}:{peer.port}: {exc}", index=index)
    try:
        with sock, open(path, "rb", buffering=0) as f:
            send_frame(sock, req, header.commit_bytes + header.manifest_bytes + erasure)
            reply = recv_frame(sock, DataReply)
            if reply.status in (Status.ALREADY, Status.CONFLICT) and reply.index >= 0:
                return Outcome(peer.node, "already", reply.message, index=reply.index)
            if reply.status != Status.CONTINUE:
                return Outcome(peer.node, outcome_status(reply.status), reply.message, index=index)
            size = os.fstat(f.fileno()).st_size
            send_file(
                sock,
                f.fileno(),
                size,
                where=str(path),
                bucket=ctx.bucket,
                method=ctx.config.transfer.send_method,
            )
            reply = recv_frame(sock, DataReply)
    except (OSError, ProtocolError) as exc:
        return Outcome(peer.node, "failed", f"fragment to {peer.node} broke: {exc}", index=index)
    seconds = time.monotonic() - started
    return Outcome(
        peer.node, outcome_status(reply.status), reply.message, bytes=size, seconds=seconds, index=index
    )


# ------------------------------------------------------------------------------------ rebuild


def rebuild_step(ctx: DataContext, task: RebuildTask, progress: OnProgress) -> TaskResult:
    """Fetch ``k`` fragments from the sources (in order) and commit the rebuilt step as the primary."""
    started = time.monotonic()
    outcomes: list[Outcome] = []
    try:
        with open_job(ctx.root, task.job, create=True) as tree:
            if read_commit(rank_tree(tree, "primary", task.rank).at(step_name(task.step))) is not None:
                return TaskResult(id=task.id, ok=True, outcomes=(Outcome(ctx.config.node, "already"),))
        with _scratch(ctx, task.job, f"rebuild-{task.rank}-{task.step}") as scratch:
            got: dict[int, Path] = {}
            first: FragmentHeader | None = None
            for source in task.sources:
                if first is not None and len(got) >= first.erasure.layout.k:
                    break
                out, header = _fetch_fragment(ctx, task, source, scratch, first, got, progress)
                outcomes.append(out)
                if header is not None:
                    first = first or header
                    got[header.index] = scratch / fragment_name(header.index)
            if first is None or len(got) < first.erasure.layout.k:
                need = first.erasure.layout.k if first is not None else "k"
                message = f"{len(got)} intact fragments at hand, {need} needed"
                return TaskResult(id=task.id, ok=False, outcomes=tuple(outcomes), message=message)
            total = _decode(ctx, task, first, got)
    except RamdiskFullError as exc:
        return TaskResult(
            id=task.id, ok=False, outcomes=(*outcomes, Outcome(ctx.config.node, "full", str(exc)))
        )
    except (CorruptShardError, FormatError, UnsafePathError, OSError) as exc:
        log.warning("rebuilding %s rank %d step %d failed: %s", task.job, task.rank, task.step, exc)
        outcomes.append(Outcome(ctx.config.node, "corrupt", f"rebuild failed: {exc}"))
        return TaskResult(id=task.id, ok=False, outcomes=tuple(outcomes))
    log.info(
        "rebuilt %s rank %d step %d from fragments %s (%d bytes, %.2fs)",
        task.job,
        task.rank,
        task.step,
        sorted(got),
        total,
        time.monotonic() - started,
    )
    done = Outcome(ctx.config.node, "ok", bytes=total, seconds=time.monotonic() - started)
    return TaskResult(id=task.id, ok=True, outcomes=(*outcomes, done))


def _fetch_fragment(
    ctx: DataContext,
    task: RebuildTask,
    source: FetchSource,
    scratch: Path,
    first: FragmentHeader | None,
    got: dict[int, Path],
    progress: OnProgress,
) -> tuple[Outcome, FragmentHeader | None]:
    """One fragment from ``source`` into ``scratch``, crc32c-checked; (outcome, its header if kept)."""
    started = time.monotonic()
    try:
        sock = connect(ctx, PeerAddress(source.node, source.host, source.port))
    except ssl.SSLError as exc:
        return Outcome(source.node, "unauthorized", f"TLS with {source.host}:{source.port}: {exc}"), None
    except OSError as exc:
        return Outcome(source.node, "unreachable", f"connect {source.host}:{source.port}: {exc}"), None
    except ProtocolError as exc:  # the peer refused a sealed channel
        return Outcome(source.node, "failed", f"connect {source.host}:{source.port}: {exc}"), None
    try:
        with sock:
            return _receive_fragment(ctx, task, sock, source, scratch, first, got, progress, started)
    except CorruptShardError as exc:
        return Outcome(source.node, "corrupt", str(exc)), None
    except OverQuotaError as exc:
        return Outcome(source.node, "too_large", f"not fetched: {exc}"), None
    except FormatError as exc:
        return Outcome(source.node, "corrupt", f"bad fragment header: {exc}"), None
    except (OSError, ProtocolError) as exc:
        return Outcome(source.node, "failed", f"fragment from {source.node} broke: {exc}"), None


def _receive_fragment(
    ctx: DataContext,
    task: RebuildTask,
    sock: DataConnection,
    source: FetchSource,
    scratch: Path,
    first: FragmentHeader | None,
    got: dict[int, Path],
    progress: OnProgress,
    started: float,
) -> tuple[Outcome, FragmentHeader | None]:
    req = DataRequest(
        op="getfrag", token=ctx.token(), job=task.job, rank=task.rank, step=task.step, node=ctx.config.node
    )
    send_frame(sock, req)
    reply = recv_frame(sock, DataReply)
    if reply.status != Status.OK:
        return Outcome(source.node, outcome_status(reply.status), reply.message), None
    limit = ctx.config.transfer.max_manifest_bytes
    sizes = (reply.commit_size, reply.manifest_size, reply.erasure_size)
    if not all(0 < n <= limit for n in sizes):
        raise ProtocolError(f"fragment header sizes {sizes} out of bounds")
    parts = [recv_exact(sock, n) for n in sizes]
    header = parse_fragment_header(*parts, job=task.job, rank=task.rank, step=task.step, index=reply.index)
    if reply.total_bytes != header.size:
        raise ProtocolError(f"fragment of {reply.total_bytes} bytes, its manifest says {header.size}")
    ctx.quotas.check(header.step.manifest)  # before a byte of the fragment, or the step, is reserved
    if header.size > ctx.quotas.of(task.job):
        raise ProtocolError(f"a fragment of {header.size} bytes is over the job's quota")
    if first is not None and (
        header.erasure_bytes != first.erasure_bytes or header.step.commit_bytes != first.step.commit_bytes
    ):
        return Outcome(
            source.node, "corrupt", "a fragment of another encoding of the step", index=header.index
        ), None
    if header.index in got:
        return Outcome(source.node, "already", "a fragment already at hand", index=header.index), None
    path = scratch / fragment_name(header.index)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    need = header.size * header.erasure.layout.k
    done = len(got) * header.size

    def on_bytes(n: int) -> None:
        nonlocal done
        done += n
        progress(done, need)

    try:
        preallocate(fd, header.size, str(path))
        crc = receive_file(sock, fd, header.size, where=str(path), on_bytes=on_bytes)
    finally:
        os.close(fd)
    if crc != header.crc32c:
        raise CorruptShardError(
            f"fragment {header.index} from {source.node}: crc32c {crc:08x}, "
            f"its manifest says {header.crc32c:08x}",
            path=str(path),
        )
    seconds = time.monotonic() - started
    return Outcome(source.node, "ok", bytes=header.size, seconds=seconds, index=header.index), header


def _decode(ctx: DataContext, task: RebuildTask, first: FragmentHeader, got: dict[int, Path]) -> int:
    """Decode the fragments into a staged primary and commit it; returns the step's bytes."""
    step = first.step
    with (
        open_job(ctx.root, task.job, create=True) as tree,
        StepWriter(rank_tree(tree, "primary", task.rank), step) as writer,
    ):
        writer.prepare()
        with contextlib.ExitStack() as stack:
            sources: dict[int, BinaryIO] = {
                i: stack.enter_context(open(p, "rb", buffering=0)) for i, p in sorted(got.items())
            }
            sinks: list[BinaryIO] = [
                stack.enter_context(open(writer.open(f.name), "wb", buffering=0)) for f in step.manifest.files
            ]
            crcs = decode_streams(first.erasure, sources, sinks)
            for sink in sinks:
                os.fsync(sink.fileno())
        for name, crc in crcs.items():
            writer.record(name, crc)
        writer.commit()
    return step.manifest.total_bytes
