"""Typed messages between the daemon and its replication worker process, one JSON line each.

The daemon starts the worker with one end of a socketpair and sends ``WorkerConfig`` first; the worker
answers ``WorkerReady`` once its data endpoint listens. Then the daemon
sends ``SendTask``/``FetchTask``/``RetireTask``; the worker answers each with ``TaskProgress`` lines and one
``TaskResult``, and reports what its data server did as ``DataEvent``. ``FenceJob`` fences a job being
purged (or lifts the fence), answered by a ``TaskResult`` once nothing of the job is under way in the
worker (``replication.fences``). ``Shutdown`` (or the daemon's end closing) stops the worker. No
pickle: every line is a ``_codec`` message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import threading
from typing import Literal

from tierckpt.protocol.codec import Message, Record, decode
from tierckpt.protocol.control import PeerAssignment
from tierckpt.protocol.errors import FormatError
from tierckpt_replicator.assignments import data_endpoint
from tierckpt_replicator.settings import TransferSettings

__all__ = [
    "MESSAGES",
    "Channel",
    "DataEvent",
    "ErasureTask",
    "FenceJob",
    "FetchSource",
    "FetchTask",
    "Outcome",
    "PeerAddress",
    "RebuildTask",
    "RetireTask",
    "SendTask",
    "Shutdown",
    "StepTask",
    "TaskProgress",
    "TaskResult",
    "WorkerConfig",
    "WorkerReady",
    "decode_line",
    "encode_line",
]

MAX_LINE = 1 << 20

OutcomeStatus = Literal[
    "ok",
    "already",
    "failed",
    "corrupt",
    "full",
    "busy",
    "unreachable",
    "missing",
    "unauthorized",
    "local",
    "too_large",
]
"""How one transfer ended. ``local``: a fault of this node, not of the peer (its own ramdisk full, so the
sender cannot lease its primary): no other peer is tried, each would end the same way. ``too_large``: the
step declares more bytes than its job's quota (here, or at the peer)."""


@dataclasses.dataclass(frozen=True)
class PeerAddress(Record):
    node: str
    host: str
    port: int

    @classmethod
    def of(cls, assignment: PeerAssignment, node: str) -> PeerAddress:
        """``node``'s data endpoint, as the job's plan names it."""
        return cls(node, *data_endpoint(assignment.nodes[node]))


@dataclasses.dataclass(frozen=True)
class WorkerConfig(Message):
    KIND = "tierckpt.worker-config"

    node: str
    root: str
    listen_host: str
    data_port: int
    holder: str
    transfer: TransferSettings = dataclasses.field(default_factory=TransferSettings)
    """The data plane's settings (``--concurrency``, ``--max-incoming``, the timeouts and rates, the
    quota, retention and the worker process's priority), the daemon's ``Settings.transfer`` whole."""
    log_level: str = "INFO"
    auth: Literal["tls", "token"] = "tls"
    tls_cert: str = ""
    """--auth tls: this node's certificate chain (the file may hold its key too)."""
    tls_key: str = ""
    tls_ca: str = ""
    token_file: str = ""
    """--auth token: the shared bearer token's file."""
    peers_file: str = ""
    """The static peer assignment (local mode): it makes nodes members of its job."""
    fenced: tuple[str, ...] = ()
    """Jobs being purged when the worker (re)starts: fenced from the start (``FenceJob``)."""


@dataclasses.dataclass(frozen=True)
class StepTask(Message):
    """The task's number (its ``TaskResult`` answers it) and the rank's step it is about."""

    id: int
    job: str
    rank: int
    step: int


@dataclasses.dataclass(frozen=True)
class SendTask(StepTask):
    """Copy ``job``/``rank``/``step`` (a local primary) to ``want`` of the candidates, in order."""

    KIND = "tierckpt.send-task"

    candidates: tuple[PeerAddress, ...]
    want: int = 1
    bases: dict[str, int] = dataclasses.field(default_factory=dict)
    """Candidate node -> replica group member whose identical step it holds (``DataRequest.base_rank``)."""


@dataclasses.dataclass(frozen=True)
class RetireTask(StepTask):
    """Ask each of ``holders`` to drop its replica of ``job``/``rank``/``step`` (a surplus copy)."""

    KIND = "tierckpt.retire-task"

    holders: tuple[PeerAddress, ...]


