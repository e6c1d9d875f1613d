"""The data endpoint: receives replicas (``put``), serves steps to restoring nodes (``get``), and hears
corruption reports (``corrupt``) and surplus notices (``retire``), and holds erasure-coded fragments
(``fragment`` in, ``getfrag`` out; see ``fragments``): each operation in its own module of
``replication.handlers``, over their one receive envelope (``handlers.envelope``); this module admits,
secures, authorizes and dispatches the connections. Blocking sockets, one thread per connection,
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

A job being purged on this node (``fences``) is refused (403) from the moment the purge fences it, and a
connection of it under way is shut down then, so a replica or fragment still arriving is aborted, never
committed into (nor re-creating) the directory the purge deletes.

Every file is reached through the job's confined tree (``stepio.open_job``): a symlink a pod planted in
its job directory (a rank, a step, a data file) is refused (422, logged), never followed.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import cast

from tierckpt.protocol.errors import (
    FormatError,
    UnsafePathError,
)
from tierckpt.protocol.format import (
    check_job_id,
)
from tierckpt.protocol.identity import Peer
from tierckpt_replicator.access import data_refusal
from tierckpt_replicator.connlimits import Admission, ConnectionLimits, close_now
from tierckpt_replicator.replication.channel import DataConnection, SealedChannel, accept_channel, is_hello
from tierckpt_replicator.replication.context import DataContext, secure
from tierckpt_replicator.replication.fences import JobPurging
from tierckpt_replicator.replication.handlers import HANDLERS, Reject, Transfers
from tierckpt_replicator.replication.pacing import Deadline
from tierckpt_replicator.replication.wire import (
    DataReply,
    DataRequest,
    ProtocolError,
    Status,
    decode_frame,
    recv_body,
)

__all__ = ["DataServer"]

log = logging.getLogger(__name__)

_MAX_INDEX = 1 << 62
_LINGER_SECONDS = 1.0
_LINGER_BYTES = 4 << 20


class DataServer:
    """``start()`` binds and serves on a background thread; ``stop()`` closes the listener."""

    def __init__(self, ctx: DataContext) -> None:
        self.ctx = ctx
        cfg = ctx.config
        self._slots = threading.BoundedSemaphore(cfg.transfer.max_incoming)
        self.connections = ConnectionLimits(
            "data endpoint",
            total=4 * cfg.transfer.max_incoming + 8,
            per_source=cfg.transfer.data_connections_per_source,
            deadline=cfg.transfer.handshake_timeout,
        )
        self.transfers = Transfers(ctx)
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
            self._serve(conn, addr, admission, shed)
        finally:
            shed.close()
            admission.release()

    # ------------------------------------------------------------------ one connection

    def _serve(self, sock: socket.socket, addr: tuple[str, int], admission: Admission, shed: _Shed) -> None:
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
                raise Reject(
                    Status.BUSY, f"already serving {self.ctx.config.transfer.max_incoming} transfers"
                )
            conn.settimeout(
                self.ctx.config.transfer.transfer_timeout
            )  # a silent peer: caught within a window
            if isinstance(conn, SealedChannel):
                conn.allow_bulk()
            with self.ctx.fences.working(req.job, abort=shed):  # a purge of the job shuts it down
                HANDLERS[req.op](self.transfers, conn, req)
        except JobPurging as exc:
            log.info("data %s: refused (%d): %s", addr[0], Status.FORBIDDEN, exc)
            Transfers.reply(conn, DataReply(status=Status.FORBIDDEN, message=str(exc)))
        except Reject as exc:
            log.info("data %s: refused (%d): %s", addr[0], exc.status, exc)
            Transfers.reply(conn, DataReply(status=exc.status, message=str(exc)))
        except ProtocolError as exc:
            log.warning("data %s: %s", addr[0], exc)
            Transfers.reply(conn, DataReply(status=exc.status or Status.BAD_REQUEST, message=str(exc)))
        except UnsafePathError as exc:  # something a pod planted in its job tree: refused, not followed
            log.warning("data %s: refused: %s", addr[0], exc)
            Transfers.reply(conn, DataReply(status=Status.CORRUPT, message=f"refused: {exc}"))
        except FormatError as exc:
            log.warning("data %s: unreadable local copy: %s", addr[0], exc)
            Transfers.reply(conn, DataReply(status=Status.CORRUPT, message=f"unreadable local copy: {exc}"))
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
                raise Reject(Status.UNAUTHORIZED, "missing token")
            if not tokens.check(req.token):
                raise Reject(Status.FORBIDDEN, "invalid token")
        elif peer is None:
            raise Reject(Status.UNAUTHORIZED, "the client certificate names no tierckpt identity")
        try:
            check_job_id(req.job)
        except FormatError as exc:
            raise Reject(Status.BAD_REQUEST, str(exc)) from exc
        if tokens is None:
            why = data_refusal(peer, req.op, req.job, req.node, self.ctx.members, self.ctx.config.node)
            if why is not None:
                raise Reject(Status.FORBIDDEN, why)
        if not (0 <= req.rank < _MAX_INDEX and 0 <= req.step < _MAX_INDEX):
            raise Reject(Status.BAD_REQUEST, "rank and step must be non-negative integers")


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
    """Shuts a connection down from another thread (the accept thread: it was shed to make room; a purge
    of its job) through a descriptor of its own: its handler thread may close or wrap the socket at any
    time meanwhile."""

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
