"""Moving shard bytes with bounded memory and one pass of verification.

Sending (``send_file``): ``socket.sendfile`` (the kernel sends straight from the tmpfs page cache;
the default), or, with ``method="mmap"``, a read-only mapping handed to ``sendall`` in 4 MiB slices;
on a sealed channel (``channel``, mutual TLS) each 1 MiB record is encrypted straight from a read-only
mapping (encrypting from the page cache costs 0.25 CPU-s/GiB on the development VM, reading into a
block first 0.33); on a TLS socket (a peer that keeps to TLS records) the bytes are read into a 1 MiB
block and handed to ``ssl``. Measured on the development VM (2 vCPUs, Linux 6.18, veth;
bench/replicator_bench.py): sendfile moves a 256 MiB step 5-18% faster than the mapping (median 11%,
14 runs). Chunks let the token bucket and the progress callback act every few MiB.

Receiving (``receive_file``, ``copy_file``): the destination was preallocated
(``stepio.create_preallocated``: a full ramdisk fails before a byte is read). One thread
``recv_into``-s a 1 MiB block, takes its crc32c while it is in cache (C on its address: no copy, no
GIL) and ``pwrite``-s it into place: the two copies any receiver writing a file makes, plus the crc.
Works on TLS sockets. Receive loops measured side by side on the dev VM (256 MiB, veth; the
receiver's CPU-seconds per GiB into a small-page / a huge-page tmpfs; interleaved rounds under a
load average of 5 to 10, so ranges):

================================================  ============  ===========================================
receive loop                                      CPU-s/GiB     why it lost (or won)
================================================  ============  ===========================================
plain recv_into + pwrite, no crc (raw baseline)   0.64-0.68 /   the floor: TCP receive 0.22-0.25, page
                                                  0.27-0.29     allocation 0.27-0.29, copy 0.12-0.14
ring of 3 x 4 MiB, crc + pwrite on a 2nd thread   0.83-0.91 /   hand-offs between threads, 4 MiB blocks
(until 2026-11)                                   0.42-0.46     fall out of cache between the passes
**one thread, 1 MiB block (this module)**         0.65-0.74 /   = the floor + crc32c (0.04)
                                                  0.28
one thread, 256 KiB / 4 MiB block                 0.90 / 0.31   more calls / out of cache
recv_into a shared mapping of the file            0.98-1.05 /   tmpfs zeroes each page on its first
                                                  0.29-0.32     touch through a mapping, plus a fault
splice socket -> pipe (1 MiB) -> file, crc32c     0.84-0.94 /   no user-space copy, but the crc32c must
read back from a mapping (or pread)               0.26-0.31     read the pages back
================================================  ============  ===========================================

On a sealed channel ``recv_into`` opens each 1 MiB record straight into the block (AES-256-GCM,
about 0.1 CPU-s/GiB with the OpenSSL ``cryptography`` bundles), so the loop costs the plain one plus
the decryption. Over Python's ``ssl`` the same loop got one 16 KiB record per call (two ``recv``
system calls, and a crc32c, a ``pwrite`` and the callbacks each 16 KiB): 1.3-2.1 CPU-s/GiB against
0.5-0.7 sealed (docs/benchmarks.md, "Tier 2: the sealed channel").

So the receiver is at its floor: the data path's receiver spends what ``recv_into`` + ``pwrite`` spends
plus the crc32c (and, sealed, the decryption). What remains between it and raw TCP into the ramdisk is
the sender reading the ramdisk (``sendfile`` of small tmpfs pages: ~0.4 CPU-s/GiB against ~0.2 for a
cached buffer; sealed, the encryption) and the protocol's fixed costs (lease, header, commit). Ratios
and figures: docs/benchmarks.md.

Every function takes open descriptors, never paths: the callers open files through the job's
``Beneath`` (``tierckpt_replicator.stepio``), so no byte is read from or written to a file reached
through a symlink a pod planted.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import queue
import socket
import ssl
from collections.abc import Callable, Iterator
from typing import BinaryIO, Literal

from tierckpt.protocol.errors import FormatError, RamdiskFullError
from tierckpt.protocol.integrity import crc32c_address
from tierckpt_replicator.replication.channel import DataConnection, SealedChannel
from tierckpt_replicator.replication.throttle import TokenBucket
from tierckpt_replicator.replication.wire import ProtocolError, Stream

__all__ = [
    "BLOCK",
    "CHUNK",
    "SendMethod",
    "copy_file",
    "receive_file",
    "send_file",
]

CHUNK = 4 << 20
"""Bytes per send call (the token bucket and the progress callback see every few MiB)."""
BLOCK = 1 << 20
"""Receive block (and TLS send block): each is checksummed and written while it is in the CPU's cache."""

