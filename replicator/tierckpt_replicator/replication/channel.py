"""The sealed channel: a data connection's bytes in AES-256-GCM records of up to 1 MiB, under keys the
two ends agree inside their mutual TLS session (spec: docs/replicator.md, "Sealed channel").

Why not TLS records all the way: Python's ``ssl`` hands over one 16 KiB TLS record per call (two
``recv`` system calls each, a 256 MiB step is 16,384 calls a side) and encrypts with the system's
OpenSSL (3.0 here: AES-256-GCM at about 0.26 CPU-s/GiB). ``cryptography``'s AEAD, with the OpenSSL it
bundles (AVX-512/VAES code paths), seals a 1 MiB record in one call at about 0.1 CPU-s/GiB. Kernel TLS
would give the same, but needs Python 3.12, an OpenSSL built for it and the kernel's ``tls`` module
(docs/benchmarks.md: not there on the development VM). Measured: docs/benchmarks.md, "Tier 2".

How (``open_channel`` on the client, ``accept_channel`` on the server):

1. The TLS 1.3 handshake, mutual, exactly as before (``context.connect``, ``context.secure``): both
   identities are proven before anything else is sent.
2. Inside TLS the client sends a ``ChannelHello`` frame with 32 random bytes; the server answers with
   its own (or a ``DataReply`` error).
3. Both end TLS (``SSLSocket.unwrap``: ``close_notify`` each way) and go on over the same TCP
   connection.
4. Keys: HKDF-SHA256 over the client's random and the server's, one per direction and per 2^16
   records (64 GiB of 1 MiB records, far inside AES-GCM's limits; TLS 1.3's key update serves alike).
   Only the two ends ever saw the randoms (inside TLS), both contributed, and no key outlives its
   connection, so no nonce repeats under a key.
5. Every record: the plaintext length (4 bytes, big-endian, ``1..limit``), the AES-256-GCM ciphertext
   and its 16-byte tag; the length is the associated data and the nonce is the record's sequence
   number in its direction. A record that fails to open (a byte flipped, a record dropped, reordered,
   replayed or cut short), a length out of bounds or a connection closed inside a record raises
   ``ProtocolError``: the transfer is aborted and nothing is committed, as on any broken connection.
   A connection that ends between records reads as the end of the stream, as TLS's did here (the
   protocol's messages and files have sizes, so a cut there is caught by what was expected).

A server takes records of at most ``FRAME_RECORD`` (64 KiB: a frame) until the request is authorized
(``allow_bulk``), so what an unauthorized peer can make it hold stays what it was. Frames (``sendall``)
go in records of at most ``FRAME_RECORD``; file bytes (``send_record``) in records of up to
``RECORD``, which ``recv_into`` opens straight into the caller's block when they fit (the receive
loop's 1 MiB block: no copy beyond the decryption).
"""

from __future__ import annotations

import secrets
import socket
import ssl
import struct
import time
from types import TracebackType
from typing import TYPE_CHECKING, TypeAlias

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from tierckpt.protocol.errors import FormatError
from tierckpt_replicator.replication.pacing import Deadline
from tierckpt_replicator.replication.wire import (
    ChannelHello,
    DataReply,
    ProtocolError,
    Status,
    decode_frame,
    recv_body,
    send_frame,
)

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

__all__ = [
    "FRAME_RECORD",
    "RECORD",
    "DataConnection",
    "SealedChannel",
    "accept_channel",
    "is_hello",
    "open_channel",
]

RECORD = 1 << 20
"""Largest record: one receive block of file bytes."""
FRAME_RECORD = 64 << 10
"""Largest record of a frame, and of anything a server takes before the request is authorized."""
TAG = 16
EPOCH_RECORDS = 1 << 16
"""Records under one key, per direction."""
_LENGTH = struct.Struct("!I")
_SALT = b"tierckpt data channel v1"
_RANDOM = 32


