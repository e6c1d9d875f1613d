"""The streaming data protocol between replicators (spec: docs/replicator.md, "Data protocol").

One TCP connection carries one request. Every message is a *frame*: the magic ``TKR1``, a 4-byte
big-endian length, then a ``_codec`` JSON message. Raw step bytes follow some frames::

    put  (sender -> holder-to-be)   DataRequest{op=put, token, job, rank, step, commit_size, manifest_size}
                                    + COMMIT bytes + manifest bytes
                                    <- DataReply{status=100 continue | error}
                                    + every file of the manifest, in manifest order, exactly its size
                                    <- DataReply{status=200 committed | 422 corrupt | error}
                                    With base_rank >= 0 (a replica group member whose step the holder
                                    has, same content key): the holder links that step's data files and
                                    answers 100 with linked=true; then only the files that are not data
                                    files (objects.pkl, ...) follow. linked=false: every file follows.
    get  (restorer -> holder)       DataRequest{op=get, token, job, rank, step}
                                    <- DataReply{status=200, commit_size, manifest_size} + COMMIT + manifest
                                    + every file of the manifest, in manifest order
    corrupt (restorer -> holder)    DataRequest{op=corrupt, ...}: "your copy failed its crc32c";
                                    the holder re-verifies its replica and drops it if bad.
    retire (primary -> holder)      DataRequest{op=retire, ...}: "your copy is surplus" (the job's
                                    replication factor dropped); the holder drops its replica if the
                                    requester runs that rank in the holder's own peer assignment.
    fragment (primary -> holder)    DataRequest{op=fragment, ..., index, commit_size, manifest_size,
                                    erasure_size} + COMMIT + manifest + erasure manifest bytes
                                    <- DataReply{status=100 continue | 208 held | error}
                                    + the fragment's bytes  <- DataReply{status=200 | 422 corrupt}
    getfrag (restorer -> holder)    DataRequest{op=getfrag, ...}
                                    <- DataReply{status=200, index, commit_size, manifest_size,
                                    erasure_size, total_bytes} + the three headers + the fragment

With ``--auth tls`` the connection is mutual TLS and the request is authorized by the client
certificate's identity (``token`` is empty; ``node`` must be the node the certificate names); with
legacy ``--auth token`` the token is checked (constant time) before anything else is read. Statuses
follow HTTP's meaning.

Under TLS the client's first frame may be a ``ChannelHello`` instead of the request: the server answers
with its own, both end TLS and everything after (the request included) travels in sealed records
(``channel``; what this build's clients do). A first frame that is the request keeps TLS throughout
(earlier builds).
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar, Literal, Protocol, TypeVar

from tierckpt.protocol.codec import Message
from tierckpt.protocol.errors import FormatError, RetryableError
from tierckpt_replicator.replication.pacing import Deadline

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = [
    "MAGIC",
    "MAX_FRAME",
    "ChannelHello",
    "DataReply",
    "DataRequest",
    "ProtocolError",
    "Status",
    "Stream",
    "decode_frame",
    "recv_body",
    "recv_exact",
    "recv_frame",
    "send_frame",
]

MAGIC = b"TKR1"
MAX_FRAME = 64 << 10
_HEADER = struct.Struct("!4sI")

Op = Literal["put", "get", "corrupt", "retire", "fragment", "getfrag"]
M = TypeVar("M", bound=Message)


class Status:
    """Reply statuses (HTTP meanings)."""

    CONTINUE = 100
    OK = 200
    ALREADY = 208
    BAD_REQUEST = 400
    UNAUTHORIZED = 401
    FORBIDDEN = 403
    NOT_FOUND = 404
    CONFLICT = 409
    TOO_LARGE = 413
    CORRUPT = 422
    ABORTED = 499
    """The other side went away mid-transfer (nothing was committed)."""
    BUSY = 503
    NO_SPACE = 507

    RETRYABLE: ClassVar[frozenset[int]] = frozenset({CONFLICT, BUSY, NO_SPACE})


class ProtocolError(RetryableError):
    """The peer broke the protocol or the connection; another attempt (or peer) may succeed."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class DataRequest(Message):
    KIND = "tierckpt.data-request"
    VERSION = 1

    op: Op
    token: str
    job: str
    rank: int
    step: int
    node: str = ""
    """The requesting node's name: with ``--auth tls`` it must be the one its certificate names."""
    commit_size: int = 0
    manifest_size: int = 0
    index: int = 0
    """``fragment``: the index of the erasure-coded fragment sent."""
    erasure_size: int = 0
    """``fragment``: bytes of the erasure manifest after the step's manifest."""
    base_rank: int = -1
    """``put``: a member of this rank's replica group whose committed step ``step`` the holder has with
    the same content key; it may link those data files instead of receiving them (-1: none)."""