OnBytes = Callable[[int], None]
SendMethod = Literal["mmap", "sendfile"]


def _noop(_: int) -> None:
    pass


class _Buffer:
    """A reusable block buffer and its address (for crc32c without a copy). Kept warm between
    transfers: the data server runs each connection on a fresh thread."""

    _free: queue.SimpleQueue[_Buffer] = queue.SimpleQueue()

    def __init__(self) -> None:
        self.data = bytearray(BLOCK)
        self.view = memoryview(self.data)
        self.address = ctypes.addressof((ctypes.c_char * BLOCK).from_buffer(self.data))

    @classmethod
    @contextlib.contextmanager
    def borrowed(cls) -> Iterator[_Buffer]:
        try:
            buf = cls._free.get_nowait()
        except queue.Empty:
            buf = cls()
        try:
            yield buf
        finally:
            cls._free.put(buf)


# ------------------------------------------------------------------------------------ send


def send_file(
    sock: DataConnection,
    fd: int,
    size: int,
    *,
    where: str,
    bucket: TokenBucket | None = None,
    on_bytes: OnBytes = _noop,
    method: SendMethod = "sendfile",
) -> None:
    """Send exactly ``size`` bytes of the open file ``fd`` (``where`` names it in errors; it stays
    open); a file of another size raises ``FormatError``. On a TLS socket the bytes must pass through
    user space to be encrypted whatever ``method`` says: they are read into a block and sent from
    there (``SSLSocket.sendfile`` would go 8 KiB at a time, and a mapping could not be closed while a
    failed TLS send's traceback still holds a view of it); on a sealed channel they are encrypted
    from a read-only mapping."""
    with open(fd, "rb", buffering=0, closefd=False) as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise FormatError(f"{where}: {actual} bytes on disk, manifest says {size}")
        if size == 0:
            return
        if isinstance(sock, SealedChannel):
            _send_mapped(sock.send_record, f, size, bucket, on_bytes)
        elif isinstance(sock, ssl.SSLSocket):
            _send_read(sock, f, where, size, bucket, on_bytes)
        elif method == "sendfile":
            _send_spliced(sock, f, where, size, bucket, on_bytes)
        else:
            _send_mapped(sock.sendall, f, size, bucket, on_bytes)


def _send_mapped(
    send: Callable[[memoryview], None],
    f: BinaryIO,
    size: int,
    bucket: TokenBucket | None,
    on_bytes: OnBytes,
) -> None:
    """``send`` the file from a read-only mapping, ``CHUNK`` bytes a call (a sealed channel encrypts
    straight from the page cache, in records of up to 1 MiB)."""
    mm = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    try:
        with memoryview(mm) as view:
            for offset in range(0, size, CHUNK):
                n = min(CHUNK, size - offset)
                if bucket is not None:
                    bucket.take(n)
                send(view[offset : offset + n])
                on_bytes(n)
    finally:
        # A failed send leaves a slice of the mapping referenced by the exception's frames (ssl's
        # sendall is Python code): close() would raise BufferError over the real error. The mapping is
        # then unmapped when the exception is gone.
        with contextlib.suppress(BufferError):
            mm.close()


