"""Moving shard bytes with bounded memory: sendfile out of tmpfs, recv_into a mapped destination.

Sending never copies through user space (``socket.sendfile``), in chunks so the token bucket and the
progress callback see every few MiB. Receiving preallocates the destination (so a full ramdisk fails
at once, before a byte is read), maps it, and ``recv_into``-s straight into the mapped pages; a second
thread computes the crc32c of each finished chunk meanwhile (google-crc32c releases the GIL), so the
crc costs no extra pass and the file is never held in RAM twice.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from tierckpt.errors import FormatError, RamdiskFullError
from tierckpt.integrity import crc32c_address

from tierckpt_replicator.replication.throttle import TokenBucket
from tierckpt_replicator.replication.wire import ProtocolError

__all__ = ["CHUNK", "copy_file", "create_preallocated", "preallocate", "receive_file", "send_file"]

CHUNK = 4 << 20
_INLINE_CRC = 2 * CHUNK

OnBytes = Callable[[int], None]


def _noop(_: int) -> None:
    pass


def send_file(
    sock: socket.socket,
    path: Path,
    size: int,
    *,
    bucket: TokenBucket | None = None,
    on_bytes: OnBytes = _noop,
) -> None:
    """Send exactly ``size`` bytes of ``path``; a file of another size raises ``FormatError``."""
    with open(path, "rb", buffering=0) as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise FormatError(f"{path}: {actual} bytes on disk, manifest says {size}")
        offset = 0
        while offset < size:
            n = min(CHUNK, size - offset)
            if bucket is not None:
                bucket.take(n)
            sent = sock.sendfile(f, offset, n)
            if sent <= 0:
                raise ProtocolError(f"sendfile of {path} stalled at byte {offset}")
            offset += sent
            on_bytes(sent)


def preallocate(fd: int, size: int, path: Path) -> None:
    """Reserve ``size`` bytes now; ENOSPC becomes ``RamdiskFullError``."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RamdiskFullError(f"no room for {size} bytes at {path}") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _address(mm: mmap.mmap) -> int:
    """Base address of a writable mapping (the temporary ctypes view is dropped at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


class _CrcThread:
    """crc32c of regions fed in order, computed on a helper thread while the next chunk arrives."""

    def __init__(self) -> None:
        self.crc = 0
        self._q: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="crc32c", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (region := self._q.get()) is not None:
            self.crc = crc32c_address(region[0], region[1], self.crc)

    def feed(self, address: int, length: int) -> None:
        self._q.put((address, length))

    def finish(self) -> int:
        self._q.put(None)
        self._thread.join()
        return self.crc


def create_preallocated(path: Path, size: int) -> None:
    """Create ``path`` holding ``size`` reserved bytes (``RamdiskFullError`` if they do not fit)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        preallocate(fd, size, path)
    finally:
        os.close(fd)


def receive_file(sock: socket.socket, path: Path, size: int, *, on_bytes: OnBytes = _noop) -> int:
    """Receive exactly ``size`` bytes into ``path`` (made by ``create_preallocated``); return their crc32c."""
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(fd, size, flags=flags) as mm:
            crc = _receive_into(sock, mm, size, on_bytes)
        os.fsync(fd)
        return crc
    finally:
        os.close(fd)


def _receive_into(sock: socket.socket, mm: mmap.mmap, size: int, on_bytes: OnBytes) -> int:
    helper = _CrcThread() if size > _INLINE_CRC else None
    base, crc, pos = _address(mm), 0, 0
    try:
        with memoryview(mm) as view:
            while pos < size:
                start, end = pos, min(pos + CHUNK, size)
                while pos < end:
                    k = sock.recv_into(view[pos:end])
                    if k == 0:
                        raise ProtocolError(f"connection closed after {pos} of {size} bytes")
                    pos += k
                    on_bytes(k)
                if helper is not None:
                    helper.feed(base + start, end - start)
                else:
                    crc = crc32c_address(base + start, end - start, crc)
    finally:
        if helper is not None:
            crc = helper.finish()  # the mapping stays open until the helper is done with it
    return crc


def copy_file(src: Path, dst: Path, size: int, *, on_bytes: OnBytes = _noop) -> int:
    """Copy ``src`` into ``dst`` (made by ``create_preallocated``) chunk by chunk; return the crc32c read."""
    actual = os.path.getsize(src)
    if actual != size:
        raise FormatError(f"{src}: {actual} bytes on disk, manifest says {size}")
    if size == 0:
        return 0
    crc = 0
    with open(src, "rb") as fin, open(dst, "r+b") as fout:
        with (
            mmap.mmap(fin.fileno(), size, access=mmap.ACCESS_COPY) as smm,
            mmap.mmap(fout.fileno(), size) as dmm,
        ):
            base = _address(dmm)
            with memoryview(smm) as sview, memoryview(dmm) as dview:
                for start in range(0, size, CHUNK):
                    end = min(start + CHUNK, size)
                    dview[start:end] = sview[start:end]
                    crc = crc32c_address(base + start, end - start, crc)
                    on_bytes(end - start)
        os.fsync(fout.fileno())
    return crc