@dataclasses.dataclass(frozen=True)
class DataReply(Message):
    KIND = "tierckpt.data-reply"
    VERSION = 1

    status: int
    message: str = ""
    commit_size: int = 0
    manifest_size: int = 0
    total_bytes: int = 0
    index: int = -1
    """``getfrag``: the index of the fragment that follows; ``fragment``: the index the holder holds
    (with 208, or 409 when it holds another one of the step); -1 otherwise."""
    erasure_size: int = 0
    linked: bool = False
    """``put`` continue: the data files were linked from ``base_rank``'s step; send the others only."""

    @property
    def ok(self) -> bool:
        return self.status in (Status.OK, Status.ALREADY, Status.CONTINUE)


@dataclasses.dataclass(frozen=True)
class ChannelHello(Message):
    """Each end's half of a sealed channel's keys, sent inside TLS (``channel``)."""

    KIND = "tierckpt.data-channel"
    VERSION = 1

    random: str
    """32 random bytes, in hex."""
    cipher: Literal["aes-256-gcm"] = "aes-256-gcm"


class Stream(Protocol):
    """What frames travel over: a socket (TLS or plain) or a ``channel.SealedChannel``."""

    def sendall(self, data: ReadableBuffer, /) -> None: ...

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = ..., /) -> int: ...

    def settimeout(self, value: float | None, /) -> None: ...


def send_frame(sock: Stream, msg: Message, payload: bytes = b"") -> None:
    body = msg.to_bytes()
    if len(body) > MAX_FRAME:
        raise FormatError(f"frame of {len(body)} bytes exceeds {MAX_FRAME}")
    sock.sendall(_HEADER.pack(MAGIC, len(body)) + body + payload)


def recv_exact(
    sock: Stream,
    n: int,
    *,
    deadline: Deadline | None = None,
    progress: Callable[[int], None] | None = None,
) -> bytes:
    """Exactly ``n`` bytes, or ``ProtocolError`` if the peer closes first. With ``deadline``, every
    byte must have arrived by then; ``progress`` hears each received byte count (``RateFloor``).
    Either raises ``TimeoutError``."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            deadline.arm(sock)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ProtocolError(f"connection closed after {got} of {n} bytes")
        got += k
        if progress is not None:
            progress(k)
    return bytes(buf)


def recv_frame(sock: Stream, cls: type[M], *, deadline: Deadline | None = None) -> M:
    """One frame decoded as ``cls``; a bad magic, size or body raises ``ProtocolError`` (status 400).
    With ``deadline`` the whole frame must have arrived by then (``TimeoutError``)."""
    return decode_frame(cls, recv_body(sock, deadline=deadline))


def recv_body(sock: Stream, *, deadline: Deadline | None = None) -> bytes:
    """One frame's body, not yet decoded (``recv_frame``)."""
    magic, size = _HEADER.unpack(recv_exact(sock, _HEADER.size, deadline=deadline))
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {magic!r}", Status.BAD_REQUEST)
    if size > MAX_FRAME:
        raise ProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}", Status.TOO_LARGE)
    return recv_exact(sock, size, deadline=deadline)


def decode_frame(cls: type[M], body: bytes) -> M:
    """A frame's body as ``cls``; ``ProtocolError`` (400) if it is not one."""
    try:
        return cls.from_bytes(body)
    except FormatError as exc:
        raise ProtocolError(f"malformed {cls.KIND}: {exc}", Status.BAD_REQUEST) from exc