def _send_read(
    sock: socket.socket, f: BinaryIO, where: str, size: int, bucket: TokenBucket | None, on_bytes: OnBytes
) -> None:
    with _Buffer.borrowed() as buf:
        for offset in range(0, size, BLOCK):
            n = min(BLOCK, size - offset)
            if os.preadv(f.fileno(), [buf.view[:n]], offset) != n:
                raise FormatError(f"{where} shrank while being sent")
            if bucket is not None:
                bucket.take(n)
            sock.sendall(buf.view[:n])
            on_bytes(n)


def _send_spliced(
    sock: socket.socket, f: BinaryIO, where: str, size: int, bucket: TokenBucket | None, on_bytes: OnBytes
) -> None:
    offset = 0
    while offset < size:
        n = min(CHUNK, size - offset)
        if bucket is not None:
            bucket.take(n)
        sent = sock.sendfile(f, offset, n)
        if sent <= 0:
            raise ProtocolError(f"sendfile of {where} stalled at byte {offset}")
        offset += sent
        on_bytes(sent)


# ------------------------------------------------------------------------------------ receive


def _stream_into(
    read_into: Callable[[memoryview], int],
    fd: int,
    size: int,
    on_bytes: OnBytes,
    short: Callable[[int], Exception],
) -> int:
    """Read ``size`` bytes with ``read_into`` and ``pwrite`` them at their offsets in ``fd``, each block's
    crc32c taken while it is in cache; returns the crc32c of all. One thread, one copy into the buffer
    and one into the file (see the module docstring for what the alternatives cost). A source that ends
    early raises ``short(bytes missing)``."""
    crc, done = 0, 0
    with _Buffer.borrowed() as buf:
        while done < size:
            k = read_into(buf.view[: min(BLOCK, size - done)])
            if not k:
                raise short(size - done)
            crc = crc32c_address(buf.address, k, crc)
            try:
                _pwrite_all(fd, buf.view[:k], done)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise RamdiskFullError(f"ramdisk full while writing: {exc}") from exc
                raise
            done += k
            on_bytes(k)
    return crc


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def receive_file(
    sock: Stream,
    fd: int,
    size: int,
    *,
    where: str,
    on_bytes: OnBytes = _noop,
    pace: OnBytes | None = None,
) -> int:
    """Receive exactly ``size`` bytes into the open, preallocated file ``fd`` (``stepio.StepWriter``),
    fsync it, and return their crc32c (``where`` names the file in errors; it stays open). Works on
    anything with ``recv_into``: a socket, TLS (``ssl.SSLSocket``), a sealed channel. ``pace`` hears
    every ``recv``'s byte count before the bytes are written and may raise (``pacing.RateFloor``)."""
    if size == 0:
        return 0

    def recv_into(view: memoryview) -> int:
        k = sock.recv_into(view, len(view))
        if pace is not None and k:
            pace(k)
        return k

    crc = _stream_into(
        recv_into,
        fd,
        size,
        on_bytes,
        lambda missing: ProtocolError(f"connection closed inside {where} ({missing} bytes missing)"),
    )
    os.fsync(fd)
    return crc


def copy_file(src: int, dst: int, size: int, *, where: str, on_bytes: OnBytes = _noop) -> int:
    """Copy the open file ``src`` into the open, preallocated file ``dst``, fsync it, and return the
    crc32c read (``where`` names the source in errors; both stay open)."""
    actual = os.fstat(src).st_size
    if actual != size:
        raise FormatError(f"{where}: {actual} bytes on disk, manifest says {size}")
    if size == 0:
        return 0
    offset = 0

    def read_into(view: memoryview) -> int:
        nonlocal offset
        k = os.preadv(src, [view], offset)
        offset += k
        return k

    crc = _stream_into(
        read_into, dst, size, on_bytes, lambda _: FormatError(f"{where} shrank while being copied")
    )
    os.fsync(dst)
    return crc
