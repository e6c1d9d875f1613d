"""The receive envelope every operation of the data endpoint runs in (``Transfers``), and ``Reject``.

``Transfers`` is what the handlers share across connections: the worker's context, the claims on steps
being received (one transfer of a step at a time), the rate floor, the quota and room checks, events,
and ``receive``: prepare the writer, say CONTINUE, take the bytes, commit, or abort whatever failed, so
nothing half-received is ever committed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from tierckpt.protocol.control import StepOverQuota
from tierckpt.protocol.errors import CorruptShardError, RamdiskFullError
from tierckpt.protocol.format import Manifest
from tierckpt_replicator.replication.channel import DataConnection
from tierckpt_replicator.replication.context import DataContext
from tierckpt_replicator.replication.fragments import FragmentWriter
from tierckpt_replicator.replication.ipc import DataEvent
from tierckpt_replicator.replication.pacing import RateFloor
from tierckpt_replicator.replication.replicas import client_headroom, free_bytes, make_room
from tierckpt_replicator.replication.wire import DataReply, DataRequest, Status, send_frame
from tierckpt_replicator.stepio import StepWriter

__all__ = ["Reject", "Transfers"]

log = logging.getLogger(__name__)


class Reject(Exception):
    """Refuse the request with ``status`` (its message goes back to the peer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Transfers:
    """The state and steps every handler shares (one per data server)."""

    def __init__(self, ctx: DataContext) -> None:
        self.ctx = ctx
        self.claims: set[tuple[str, int, int]] = set()
        self._claims_lock = threading.Lock()

    def floor(self) -> RateFloor:
        """The minimum rate of what a peer sends from now on (one per phase we wait on the peer in)."""
        cfg = self.ctx.config
        return RateFloor(cfg.transfer.min_transfer_rate * 1e6, cfg.transfer.transfer_timeout)

    @staticmethod
    def reply(conn: DataConnection, reply: DataReply, payload: bytes = b"") -> None:
        """Send ``reply`` (and ``payload``) unless the connection is gone."""
        with contextlib.suppress(OSError):
            send_frame(conn, reply, payload)

    @contextlib.contextmanager
    def claim(self, key: tuple[str, int, int]) -> Iterator[None]:
        with self._claims_lock:
            if key in self.claims:
                raise Reject(Status.CONFLICT, "this step is already being received")
            self.claims.add(key)
        try:
            yield
        finally:
            with self._claims_lock:
                self.claims.discard(key)

    def receive(
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
            raise Reject(Status.NO_SPACE, str(exc)) from exc
        except CorruptShardError as exc:
            writer.abort()
            return Status.CORRUPT, str(exc)
        except BaseException as exc:
            writer.abort()
            self.event(req, Status.ABORTED, message=f"transfer aborted: {exc}")
            raise

    def within_quota(self, req: DataRequest, manifest: Manifest, fragment: int = 0) -> None:
        """413 (logged, and reported as a ``DataEvent``) if the step declares more bytes than its job's
        quota, or a fragment of it more than the quota: before anything of it is reserved or stored."""
        over = self.ctx.quotas.over(manifest)
        if over is None and fragment > (quota := self.ctx.quotas.of(req.job)):
            over = StepOverQuota(manifest.rank, manifest.step, fragment, quota)  # its fragment, declared
        if over is None:
            return
        message = f"refused: {over.describe(req.job)}"
        log.warning("%s from %s: %s", req.op, req.node or "?", message)
        self.event(req, Status.TOO_LARGE, bytes=over.bytes, message=message)
        raise Reject(Status.TOO_LARGE, message)

    def event(self, req: DataRequest, status: int, **fields: Any) -> None:
        self.ctx.emit(
            DataEvent(
                op=req.op, job=req.job, rank=req.rank, step=req.step, peer=req.node, status=status, **fields
            )
        )

    def ensure_room(self, job: str, need: int) -> None:
        root = self.ctx.root
        reserve = self.ctx.config.transfer.reserve_bytes + client_headroom(root)
        if free_bytes(root) - need >= reserve:
            return
        make_room(root, job)
        free = free_bytes(root)
        if free - need < reserve:
            raise Reject(Status.NO_SPACE, f"need {need} bytes plus a reserve of {reserve}, {free} free")