class SealedChannel:
    """A connected TCP socket whose bytes are sealed records (module docstring). Socket-like for what
    the data plane uses: ``sendall``, ``recv_into``, ``recv``, timeouts, ``shutdown``, ``close``; plus
    ``send_record`` for file bytes. One thread at a time per direction."""

    def __init__(
        self, sock: socket.socket, ikm: bytes, *, server: bool, limit: int = RECORD, timeout: float | None
    ) -> None:
        self._sock = sock
        self._ikm = ikm
        self._send_role, self._recv_role = (b"server", b"client") if server else (b"client", b"server")
        self._send_seq = self._recv_seq = 0
        self._send_key = self._key(self._send_role, 0)
        self._recv_key = self._key(self._recv_role, 0)
        self.limit = limit
        self._timeout = timeout
        self._out = bytearray()
        self._in = bytearray()
        self._plain = bytearray()
        self._start = self._end = 0  # what is left of the last record opened into ``_plain``

    # ------------------------------------------------------------------ socket-like

    def settimeout(self, value: float | None) -> None:
        """Each ``recv_into`` / ``recv`` / ``sendall`` / ``send_record`` call, all its records
        included, must be done within ``value`` seconds (``TimeoutError``); ``None``: no limit."""
        self._timeout = value

    def gettimeout(self) -> float | None:
        return self._timeout

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> SealedChannel:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def allow_bulk(self) -> None:
        """Take records of up to ``RECORD`` from now on (the server, once the request is authorized)."""
        self.limit = RECORD

    # ------------------------------------------------------------------ send

    def sendall(self, data: ReadableBuffer) -> None:
        """Send ``data`` in records of at most ``FRAME_RECORD``."""
        self._send(memoryview(data).cast("B"), FRAME_RECORD)

    def send_record(self, data: ReadableBuffer) -> None:
        """Send ``data`` (file bytes, at most ``RECORD`` of them to be opened in one piece) in records of
        up to ``RECORD``."""
        self._send(memoryview(data).cast("B"), RECORD)

    def _send(self, view: memoryview, most: int) -> None:
        deadline = self._deadline()
        for offset in range(0, len(view), most):
            part = view[offset : offset + most]
            n = len(part)
            if len(self._out) < n + _LENGTH.size + TAG:
                self._out = bytearray(max(n, FRAME_RECORD) + _LENGTH.size + TAG)
            out = memoryview(self._out)
            _LENGTH.pack_into(out, 0, n)
            length = bytes(out[: _LENGTH.size])
            self._send_key.encrypt_into(
                _nonce(self._send_seq), part, length, out[_LENGTH.size : _LENGTH.size + n + TAG]
            )
            self._advance_send()
            self._arm(deadline)
            self._sock.sendall(out[: _LENGTH.size + n + TAG])

    def _advance_send(self) -> None:
        self._send_seq += 1
        if self._send_seq % EPOCH_RECORDS == 0:
            self._send_key = self._key(self._send_role, self._send_seq // EPOCH_RECORDS)

    # ------------------------------------------------------------------ receive

    def recv_into(self, buffer: WriteableBuffer, nbytes: int = 0, /) -> int:
        """Up to ``nbytes`` (0: the buffer's length) plaintext bytes into ``buffer``; 0 at the end of
        the stream. A record that fits is opened straight into ``buffer``."""
        view = memoryview(buffer).cast("B")
        want = min(nbytes or len(view), len(view))
        if want <= 0:
            return 0
        if self._start < self._end:
            return self._take(view, want)
        deadline = self._deadline()
        n = self._next_length(deadline)
        if n == 0:
            return 0
        sealed = self._read_sealed(n, deadline)
        if n <= want:
            self._open(sealed, n, view[:n])
            return n
        if len(self._plain) < n:
            self._plain = bytearray(max(n, FRAME_RECORD))
        self._open(sealed, n, memoryview(self._plain)[:n])
        self._start, self._end = 0, n
        return self._take(view, want)

    def recv(self, bufsize: int, /) -> bytes:
        buf = bytearray(bufsize)
        return bytes(buf[: self.recv_into(buf)])

    def _take(self, view: memoryview, want: int) -> int:
        k = min(want, self._end - self._start)
        view[:k] = memoryview(self._plain)[self._start : self._start + k]
        self._start += k
        return k

    def _next_length(self, deadline: float | None) -> int:
        """The next record's length; 0 when the peer ended the stream between records."""
        head = bytearray(_LENGTH.size)
        got = self._fill(memoryview(head), deadline)
        if got == 0:
            return 0
        if got < len(head):
            raise ProtocolError(f"connection closed inside sealed record {self._recv_seq}'s length")
        n: int = _LENGTH.unpack(head)[0]
        if not 0 < n <= self.limit:
            raise ProtocolError(f"sealed record of {n} bytes (1..{self.limit} allowed)", Status.TOO_LARGE)
        return n

    def _read_sealed(self, n: int, deadline: float | None) -> memoryview:
        if len(self._in) < n + TAG:
            self._in = bytearray(max(n, FRAME_RECORD) + TAG)
        sealed = memoryview(self._in)[: n + TAG]
        if self._fill(sealed, deadline) < n + TAG:
            raise ProtocolError(f"connection closed inside sealed record {self._recv_seq}")
        return sealed

    def _open(self, sealed: memoryview, n: int, into: memoryview) -> None:
        try:
            self._recv_key.decrypt_into(_nonce(self._recv_seq), sealed, _LENGTH.pack(n), into)
        except InvalidTag:
            raise ProtocolError(
                f"sealed record {self._recv_seq} failed authentication (altered, dropped, reordered "
                "or replayed)"
            ) from None
        self._recv_seq += 1
        if self._recv_seq % EPOCH_RECORDS == 0:
            self._recv_key = self._key(self._recv_role, self._recv_seq // EPOCH_RECORDS)

    def _fill(self, view: memoryview, deadline: float | None) -> int:
        """Fill ``view`` from the socket; returns the bytes read (fewer only if the peer closed)."""
        got = 0
        while got < len(view):
            self._arm(deadline)
            k = self._sock.recv_into(view[got:])
            if k == 0:
                break
            got += k
        return got

    # ------------------------------------------------------------------ keys and time

    def _key(self, role: bytes, epoch: int) -> AESGCM:
        info = b"%s %d" % (role, epoch)
        return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=_SALT, info=info).derive(self._ikm))

    def _deadline(self) -> float | None:
        return None if self._timeout is None else time.monotonic() + self._timeout

    def _arm(self, deadline: float | None) -> None:
        if deadline is None:
            self._sock.settimeout(None)
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"sealed channel: no progress within {self._timeout:g}s")
        self._sock.settimeout(left)


