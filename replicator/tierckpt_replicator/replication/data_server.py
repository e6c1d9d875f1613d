"""The data endpoint: receives replicas (``put``), serves steps to restoring nodes (``get``), and hears
corruption reports (``corrupt``) and surplus notices (``retire``), and holds erasure-coded fragments
(``fragment`` in, ``getfrag`` out; see ``fragments``). Blocking sockets, one thread per connection,
at most ``max_incoming`` transfers at once; everything else is refused as busy (503) before any data
moves.

Bounded before authentication: a connection is admitted only within the per-source and total
connection limits (``ConnectionLimits``); its handshake (the TLS handshake, then the request frame) must be
complete within ONE deadline (``handshake_timeout``), else it is closed; the request is authorized, and
only THEN is a transfer slot taken. So idle or trickling connections hold no slot, and every source has
at most its share of connections. During a transfer the sender must keep up ``min_transfer_rate`` over
every ``transfer_timeout`` window (``pacing.RateFloor``), not merely send a byte before each timeout.

Auth (``--auth tls``): the TLS handshake requires a client certificate of the tierckpt CA; the request
must name the node that certificate names, and that node must be a member of the job here
(``tierckpt_replicator.access.data_refusal``), else 403 before anything is read or written. Legacy
``--auth token``: the request's shared token.

Put: auth → parse and cross-check COMMIT + manifest → within the job's quota? (413; a pod's sparse
files or a manifest's declared sizes would otherwise cost this node what they never cost the sender's
ramdisk) → already held? (208) → in progress? (409) → room? (507, after dropping what retention
allows) → preallocate every file (507 on ENOSPC) → ``100 continue`` → receive with crc32c → all match?
commit atomically (200) : drop the staging dir (422). A fragment is checked against the quota alike;
a step served to a restoring node (``get``) too. Quota refusals are reported as ``DataEvent`` 413.

Every file is reached through the job's confined tree (``stepio.open_job``): a symlink a pod planted in
its job directory (a rank, a step, a data file) is refused (422, logged), never followed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

from tierckpt.protocol import leases
from tierckpt.protocol.control import StepOverQuota
from tierckpt.protocol.errors import (
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    RamdiskFullError,
    UnsafePathError,
)
from tierckpt.protocol.format import (
    Manifest,
    check_job_id,
    committed_steps,
    discard_step,
    read_commit,
    read_manifest,
)
from tierckpt.protocol.identity import Peer
from tierckpt.protocol.replica import content_key
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.access import data_refusal
from tierckpt_replicator.connlimits import Admission, ConnectionLimits, close_now
from tierckpt_replicator.quota import OverQuotaError
from tierckpt_replicator.replication.channel import DataConnection, SealedChannel, accept_channel, is_hello
from tierckpt_replicator.replication.context import DataContext, secure, unique_holder
from tierckpt_replicator.replication.erasure import fragment_name
from tierckpt_replicator.replication.fragments import (
    FragmentHeader,
    FragmentWriter,
    find_fragment,
    fragment_tree,
    held_index,
    parse_fragment_header,
    read_fragment_header,
    retain,
)
from tierckpt_replicator.replication.ipc import DataEvent
from tierckpt_replicator.replication.pacing import Deadline, RateFloor
from tierckpt_replicator.replication.replicas import (
    apply_retention,
    client_headroom,
    free_bytes,
    make_room,
    pinned_steps,
)
from tierckpt_replicator.replication.stream import receive_file, send_file
from tierckpt_replicator.replication.wire import (
    DataReply,
    DataRequest,
    ProtocolError,
    Status,
    decode_frame,
    recv_body,
    recv_exact,
    send_frame,
)
from tierckpt_replicator.stepio import (
    StepHeader,
    StepWriter,
    find_committed,
    open_files,
    open_job,
    parse_header,
    rank_tree,
    read_header,
    step_name,
    verify_step,
)

__all__ = ["DataServer"]

log = logging.getLogger(__name__)

_MAX_INDEX = 1 << 62
_LINGER_SECONDS = 1.0
_LINGER_BYTES = 4 << 20


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class DataServer:
    """``start()`` binds and serves on a background thread; ``stop()`` closes the listener."""

    def __init__(self, ctx: DataContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self._slots = threading.BoundedSemaphore(cfg.max_incoming)
        self.connections = ConnectionLimits(
            "data endpoint",
            total=4 * cfg.max_incoming + 8,
            per_source=cfg.connections_per_source,
            deadline=cfg.handshake_timeout,
        )
        self._claims: set[tuple[str, int, int]] = set()
        self._claims_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()

    @property
    def port(self) -> int:
        assert self._listener is not None
        return cast(int, self._listener.getsockname()[1])  # (host, port) of an inet socket

    def start(self) -> None:
        cfg = self.ctx.config
        family = socket.AF_INET6 if ":" in cfg.listen_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((cfg.listen_host, cfg.data_port))
        sock.listen(128)
        self._listener = sock
        threading.Thread(target=self._accept_loop, name="data-accept", daemon=True).start()
        log.info("data endpoint listening on %s:%d", cfg.listen_host, self.port)

    def stop(self) -> None:
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                time.sleep(0.05)
                continue
            try:
                shed = _Shed(conn)
            except OSError as exc:  # out of descriptors: refused, like a connection past the limits
                log.warning("data %s: refused: %s", addr[0], exc)
                close_now(conn)
                continue
            admission = self.connections.admit(addr[0], shed)  # idle or hostile connections: bounded
            if admission is None:
                shed.close()
                close_now(conn)
                continue
            threading.Thread(
                target=self._serve_admitted, args=(conn, addr, admission, shed), name="data-conn", daemon=True
            ).start()

    def _serve_admitted(
        self, conn: socket.socket, addr: tuple[str, int], admission: Admission, shed: _Shed
    ) -> None:
        try:
            self._serve(conn, addr, admission)
        finally:
            shed.close()
            admission.release()

    # ------------------------------------------------------------------ one connection

    def _serve(self, sock: socket.socket, addr: tuple[str, int], admission: Admission) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn: DataConnection = sock
        slot = False
        try:
            # The handshake, all of it under one deadline (shorter while the port is crowded): TLS
            # (``--auth tls``; the peer's identity), the sealed channel if the peer asks for one, then
            # the request frame. ``conn`` is the TLS socket, then the channel, from the moment each is
            # up, so an error reply goes through what the peer expects (found by
            # tests/replicator/test_fuzz.py: a reply went out in clear text, which the peer's TLS layer
            # can only take as a broken connection).
            deadline = Deadline(admission.deadline, "the request")
            try:
                tls, peer = secure(self.ctx, sock, deadline)
                conn = tls
                if peer is not None:  # a certificate of the CA: never shed for a newcomer from now on
                    admission.authenticated()
                body = recv_body(conn, deadline=deadline)
                hello = is_hello(body)
                if hello is not None:
                    conn = accept_channel(tls, hello, deadline)
                    body = recv_body(conn, deadline=deadline)
                req = decode_frame(DataRequest, body)
            except (OSError, ProtocolError) as exc:
                if not admission.was_shed:
                    raise
                log.debug("data %s: closed to make room for a newcomer: %s", addr[0], exc)
                return
            self._authorize(req, peer)
            admission.authenticated()  # --auth token: the token checked
            slot = self._slots.acquire(blocking=False)
            if not slot:
                raise _Reject(Status.BUSY, f"already serving {self.ctx.config.max_incoming} transfers")
            conn.settimeout(self.ctx.config.transfer_timeout)  # a silent peer: caught within a window
            if isinstance(conn, SealedChannel):
                conn.allow_bulk()
            handlers = {
                "put": self._put,
                "get": self._get,
                "corrupt": self._corrupt,
                "retire": self._retire,
                "fragment": self._fragment,
                "getfrag": self._get_fragment,
            }
            handler = handlers[req.op]
            handler(conn, req)
        except _Reject as exc:
            log.info("data %s: refused (%d): %s", addr[0], exc.status, exc)
            self._reply(conn, DataReply(status=exc.status, message=str(exc)))
        except ProtocolError as exc:
            log.warning("data %s: %s", addr[0], exc)
            self._reply(conn, DataReply(status=exc.status or Status.BAD_REQUEST, message=str(exc)))
        except UnsafePathError as exc:  # something a pod planted in its job tree: refused, not followed
            log.warning("data %s: refused: %s", addr[0], exc)
            self._reply(conn, DataReply(status=Status.CORRUPT, message=f"refused: {exc}"))
        except FormatError as exc:
            log.warning("data %s: unreadable local copy: %s", addr[0], exc)
            self._reply(conn, DataReply(status=Status.CORRUPT, message=f"unreadable local copy: {exc}"))
        except TimeoutError as exc:
            log.warning("data %s: closed: %s", addr[0], exc)
        except OSError as exc:
            log.warning("data %s: connection failed: %s", addr[0], exc)
        except Exception:  # a bug must not kill the server thread silently
            log.exception("data %s: unexpected error", addr[0])
        finally:
            if slot:
                self._slots.release()
            _close_gently(conn)

    def _authorize(self, req: DataRequest, peer: Peer | None) -> None:
        """Whether ``req`` may be served at all, before it takes a transfer slot."""
        tokens = self.ctx.tokens
        if tokens is not None:  # legacy --auth token
            if not req.token:
                raise _Reject(Status.UNAUTHORIZED, "missing token")
            if not tokens.check(req.token):
                raise _Reject(Status.FORBIDDEN, "invalid token")
        elif peer is None:
            raise _Reject(Status.UNAUTHORIZED, "the client certificate names no tierckpt identity")
        try:
            check_job_id(req.job)
        except FormatError as exc:
            raise _Reject(Status.BAD_REQUEST, str(exc)) from exc
        if tokens is None:
            why = data_refusal(peer, req.op, req.job, req.node, self.ctx.members, self.ctx.config.node)
            if why is not None:
                raise _Reject(Status.FORBIDDEN, why)
        if not (0 <= req.rank < _MAX_INDEX and 0 <= req.step < _MAX_INDEX):
            raise _Reject(Status.BAD_REQUEST, "rank and step must be non-negative integers")

    def _floor(self) -> RateFloor:
        """The minimum rate of what a peer sends from now on (one per phase we wait on the peer in)."""
        cfg = self.ctx.config
        return RateFloor(cfg.min_transfer_rate, cfg.transfer_timeout)

    @staticmethod
    def _reply(conn: DataConnection, reply: DataReply, payload: bytes = b"") -> None:
        with contextlib.suppress(OSError):
            send_frame(conn, reply, payload)

    @contextlib.contextmanager
    def _claim(self, key: tuple[str, int, int]) -> Iterator[None]:
        with self._claims_lock:
            if key in self._claims:
                raise _Reject(Status.CONFLICT, "this step is already being received")
            self._claims.add(key)
        try:
            yield
        finally:
            with self._claims_lock:
                self._claims.discard(key)

    # ------------------------------------------------------------------ put

    def _put(self, conn: DataConnection, req: DataRequest) -> None:
        header = self._read_header(conn, req)
        self._within_quota(req, header.manifest)
        with open_job(self.ctx.root, req.job, create=True) as job:
            parent = rank_tree(job, "replica", req.rank)
            if read_commit(parent.at(step_name(req.step))) is not None and self._holds_this_save(
                req, parent, header
            ):
                self._reply(conn, DataReply(status=Status.ALREADY, message="replica already committed"))
                return
            total = header.manifest.total_bytes
            with self._claim((req.job, req.rank, req.step)):
                writer = StepWriter(parent, header)
                linked = self._link_base(job, req, writer)
                need = total - linked + len(header.commit_bytes) + len(header.manifest_bytes)
                try:
                    self._ensure_room(req.job, need)
                except _Reject:
                    writer.abort()
                    raise
                started = time.monotonic()
                status, message = self._receive_replica(conn, req, writer, linked > 0)
                if status == Status.OK:  # before the reply: once the sender hears "committed", retention ran
                    apply_retention(self.ctx.root, req.job, self.ctx.config.replica_keep)
                self._reply(conn, DataReply(status=status, message=message, total_bytes=total))
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
        self._event(req, status, bytes=total - linked, seconds=seconds, message=message)

    def _holds_this_save(self, req: DataRequest, parent: Beneath, header: StepHeader) -> bool:
        """Whether the committed replica of ``req``'s step held here is the save being sent (its COMMIT,
        byte for byte). A step saved again (the job went back to an older step and trained on) is another
        save of that number: the earlier one is dropped here, and the caller receives the new one. 409
        if the one held is the newer save, or is being read (leased)."""
        held = parent.at(step_name(req.step))
        mine = read_header(
            held, job=req.job, rank=req.rank, step_no=req.step, limit=self.ctx.config.max_manifest_bytes
        )
        if mine.commit_bytes == header.commit_bytes:
            return True
        if mine.manifest.created_at >= header.manifest.created_at:
            raise _Reject(Status.CONFLICT, f"this node holds a newer save of step {req.step}")
        with leases.lock(parent):
            if req.step in leases.leased_steps(parent):
                raise _Reject(Status.CONFLICT, f"an earlier save of step {req.step} is being read here")
            discard_step(held)
        log.info(
            "replica %s rank %d step %d: dropped the earlier save of the step (%s saves it again)",
            req.job,
            req.rank,
            req.step,
            req.node or "its node",
        )
        return False

    def _link_base(self, job: Beneath, req: DataRequest, writer: StepWriter) -> int:
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
                with leases.hold(base_rank, req.step, unique_holder(self.ctx.config.holder)):
                    theirs = read_header(
                        base,
                        job=req.job,
                        rank=req.base_rank,
                        step_no=req.step,
                        limit=self.ctx.config.max_manifest_bytes,
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

    def _read_header(self, conn: DataConnection, req: DataRequest) -> StepHeader:
        limit = self.ctx.config.max_manifest_bytes
        for what, size in (("commit", req.commit_size), ("manifest", req.manifest_size)):
            if not 0 < size <= limit:
                raise _Reject(Status.TOO_LARGE, f"{what} size {size} outside 1..{limit}")
        floor = self._floor()
        commit_bytes = recv_exact(conn, req.commit_size, progress=floor)
        manifest_bytes = recv_exact(conn, req.manifest_size, progress=floor)
        try:
            return parse_header(commit_bytes, manifest_bytes, job=req.job, rank=req.rank, step=req.step)
        except FormatError as exc:
            raise _Reject(Status.BAD_REQUEST, f"bad step header: {exc}") from exc

    def _receive_replica(
        self, conn: DataConnection, req: DataRequest, writer: StepWriter, linked: bool = False
    ) -> tuple[int, str]:
        """Preallocate, say continue, receive and verify, commit. Returns (status, message)."""
        return self._receive(
            conn, req, writer, lambda: _receive_all(conn, writer, self._floor()), "committed", linked
        )

    def _receive(
        self,
        conn: DataConnection,
        req: DataRequest,
        writer: StepWriter | FragmentWriter,
        body: Callable[[], None],
        done: str,
        linked: bool = False,
    ) -> tuple[int, str]:
        """``writer.prepare()``, CONTINUE, ``body()`` (the bytes in), ``writer.commit()``; whatever fails
        aborts the writer, so nothing half-received is ever committed. Returns (status, message)."""
        try:
            writer.prepare()
            send_frame(conn, DataReply(status=Status.CONTINUE, linked=linked))
            body()
            writer.commit()
            return Status.OK, done
        except RamdiskFullError as exc:
            writer.abort()
            raise _Reject(Status.NO_SPACE, str(exc)) from exc
        except CorruptShardError as exc:
            writer.abort()
            return Status.CORRUPT, str(exc)
        except BaseException as exc:
            writer.abort()
            self._event(req, Status.ABORTED, message=f"transfer aborted: {exc}")
            raise

    def _within_quota(self, req: DataRequest, manifest: Manifest, fragment: int = 0) -> None:
        """413 (logged, and reported as a ``DataEvent``) if the step declares more bytes than its job's
        quota, or a fragment of it more than the quota: before anything of it is reserved or stored."""
        over = self.ctx.quotas.over(manifest)
        if over is None and fragment > (quota := self.ctx.quotas.of(req.job)):
            over = StepOverQuota(manifest.rank, manifest.step, fragment, quota)  # its fragment, declared
        if over is None:
            return
        message = f"refused: {over.describe(req.job)}"
        log.warning("%s from %s: %s", req.op, req.node or "?", message)
        self._event(req, Status.TOO_LARGE, bytes=over.bytes, message=message)
        raise _Reject(Status.TOO_LARGE, message)

    def _event(self, req: DataRequest, status: int, **fields: Any) -> None:
        self.ctx.emit(
            DataEvent(
                op=req.op, job=req.job, rank=req.rank, step=req.step, peer=req.node, status=status, **fields
            )
        )

    def _ensure_room(self, job: str, need: int) -> None:
        root = self.ctx.root
        reserve = self.ctx.config.reserve_bytes + client_headroom(root)
        if free_bytes(root) - need >= reserve:
            return
        make_room(root, job)
        free = free_bytes(root)
        if free - need < reserve:
            raise _Reject(Status.NO_SPACE, f"need {need} bytes plus a reserve of {reserve}, {free} free")

    # ------------------------------------------------------------------ get

    def _get(self, conn: DataConnection, req: DataRequest) -> None:
        missing = _Reject(Status.NOT_FOUND, f"no committed copy of {req.job} rank {req.rank} step {req.step}")
        try:
            job = open_job(self.ctx.root, req.job)
        except FileNotFoundError:
            raise missing from None
        with job:
            found = find_committed(job, req.rank, req.step)
            if found is None:
                raise missing
            rank, path = found
            self._send_step(conn, req, rank, path)

    def _send_step(self, conn: DataConnection, req: DataRequest, rank: Beneath, path: Beneath) -> None:
        started = time.monotonic()
        try:
            lease = leases.hold(rank, req.step, unique_holder(self.ctx.config.holder))
        except MissingCheckpointError as exc:
            raise _Reject(Status.NOT_FOUND, "the step was deleted meanwhile") from exc
        with lease:
            try:
                header = read_header(
                    path,
                    job=req.job,
                    rank=req.rank,
                    step_no=req.step,
                    limit=self.ctx.config.max_manifest_bytes,
                )
            except FormatError as exc:
                raise _Reject(Status.CORRUPT, f"local copy unreadable: {exc}") from exc
            with open_files(path, header.manifest) as fds:  # all of them, before a byte goes out
                try:
                    self.ctx.quotas.check(header.manifest, fds=fds)
                except OverQuotaError as exc:
                    log.warning("not serving a step to %s: %s", req.node or "?", exc)
                    raise _Reject(Status.TOO_LARGE, f"not served: {exc}") from exc
                reply = DataReply(
                    status=Status.OK,
                    commit_size=len(header.commit_bytes),
                    manifest_size=len(header.manifest_bytes),
                    total_bytes=header.manifest.total_bytes,
                )
                send_frame(conn, reply, header.commit_bytes + header.manifest_bytes)
                for f, fd in zip(header.manifest.files, fds, strict=True):
                    where = f"{path.where}/{f.name}"
                    send_file(conn, fd, f.size, where=where, method=self.ctx.config.send_method)
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
        self._event(req, Status.OK, bytes=header.manifest.total_bytes, seconds=seconds)

    # ------------------------------------------------------------------ fragments

    def _fragment(self, conn: DataConnection, req: DataRequest) -> None:
        """Receive one erasure-coded fragment of a rank's step (this node holds at most one per step)."""
        header = self._read_fragment_header(conn, req)
        self._within_quota(req, header.step.manifest, fragment=header.size)
        with open_job(self.ctx.root, req.job, create=True) as job:
            held = find_fragment(job, req.rank, req.step)
            if held is not None:
                index = held_index(held)
                if index == req.index:
                    self._reply(
                        conn, DataReply(status=Status.ALREADY, message="fragment held", index=req.index)
                    )
                    return
                why = f"holds fragment {index} of this step, not {req.index}"
                self._reply(
                    conn,
                    DataReply(status=Status.CONFLICT, message=why, index=index if index is not None else -1),
                )
                return
            parent = fragment_tree(job, req.rank)
            total = header.size
            with self._claim((req.job, req.rank, req.step)):
                self._ensure_room(req.job, total + req.commit_size + req.manifest_size + req.erasure_size)
                started = time.monotonic()
                status, message = self._receive_fragment(conn, req, FragmentWriter(parent, header))
                if status == Status.OK:
                    retain(parent, self.ctx.config.replica_keep)
                self._reply(
                    conn, DataReply(status=status, message=message, total_bytes=total, index=req.index)
                )
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
        self._event(req, status, bytes=total, seconds=seconds, message=message)

    def _read_fragment_header(self, conn: DataConnection, req: DataRequest) -> FragmentHeader:
        limit = self.ctx.config.max_manifest_bytes
        sizes = (("commit", req.commit_size), ("manifest", req.manifest_size), ("erasure", req.erasure_size))
        for what, size in sizes:
            if not 0 < size <= limit:
                raise _Reject(Status.TOO_LARGE, f"{what} size {size} outside 1..{limit}")
        floor = self._floor()
        parts = [recv_exact(conn, size, progress=floor) for _, size in sizes]
        try:
            return parse_fragment_header(*parts, job=req.job, rank=req.rank, step=req.step, index=req.index)
        except FormatError as exc:
            raise _Reject(Status.BAD_REQUEST, f"bad fragment header: {exc}") from exc

    def _receive_fragment(
        self, conn: DataConnection, req: DataRequest, writer: FragmentWriter
    ) -> tuple[int, str]:
        def body() -> None:
            fd = writer.open()
            try:
                crc = receive_file(conn, fd, writer.header.size, where=writer.where, pace=self._floor())
            finally:
                os.close(fd)
            writer.record(crc)

        return self._receive(conn, req, writer, body, "fragment committed")

    def _get_fragment(self, conn: DataConnection, req: DataRequest) -> None:
        """Serve this node's fragment of a rank's step: its headers, then its bytes."""
        missing = _Reject(Status.NOT_FOUND, f"no fragment of {req.job} rank {req.rank} step {req.step}")
        started = time.monotonic()
        try:
            job = open_job(self.ctx.root, req.job)
        except FileNotFoundError:
            raise missing from None
        with job:
            path = find_fragment(job, req.rank, req.step)
            if path is None:
                raise missing
            limit = self.ctx.config.max_manifest_bytes
            try:
                header = read_fragment_header(path, job=req.job, rank=req.rank, step_no=req.step, limit=limit)
            except FormatError as exc:
                raise _Reject(Status.CORRUPT, f"local fragment unreadable: {exc}") from exc
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
                send_file(conn, fd, header.size, where=where, method=self.ctx.config.send_method)
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
        self._event(req, Status.OK, bytes=header.size, seconds=seconds)

    # ------------------------------------------------------------------ corrupt

    def _corrupt(self, conn: DataConnection, req: DataRequest) -> None:
        message = "no replica held"
        try:
            job = open_job(self.ctx.root, req.job)
        except FileNotFoundError:
            job = None
        with contextlib.ExitStack() as stack:
            if job is not None:
                stack.enter_context(job)
                message = self._check_reported(job, req)
        self._event(req, Status.OK, message=message)
        self._reply(conn, DataReply(status=Status.OK, message=message))

    # ------------------------------------------------------------------ retire

    def _retire(self, conn: DataConnection, req: DataRequest) -> None:
        """Drop this node's replicas of a rank (that step and older ones) its primary says are surplus.
        Only the node that runs the rank in this node's own peer assignment may ask (a peer of the job
        cannot drop another node's copies). A step the published restore plan names, or one a reader
        leased, stays (``409``: the sender asks again later); "no replica held" is an answer too."""
        assignment = self.ctx.members.assignments.get(req.job)
        status, message = Status.OK, "no replica held"
        try:
            job = open_job(self.ctx.root, req.job)
        except FileNotFoundError:
            job = None
        with contextlib.ExitStack() as stack:
            if job is not None:
                stack.enter_context(job)
                parent = rank_tree(job, "replica", req.rank)
                steps = [s for s in committed_steps(parent) if s <= req.step]
                if steps:
                    newest = parent.at(step_name(steps[-1]))
                    world = read_manifest(newest, limit=self.ctx.config.max_manifest_bytes).world_size
                    owns = assignment is not None and req.rank in assignment.process_ranks(req.node, world)
                    if self.ctx.tokens is None and not owns:
                        raise _Reject(
                            Status.FORBIDDEN, f"{req.node} does not run rank {req.rank} of {req.job}"
                        )
                    status, message = self._drop_surplus(parent, req, steps)
        self._event(req, status, message=message)
        self._reply(conn, DataReply(status=status, message=message))

    def _drop_surplus(self, parent: Beneath, req: DataRequest, steps: list[int]) -> tuple[int, str]:
        pinned = pinned_steps(self.ctx.root, req.job)
        with leases.lock(parent):  # a reader leasing meanwhile either sees the step stay or learns it is gone
            kept = sorted((set(steps) & pinned) | (set(steps) & set(leases.leased_steps(parent))))
            dropped = [s for s in steps if s not in kept]
            for s in dropped:
                discard_step(parent.at(step_name(s)))
        if dropped:
            log.info(
                "%s rank %d: replica steps %s retired (surplus, says %s)",
                req.job,
                req.rank,
                dropped,
                req.node,
            )
        if kept:
            return Status.CONFLICT, f"replica steps {kept} kept: named by the restore plan or read now"
        return Status.OK, f"replica steps {dropped} retired"

    def _check_reported(self, job: Beneath, req: DataRequest) -> str:
        """Re-verify the replica a peer reported corrupt; drop it if it is. Returns what was found."""
        path = rank_tree(job, "replica", req.rank).at(step_name(req.step))
        message = "no replica held"
        try:
            committed = read_commit(path) is not None
        except FormatError as exc:  # an unreadable COMMIT, or a symlink planted as the step: dropped
            discard_step(path)
            return f"replica dropped: {exc}"
        if committed:
            problems = verify_step(path, limit=self.ctx.config.max_manifest_bytes)
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


