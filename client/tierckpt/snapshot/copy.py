"""Moving tensor bytes into mapped data files, and checksumming them there.

``copy_into`` is the only code on the training thread's critical path: one ``copy_`` per tensor
into its typed view of the mapping (CUDA sources asynchronously on side streams, CPU sources with
one ``torch._foreach_copy_``). ``region_crcs`` and ``file_crc`` run in the background, reading the
mapped memory in place (``integrity.crc32c_address``: no copy, GIL released), large regions split
across threads.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Sequence

import torch

from tierckpt import cuda
from tierckpt.integrity import crc32c_address, crc32c_combine

__all__ = ["CHUNK", "copy_into", "file_crc", "region_crcs", "write_tensors"]

CHUNK = 64 << 20
"""Regions larger than this are checksummed in chunks on several threads, then combined."""
_DIRECT = 1 << 20
"""In ``file_crc``, regions below this size are re-read rather than combined (cheaper)."""


def copy_into(views: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> cuda.CopyTicket | None:
    """Copy ``tensors[i]`` into ``views[i]``. CPU copies are done on return; CUDA copies are queued
    on side streams and complete with the returned ticket (None when no tensor is on a GPU)."""
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
        ticket = cuda.copy_to_host(gpu_dst, gpu_src) if gpu_src else None
        if cpu_src:
            try:
                torch._foreach_copy_(cpu_dst, cpu_src)
            except (RuntimeError, TypeError, AttributeError):
                for dst, src in zip(cpu_dst, cpu_src, strict=True):
                    dst.copy_(src)
    return ticket


def region_crcs(regions: Sequence[tuple[int, int]], *, workers: int | None = None) -> list[int]:
    """crc32c of each ``(address, length)`` memory region.

    Regions over ``CHUNK`` bytes are split and checksummed on up to ``workers`` threads, then
    combined; the rest are done on the calling thread.
    """
    workers = workers or min(8, max(1, (os.cpu_count() or 2) // 2))
    out = [0] * len(regions)
    big = [i for i, (_, n) in enumerate(regions) if n > CHUNK]
    if workers == 1 or not big:
        return [crc32c_address(a, n) for a, n in regions]
    pieces = [
        (i, start, min(CHUNK, regions[i][1] - start)) for i in big for start in range(0, regions[i][1], CHUNK)
    ]
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tierckpt-crc") as pool:
        futures = [pool.submit(crc32c_address, regions[i][0] + start, n) for i, start, n in pieces]
        big_set = set(big)
        for i, (address, length) in enumerate(regions):
            if i not in big_set:
                out[i] = crc32c_address(address, length)
        for (i, _, n), future in zip(pieces, futures, strict=True):
            out[i] = crc32c_combine(out[i], future.result(), n)
    return out


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