def _nonce(seq: int) -> bytes:
    return seq.to_bytes(12, "big")


DataConnection: TypeAlias = socket.socket | SealedChannel
"""What the data plane's handlers and transfers talk through: a sealed channel (mutual TLS, the
default), a TLS socket (a peer that asked for TLS records throughout) or plain TCP (``--auth token``)."""


# ------------------------------------------------------------------------------ setting one up


def open_channel(tls: ssl.SSLSocket) -> SealedChannel:
    """The client side, right after a verified TLS handshake (the socket's timeout bounds each step).
    A peer that refuses (an older replicator answers ``400``) raises ``ProtocolError``."""
    mine = secrets.token_bytes(_RANDOM)
    send_frame(tls, ChannelHello(random=mine.hex()))
    body = recv_body(tls)
    try:
        theirs = _random_of(decode_frame(ChannelHello, body))
    except ProtocolError:
        reply = decode_frame(DataReply, body)
        raise ProtocolError(
            f"the peer refused a sealed channel ({reply.status}): {reply.message}", reply.status
        ) from None
    return _unwrapped(tls, mine + theirs, server=False, limit=RECORD)


def accept_channel(conn: socket.socket, hello: ChannelHello, deadline: Deadline) -> SealedChannel:
    """The server side, ``hello`` being the client's first frame; all of it by ``deadline``. The
    channel takes frame-sized records until ``allow_bulk``."""
    if not isinstance(conn, ssl.SSLSocket):
        raise ProtocolError("a sealed channel needs mutual TLS (this node runs --auth token)")
    theirs = _random_of(hello)
    mine = secrets.token_bytes(_RANDOM)
    deadline.arm(conn)
    send_frame(conn, ChannelHello(random=mine.hex()))
    deadline.arm(conn)
    return _unwrapped(conn, theirs + mine, server=True, limit=FRAME_RECORD)


def is_hello(body: bytes) -> ChannelHello | None:
    """The client's first frame as a ``ChannelHello``, or None (a request: the peer keeps to TLS)."""
    try:
        return ChannelHello.from_bytes(body)
    except FormatError:
        return None


def _random_of(hello: ChannelHello) -> bytes:
    try:
        value = bytes.fromhex(hello.random)
    except ValueError:
        value = b""
    if len(value) != _RANDOM:
        raise ProtocolError(f"channel hello: random must be {_RANDOM} bytes in hex", Status.BAD_REQUEST)
    return value


def _unwrapped(tls: ssl.SSLSocket, ikm: bytes, *, server: bool, limit: int) -> SealedChannel:
    """End TLS on ``tls`` (``close_notify`` both ways; nothing of what follows is read by it) and seal
    what follows on the same connection."""
    timeout = tls.gettimeout()
    tls.unwrap()
    raw = socket.socket(tls.family, tls.type, tls.proto, fileno=tls.detach())
    raw.settimeout(timeout)
    return SealedChannel(raw, ikm, server=server, limit=limit, timeout=timeout)
