"""Moving tensor bytes into (and out of) mapped data files, and checksumming them there.

``copy_into`` is the only code on the training thread's critical path. CUDA sources are copied
asynchronously on side streams (``tierckpt.cuda``). CPU sources are copied by ``copy_cpu``: large
contiguous tensors as plain ``memmove`` pieces spread over a few threads (ctypes releases the GIL),
everything else with one ``torch._foreach_copy_``. Splitting the bytes explicitly keeps the copy near
memcpy speed even when the node's cores are oversubscribed, where one OpenMP fork/join per tensor
(what ``copy_`` does for each large tensor) costs several times the copy itself.

``region_crcs`` and ``file_crc`` run in the background, reading the mapped memory in place
(``integrity.crc32c_address``: no copy, GIL released), on the checksum pool (``checksum``).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Iterator, Sequence

import torch

from tierckpt import cuda
from tierckpt.protocol.integrity import crc32c_address, crc32c_combine
from tierckpt.snapshot.checksum import region_crcs
from tierckpt.snapshot.cpus import cpu_share

__all__ = ["copy_cpu", "copy_into", "file_crc", "memmove", "region_crcs", "write_tensors"]

_DIRECT = 1 << 20
"""In ``file_crc``, regions below this size are re-read rather than combined (cheaper)."""
_MEMMOVE_MIN = 1 << 20
"""CPU tensors from this size on are copied as raw memmove pieces on the copy threads."""
_PIECE_MIN = 8 << 20

_copy_pool: concurrent.futures.ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()


def _copy_workers() -> int:
    return min(8, cpu_share())


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None:
            helpers = max(1, _copy_workers() - 1)
            _copy_pool = concurrent.futures.ThreadPoolExecutor(helpers, thread_name_prefix="tierckpt-copy")
        return _copy_pool


def _forget_pool_after_fork() -> None:
    global _copy_pool, _copy_pool_lock
    _copy_pool, _copy_pool_lock = None, threading.Lock()  # the parent's threads do not exist here


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _raw_copyable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (
        src.dtype == dst.dtype
        and src.is_contiguous()
        and dst.is_contiguous()
        and not src.is_conj()
        and not src.is_neg()
        and src.numel() * src.element_size() >= _MEMMOVE_MIN
    )


def _drain(pieces: Iterator[tuple[int, int, int]], lock: threading.Lock) -> None:
    while True:
        with lock:
            piece = next(pieces, None)
        if piece is None:
            return
        ctypes.memmove(*piece)


def memmove(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` of raw memory in pieces spread over the copy threads (GIL released)."""
    workers = _copy_workers()
    step = max(_PIECE_MIN, -(-nbytes // workers))
    queue, lock = (
        iter([(dst + o, src + o, min(step, nbytes - o)) for o in range(0, nbytes, step)]),
        threading.Lock(),
    )
    futures = [_pool().submit(_drain, queue, lock) for _ in range(min(workers, -(-nbytes // step)) - 1)]
    _drain(queue, lock)
    for f in futures:
        f.result()


def copy_cpu(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for CPU pairs of equal shape and dtype, as fast as memory allows.

    Large contiguous tensors are cut into pieces that the calling thread and ``workers - 1`` helper
    threads ``memmove`` in parallel; the rest goes through one ``torch._foreach_copy_`` meanwhile.
    """
    pieces: list[tuple[int, int, int]] = []
    small_dst: list[torch.Tensor] = []
    small_src: list[torch.Tensor] = []
    workers = _copy_workers()
    for dst, src in zip(dsts, srcs, strict=True):
        if _raw_copyable(dst, src):
            n = src.numel() * src.element_size()
            step = max(_PIECE_MIN, -(-n // workers))
            d, s = dst.data_ptr(), src.data_ptr()
            pieces.extend((d + o, s + o, min(step, n - o)) for o in range(0, n, step))
        elif src.numel():
            small_dst.append(dst)
            small_src.append(src)
    queue, lock = iter(pieces), threading.Lock()
    helpers = min(workers - 1, len(pieces) - 1)
    futures = [_pool().submit(_drain, queue, lock) for _ in range(max(0, helpers))]
    with torch.no_grad():
        if small_src:
            try:
                torch._foreach_copy_(small_dst, small_src)
            except (RuntimeError, TypeError, AttributeError):
                for dst, src in zip(small_dst, small_src, strict=True):
                    dst.copy_(src)
    _drain(queue, lock)
    for f in futures:
        f.result()


def copy_into(
    views: Sequence[torch.Tensor],
    tensors: Sequence[torch.Tensor],
    *,
    packed: Sequence[cuda.PackedCopy] = (),
) -> cuda.CopyTicket | None:
    """Copy ``tensors[i]`` into ``views[i]``. CPU copies are done on return; CUDA copies (and the
    ``packed`` runs of small CUDA tensors) are queued on side streams and complete with the
    returned ticket (None when no tensor is on a GPU)."""
    cpu_dst, cpu_src, gpu_dst, gpu_src = [], [], [], []
    for dst, src in zip(views, tensors, strict=True):
        if src.numel() == 0:
            continue
        if cuda.is_cuda(src):
            gpu_dst.append(dst)
            gpu_src.append(src)
        else:
            cpu_dst.append(dst)
            cpu_src.append(src)
    with torch.no_grad():
        ticket = cuda.copy_to_host(gpu_dst, gpu_src, packed) if gpu_src or packed else None
    if cpu_src:
        copy_cpu(cpu_dst, cpu_src)
    return ticket


def file_crc(address: int, size: int, regions: Sequence[tuple[int, int, int]]) -> int:
    """crc32c of a whole mapped file from its ``(offset, length, crc)`` tensor regions, sorted by offset.

    Large regions are folded in by ``crc32c_combine``; everything between them (small tensors and
    padding) is read directly, which costs less than combining many small parts.
    """
    crc, pos = 0, 0
    for offset, length, region_crc in regions:
        if length >= _DIRECT:
            crc = crc32c_address(address + pos, offset - pos, crc)
            crc = crc32c_combine(crc, region_crc, length)
            pos = offset + length
    return crc32c_address(address + pos, size - pos, crc)


def write_tensors(
    views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor], *, workers: int | None = None
) -> list[int]:
    """Copy tensors into their views, wait for the copies, and return each view's crc32c.

    The one-call building block for adapters: ``views`` come from ``Slot.views(plan)``.
    """
    ticket = copy_into(views, tensors)
    if ticket is not None:
        ticket.synchronize()
    return region_crcs([(v.data_ptr(), v.numel() * v.element_size()) for v in views], workers=workers)