def _close_gently(conn: DataConnection) -> None:
    """Close after the peer has read our last reply. A refused request may leave bytes the peer
    already sent unread (a payload after a refused header, garbage); closing over them makes the
    kernel answer with a reset, which can destroy the reply before the peer reads it. So: end our
    side, drain what the peer still sends (at most ``_LINGER_BYTES`` within ``_LINGER_SECONDS``),
    then close."""
    deadline = time.monotonic() + _LINGER_SECONDS
    drained = 0
    with contextlib.suppress(OSError, ProtocolError):
        conn.shutdown(socket.SHUT_WR)
        while drained < _LINGER_BYTES and (left := deadline - time.monotonic()) > 0:
            conn.settimeout(left)
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            drained += len(chunk)
    conn.close()


class _Shed:
    """Shuts a connection down from the accept thread (it was shed to make room) through a descriptor
    of its own: its handler thread may close or wrap the socket at any time meanwhile."""

    def __init__(self, conn: socket.socket) -> None:
        self._lock = threading.Lock()
        self._dup: socket.socket | None = conn.dup()

    def __call__(self) -> None:
        with self._lock:
            if self._dup is not None:
                with contextlib.suppress(OSError):
                    self._dup.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with self._lock:
            if self._dup is not None:
                self._dup.close()
                self._dup = None


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
