"""Parallel crc32c over mapped memory: per-region crcs (commit) and whole-file crcs (restore's fast check).

All work runs on one persistent pool of ``crc_threads()`` threads (``crc32c_address`` releases the
GIL, so they really run in parallel): the CPUs this process may use, shared with the other trainers of
the node (``LOCAL_WORLD_SIZE``), or ``TIERCKPT_CRC_THREADS``. Work is cut into chunks of
``chunk_bytes`` (8-32 MiB, sized so every thread gets several), and chunk crcs are folded together
with ``Combiner``: a precomputed "append n zero bytes" operator as four 256-entry tables, about a
microsecond per fold instead of a GF(2) matrix product per bit of the length.

``start_file_crcs`` returns at once with a ``PendingCrcs``: restore starts it *before* issuing its
host-to-device copies, so checksumming and DMA overlap, and calls ``result()`` after the copies.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Sequence

from tierckpt.protocol.integrity import crc32c_address, crc32c_combine
from tierckpt.snapshot.cpus import cpu_share, lower_priority

__all__ = ["Combiner", "PendingCrcs", "chunk_bytes", "crc_pool", "region_crcs", "start_file_crcs"]

MIN_CHUNK = 8 << 20
MAX_CHUNK = 32 << 20

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def crc_threads() -> int:
    """Checksum threads: ``TIERCKPT_CRC_THREADS``, else this process's share of its CPUs. Four trainers
    of a node each running a pool of every CPU would oversubscribe the CPUs and the memory bandwidth
    that their host-to-device copies need."""
    explicit = os.environ.get("TIERCKPT_CRC_THREADS", "")
    return int(explicit) if explicit.isdigit() and int(explicit) > 0 else cpu_share()


def crc_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The process-wide checksum pool (created on first use, ``crc_threads()`` threads)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(
                crc_threads(), thread_name_prefix="tierckpt-crc", initializer=lower_priority
            )
        return _pool


def _forget_pool_after_fork() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def chunk_bytes(total: int, workers: int | None = None) -> int:
    """A power-of-two chunk size giving each of ``workers`` threads about 8 chunks of ``total`` bytes."""
    want = max(1, total // (8 * (workers or crc_threads())))
    size = MIN_CHUNK
    while size < want and size < MAX_CHUNK:
        size <<= 1
    return size


class Combiner:
    """``crc32c_combine(a, b, length)`` for one fixed ``length``, by table lookup."""

    def __init__(self, length: int) -> None:
        self.length = length
        basis = [crc32c_combine(1 << bit, 0, length) for bit in range(32)]
        self._tables = []
        for k in range(4):
            table = [0] * 256
            for b in range(1, 256):
                low = b & -b
                table[b] = table[b ^ low] ^ basis[8 * k + low.bit_length() - 1]
            self._tables.append(table)

    def __call__(self, crc1: int, crc2: int) -> int:
        t0, t1, t2, t3 = self._tables
        return t0[crc1 & 255] ^ t1[(crc1 >> 8) & 255] ^ t2[(crc1 >> 16) & 255] ^ t3[crc1 >> 24] ^ crc2


@functools.lru_cache(maxsize=8)
def combiner(length: int) -> Combiner:
    return Combiner(length)


def _fold(crc: int, part: int, length: int, chunk: int) -> int:
    return combiner(chunk)(crc, part) if length == chunk else crc32c_combine(crc, part, length)


def _crc_many(regions: Sequence[tuple[int, int]], gate: threading.Semaphore | None = None) -> list[int]:
    if gate is None:
        return [crc32c_address(a, n) for a, n in regions]
    with gate:
        return [crc32c_address(a, n) for a, n in regions]


def region_crcs(regions: Sequence[tuple[int, int]], *, workers: int | None = None) -> list[int]:
    """crc32c of each ``(address, length)`` memory region, in parallel on the checksum pool.

    Large regions are split into chunks; small ones are batched into tasks of about a chunk each.
    At most ``workers`` threads (default: all CPUs) checksum at once; ``workers=1`` computes
    everything on the calling thread.
    """
    total = sum(n for _, n in regions)
    if workers == 1 or total < 2 * MIN_CHUNK:
        return _crc_many(regions)
    chunk = chunk_bytes(total, workers)
    pool = crc_pool()
    gate = threading.Semaphore(workers) if workers and workers < crc_threads() else None
    parts: list[list[tuple[int, concurrent.futures.Future[list[int]]]]] = [[] for _ in regions]
    batch: list[int] = []
    batch_bytes = 0

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            future = pool.submit(_crc_many, [regions[i] for i in batch], gate)
            for pos, i in enumerate(batch):
                parts[i].append((-1 - pos, future))
        batch, batch_bytes = [], 0

    for i, (address, length) in enumerate(regions):
        if length > chunk:
            for start in range(0, length, chunk):
                n = min(chunk, length - start)
                parts[i].append((n, pool.submit(_crc_many, [(address + start, n)], gate)))
            continue
        batch.append(i)
        batch_bytes += length
        if batch_bytes >= chunk:
            flush()
    flush()
    out = []
    for pieces in parts:
        crc = 0
        for tag, future in pieces:
            crc = future.result()[-1 - tag] if tag < 0 else _fold(crc, future.result()[0], tag, chunk)
        out.append(crc)
    return out


def _chunks(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(start, min(chunk, size - start)) for start in range(0, size, chunk)]


class PendingCrcs:
    """Whole-file crcs being computed on the checksum pool; ``result()`` waits and folds them."""

    def __init__(self, files: Sequence[tuple[int, int]], chunk: int) -> None:
        self.chunk = chunk
        pool = crc_pool()
        self._parts = [
            [(n, pool.submit(crc32c_address, address + start, n)) for start, n in _chunks(size, chunk)]
            for address, size in files
        ]

    def result(self) -> list[int]:
        out = []
        for pieces in self._parts:
            crc = 0
            for length, future in pieces:
                crc = _fold(crc, future.result(), length, self.chunk)
            out.append(crc)
        return out

    def abandon(self) -> None:
        """Cancel what has not started and wait for what has (the memory must outlive the readers)."""
        futures = [future for pieces in self._parts for _, future in pieces]
        running = [f for f in futures if not f.cancel()]
        concurrent.futures.wait(running)


def start_file_crcs(files: Sequence[tuple[int, int]]) -> PendingCrcs:
    """Start checksumming whole mapped files ``(address, size)``; returns at once."""
    return PendingCrcs(files, chunk_bytes(sum(n for _, n in files)))