@dataclasses.dataclass(frozen=True)
class ErasureTask(StepTask):
    """Encode ``job``/``rank``/``step`` (a local primary) into ``k + m`` fragments and send each index not
    yet ``placed`` (node -> index) to its own candidate, in order, one fragment per node."""

    KIND = "tierckpt.erasure-task"

    k: int
    m: int
    candidates: tuple[PeerAddress, ...]
    placed: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class RebuildTask(StepTask):
    """Rebuild ``job``/``rank``/``step`` as this node's primary from the fragments ``sources`` hold."""

    KIND = "tierckpt.rebuild-task"

    sources: tuple[FetchSource, ...]


@dataclasses.dataclass(frozen=True)
class FetchSource(Record):
    kind: Literal["replica", "peer"]
    node: str
    host: str = ""
    port: int = 0

    @classmethod
    def peer(cls, assignment: PeerAssignment, node: str) -> FetchSource:
        """Fetch from ``node``'s data endpoint, as the job's plan names it."""
        host, port = data_endpoint(assignment.nodes[node])
        return cls(kind="peer", node=node, host=host, port=port)


@dataclasses.dataclass(frozen=True)
class FetchTask(StepTask):
    """Stage ``job``/``rank``/``step`` on this node from the first source that works: as its primary
    (a restore of the node's own ranks), or as a replica (another rank's step a load here reads)."""

    KIND = "tierckpt.fetch-task"

    sources: tuple[FetchSource, ...]
    into: Literal["primary", "replica"] = "primary"
    save_id: str = ""
    """A DCP save (``FetchRequest.save_id``): only a copy whose manifest names it counts as here already
    or is taken from a source (a source's copy of another save: "missing"). ``""``: any copy."""


@dataclasses.dataclass(frozen=True)
class Outcome(Record):
    node: str
    status: OutcomeStatus
    message: str = ""
    bytes: int = 0
    seconds: float = 0.0
    index: int = -1
    """An erasure-coded fragment's index (sent or fetched); -1 for whole steps."""
    saved: int = 0
    """Bytes of the step not sent: the peer linked an identical replica group member's data files."""


@dataclasses.dataclass(frozen=True)
class TaskProgress(Message):
    KIND = "tierckpt.task-progress"

    id: int
    bytes_done: int
    bytes_total: int


@dataclasses.dataclass(frozen=True)
class TaskResult(Message):
    KIND = "tierckpt.task-result"

    id: int
    ok: bool
    outcomes: tuple[Outcome, ...] = ()
    message: str = ""


@dataclasses.dataclass(frozen=True)
class DataEvent(Message):
    """Something the worker's data server did (for metrics, logs and inventory refresh)."""

    KIND = "tierckpt.data-event"

    op: Literal["put", "get", "corrupt", "retire", "fragment", "getfrag"]
    job: str
    rank: int
    step: int
    peer: str
    status: int
    bytes: int = 0
    seconds: float = 0.0
    message: str = ""


@dataclasses.dataclass(frozen=True)
class WorkerReady(Message):
    """Sent once the worker's data endpoint listens."""

    KIND = "tierckpt.worker-ready"

    data_port: int


@dataclasses.dataclass(frozen=True)
class FenceJob(Message):
    """Fence ``job`` (it is being purged): no transfer or task of it starts in the worker, those under
    way are aborted; the ``TaskResult`` numbered ``id`` answers once none is left. ``fenced=False``: lift
    the fence (the job is gone)."""

    KIND = "tierckpt.fence-job"

    id: int
    job: str
    fenced: bool = True


@dataclasses.dataclass(frozen=True)
class Shutdown(Message):
    KIND = "tierckpt.worker-shutdown"


MESSAGES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        WorkerConfig,
        WorkerReady,
        SendTask,
        FetchTask,
        RetireTask,
        ErasureTask,
        RebuildTask,
        TaskProgress,
        TaskResult,
        DataEvent,
        FenceJob,
        Shutdown,
    )
}


def encode_line(msg: Message) -> bytes:
    return msg.to_bytes() + b"\n"


def decode_line(line: bytes) -> Message:
    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise FormatError(f"worker channel: not JSON ({exc})") from exc
    kind = obj.get("kind") if isinstance(obj, dict) else None
    cls = MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise FormatError(f"worker channel: unknown message {str(obj)[:80]!r}")
    return decode(cls, obj)


class Channel:
    """The worker's blocking end: ``recv()`` one message (None at EOF), ``send()`` from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._rfile = sock.makefile("rb")
        self._lock = threading.Lock()

    def recv(self) -> Message | None:
        line = self._rfile.readline(MAX_LINE)
        return decode_line(line) if line else None

    def send(self, msg: Message) -> None:
        data = encode_line(msg)
        with self._lock, contextlib.suppress(OSError):  # daemon gone: the main loop sees EOF and exits
            self._sock.sendall(data)

    def close(self) -> None:
        self._rfile.close()
        self._sock.close()
