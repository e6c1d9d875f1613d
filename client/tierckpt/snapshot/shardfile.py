"""One data file of a step, mapped into memory: created preallocated, pre-faulted, optionally CUDA-pinned.

Space is reserved with ``posix_fallocate`` before anything is mapped, so a full ramdisk is an
``ENOSPC`` (``RamdiskFullError``) up front instead of a SIGBUS in the middle of a copy. The mapping
is then populated (``MADV_POPULATE_WRITE``, or touching each page on older kernels), so copies into
it never fault. A ``MappedFile`` keeps its mapping when the file is renamed (the mapping follows the
inode), which is how data files are recycled from a retired step into a new one.

Pre-faulting is the one-time cost of a slot (docs/client.md, "Warm-up"). ``MADV_POPULATE_WRITE`` is
issued through ctypes, which releases the GIL (``mmap.madvise`` holds it for the whole call, so a
background warm-up would freeze the training thread), in 64 MiB pieces spread over a few threads:
zeroing fresh tmpfs pages is the cost, and it scales with cores. Mappings are advised
``MADV_HUGEPAGE`` first, which a tmpfs mounted ``huge=advise`` honours; a ``huge=within_size`` mount
(the chart's and the rig's default) uses 2 MiB pages anyway.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from tierckpt import cuda
from tierckpt.protocol.errors import RamdiskFullError
from tierckpt.snapshot.cpus import cpu_share, lower_priority

__all__ = ["MappedFile", "allocate"]

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_HUGE = 2 << 20
_PIECE = 64 << 20
"""Pre-fault granularity: a multiple of the huge page size, large enough that a call costs nothing."""
_PARALLEL_MIN = 256 << 20
"""Mappings smaller than this are pre-faulted by the calling thread alone."""

_libc: ctypes.CDLL | None = None
_fault_pool: concurrent.futures.ThreadPoolExecutor | None = None
_fault_lock = threading.Lock()


def _madvise() -> ctypes._CFuncPtr:  # type: ignore[name-defined]
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def fault_workers() -> int:
    """Threads that pre-fault one mapping: half this trainer's CPUs, at most 8 (training keeps the rest)."""
    return min(8, max(1, cpu_share() // 2))


def _faulters() -> concurrent.futures.ThreadPoolExecutor:
    global _fault_pool
    with _fault_lock:
        if _fault_pool is None:
            _fault_pool = concurrent.futures.ThreadPoolExecutor(
                max(1, fault_workers() - 1), thread_name_prefix="tierckpt-fault", initializer=lower_priority
            )
        return _fault_pool


def _forget_pool_after_fork() -> None:
    global _fault_pool, _fault_lock
    _fault_pool, _fault_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _advise(address: int, length: int, advice: int) -> None:
    """``madvise`` through ctypes (GIL released); raises ``OSError`` with the errno on failure."""
    if _madvise()(address, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise({advice}): {os.strerror(err)}")


def _advise_pieces(address: int, length: int, advice: int) -> None:
    """``madvise`` of ``[address, address + length)`` in ``_PIECE`` pieces over the fault threads."""
    if length < _PARALLEL_MIN or fault_workers() == 1:
        _advise(address, length, advice)
        return
    pieces = iter([(address + o, min(_PIECE, length - o)) for o in range(0, length, _PIECE)])
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                piece = next(pieces, None)
            if piece is None:
                return
            _advise(*piece, advice)

    futures = [_faulters().submit(drain) for _ in range(fault_workers() - 1)]
    error: BaseException | None = None
    try:
        drain()
    except BaseException as exc:  # let the helpers finish before reporting
        error = exc
    for f in futures:
        try:
            f.result()
        except BaseException as exc:
            error = error or exc
    if error is not None:
        raise error


def allocate(fd: int, offset: int, length: int, path: Path) -> None:
    """Reserve ``[offset, offset + length)`` of a file; a full filesystem raises ``RamdiskFullError``."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise RamdiskFullError(
                errno.ENOSPC, f"ramdisk full: cannot reserve {length} bytes for {path.name}", str(path)
            ) from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        log.warning("%s: fallocate unsupported (%s); a full disk may surface as SIGBUS", path, exc)
        os.ftruncate(fd, offset + length)


def _populate(mm: mmap.mmap, address: int, start: int, length: int, *, write: bool) -> None:
    """Fault in the pages of ``[start, start + length)`` now, so later copies never fault.

    ``address`` is where ``mm`` is mapped. Kernels without ``MADV_POPULATE_*`` (before 5.14) touch
    one byte per page instead (single-threaded, holding the GIL).
    """
    start_page = start - start % PAGE
    length += start - start_page
    if length <= 0:
        return
    with contextlib.suppress(OSError):  # a hint: refused where the kernel has no shmem THP
        _advise(address + start_page, length, _MADV_HUGEPAGE)
    try:
        _advise_pieces(address + start_page, length, _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ)
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS):
            raise
    pages = np.frombuffer(mm, dtype=np.uint8)[start_page : start_page + length : PAGE]
    if write:
        pages[:] = pages  # rewrite each page's first byte with itself: a write fault, content unchanged
    else:
        int(pages.sum())


_AHEAD_SPAN = 4 * cuda.REGISTER_PIECE
"""What ``_FaultAhead`` faults at a time: large enough for the fault threads to share it."""


class _FaultAhead:
    """Fault in ``[address, address + size)`` of ``mm`` on a thread of its own, in address order,
    ``_AHEAD_SPAN`` at a time (over the fault threads), so that pinning can follow right behind
    (``wait_for``) instead of waiting for the whole file."""

    def __init__(self, mm: mmap.mmap, address: int, size: int, *, write: bool) -> None:
        self._mm, self._address, self._size, self._write = mm, address, size, write
        self._cond = threading.Condition()
        self._done = 0
        """Bytes from the start that are faulted in (all of them once an error stopped the faulting)."""
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="tierckpt-fault-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        began = time.perf_counter()
        at = 0
        try:
            while at < self._size:
                end = (self._address + at) // _AHEAD_SPAN * _AHEAD_SPAN + _AHEAD_SPAN
                cut = min(self._size, end - self._address)
                _populate(self._mm, self._address, at, cut - at, write=self._write)
                at = cut
                with self._cond:
                    self._done = at
                    self._cond.notify_all()
        except BaseException as exc:
            with self._cond:
                self._error, self._done = exc, self._size  # nobody waits on a failed faulting
                self._cond.notify_all()
        self.seconds = time.perf_counter() - began

    def wait_for(self, address: int, length: int) -> None:
        """Until ``[address, address + length)`` is faulted in (or the faulting failed)."""
        end = address + length - self._address
        with self._cond:
            self._cond.wait_for(lambda: self._done >= end)

    def finish(self) -> None:
        """Wait for the rest; raise what stopped the faulting, if anything did."""
        self._thread.join()
        if self._error is not None:
            raise self._error


class MappedFile:
    """A data file and its ``MAP_SHARED`` mapping. Not thread-safe; one owner at a time."""

    def __init__(self, path: Path, fd: int, size: int, *, writable: bool) -> None:
        self.path = path
        self.size = size
        self.writable = writable
        self.registered = False
        self._pinned: list[int] = []
        self._register_lock = threading.Lock()  # registration may run on a background thread
        self._fd = fd
        self._mm: mmap.mmap | None = None
        self._buffer: torch.Tensor | None = None
        self.populated = False
        if size:
            self._map()

    # ---------------------------------------------------------------------------------- creation

    @classmethod
    def create(cls, path: Path, size: int, *, populate: bool = True) -> MappedFile:
        """A new file of ``size`` bytes, reserved, mapped and (``populate``) pre-faulted."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            allocate(fd, 0, size, path)
            f = cls(path, fd, size, writable=True)
            if populate:
                f.populate()
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return f

    @classmethod
    def open(cls, path: Path, *, writable: bool = True, populate: bool = True) -> MappedFile:
        """Map an existing file (read-write if ``writable`` and permitted, else read-only)."""
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except PermissionError:
            if not writable:
                raise
            fd, writable = os.open(path, os.O_RDONLY), False
        try:
            f = cls(path, fd, os.fstat(fd).st_size, writable=writable)
            if populate:
                f.populate()
        except BaseException:
            os.close(fd)
            raise
        return f

    def _map(self) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if self.writable else 0)
        self._mm = mmap.mmap(self._fd, self.size, mmap.MAP_SHARED, prot)

    def populate(self) -> None:
        """Fault in every page now (a no-op once done)."""
        if not self.populated and self._mm is not None:
            _populate(self._mm, self.address, 0, self.size, write=self.writable)
        self.populated = True

    @property
    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise ValueError(f"{self.path} is not mapped")
        return self._mm

    # ---------------------------------------------------------------------------------- access

    @property
    def buffer(self) -> torch.Tensor:
        """The whole file as a uint8 tensor sharing the mapping's memory."""
        if self._buffer is None:
            if self._mm is None:
                self._buffer = torch.empty(0, dtype=torch.uint8)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # read-only mappings: we never write through them
                    self._buffer = torch.frombuffer(self._mm, dtype=torch.uint8)
        return self._buffer

    @property
    def address(self) -> int:
        return self.buffer.data_ptr()

    def disk_size(self) -> int:
        """The file's current size on disk (differs from ``size`` only if someone else changed it)."""
        return os.fstat(self._fd).st_size

    def links(self) -> int:
        """The file's hard-link count: above 1 while another rank's step links it (never rewrite it then)."""
        return os.fstat(self._fd).st_nlink if self._fd >= 0 else 0

    def prepare(self, device: int | None = None, *, pace: Callable[[float], None] | None = None) -> float:
        """``populate`` and ``register`` at once: the pages are faulted on another thread, ahead of the
        pinning, which follows piece by piece (and pauses between pieces, ``pace``), so the two overlap
        instead of adding up. Returns the seconds the faulting took (0 when there was none)."""
        if self.populated or self._mm is None or not self.size or not cuda.available():
            self.populate()
            self.register(device, pace=pace)
            return 0.0
        ahead = _FaultAhead(self._mm, self.address, self.size, write=self.writable)
        try:
            self.register(device, pace=pace, before=ahead.wait_for)
        finally:
            ahead.finish()
        self.populated = True
        return ahead.seconds

    def register(
        self,
        device: int | None = None,
        *,
        pace: Callable[[float], None] | None = None,
        before: Callable[[int, int], None] | None = None,
    ) -> bool:
        """Pin the mapping for CUDA DMA (once), in ``device``'s context, piece by piece (``pace`` runs
        between pieces: ``cuda.register``); False when CUDA is unavailable or refuses, or the file is
        closed."""
        with self._register_lock:
            if not self.registered and self.size and self._mm is not None:
                self._pinned = cuda.register(
                    self.address,
                    self.size,
                    read_only=not self.writable,
                    device=device,
                    pace=pace,
                    before=before,
                )
                self.registered = bool(self._pinned)
            return self.registered

    def _unregister(self) -> None:
        """Unpin (caller holds ``_register_lock``)."""
        if self.registered:
            cuda.unregister(self._pinned)
            self._pinned = []
            self.registered = False

    def _drop_views(self) -> None:
        self._buffer = None

    # ---------------------------------------------------------------------------------- changes

    def resize(self, size: int, *, prepare_later: bool = False) -> None:
        """Grow (reserving and faulting only the new part) or shrink the file and its mapping, pinned
        again if it was; ``prepare_later``: neither fault nor pin (the caller calls ``prepare``)."""
        if size == self.size:
            return
        if not self.writable:
            raise ValueError(f"{self.path} is mapped read-only")
        was_registered = self.registered
        with self._register_lock:
            self._unregister()
        self._drop_views()
        old = self.size
        if size > old:
            allocate(self._fd, old, size - old, self.path)
        if self._mm is None:
            os.ftruncate(self._fd, size)
            self.size = size
            self._map()
        else:
            self._mm.resize(size)
            self.size = size
        if prepare_later:  # the caller faults and pins it all (``prepare``; present pages fault cheaply)
            self.populated = self.populated and size <= old
            return
        if size > old and self.populated:
            _populate(self._mapping, self.address, old, size - old, write=True)
        if was_registered:
            self.register()

    def zero(self, gaps: list[tuple[int, int]]) -> None:
        buf = self.buffer
        for offset, length in gaps:
            buf[offset : offset + length].zero_()

    def move(self, dest: Path) -> None:
        """Rename the file; the mapping stays valid (it follows the inode)."""
        os.rename(self.path, dest)
        self.path = dest

    def sync(self) -> None:
        """msync the mapping and fsync the file."""
        if self._mm is not None and self.writable:
            self._mm.flush()
        os.fsync(self._fd)

    def backs(self, path: Path) -> bool:
        """Whether this mapping is of the file now at ``path`` (not one replaced or removed since)."""
        if self._fd < 0:
            return False
        try:
            mine, there = os.fstat(self._fd), os.stat(path)
        except OSError:
            return False
        return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)

    def close(self, *, unlink: bool = False) -> None:
        """Unregister, unmap and close; optionally delete the file."""
        with self._register_lock:  # not while a background thread pins it
            self._unregister()
            self._drop_views()
            if self._mm is not None:
                try:
                    self._mm.close()
                except BufferError:
                    log.warning("%s: views of the mapping are still alive; leaving it mapped", self.path)
                self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __repr__(self) -> str:
        return f"MappedFile({str(self.path)!r}, size={self.size}, registered={self.registered})"
