"""Tensor bytes in and out of step files: zero-copy views, positional writes, mapped reads, crc32c.

Writes go straight from the tensor's memory to the file with ``os.pwrite`` (no pickling, no staging
buffer); the crc32c is computed in place and without the GIL (``integrity.crc32c_address``). Reads map
the file and copy each item's bytes once, into the destination tensor.
"""

from __future__ import annotations

import contextlib
import errno
import io
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tierckpt.errors import RamdiskFullError
from tierckpt.integrity import crc32c, crc32c_address

from ._layout import Slot

__all__ = ["MappedFile", "as_bytes", "write_files"]

Payload = torch.Tensor | bytes
"""A 1-D uint8 CPU tensor viewing the item's bytes, or the bytes of a pickled object."""


def as_bytes(data: torch.Tensor | io.BytesIO) -> Payload:
    """The bytes to store for a resolved DCP item: dense CPU bytes of a tensor, or a BytesIO's content."""
    if isinstance(data, io.BytesIO):
        return data.getvalue()
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _crc_and_view(payload: Payload) -> tuple[int, memoryview]:
    if isinstance(payload, bytes):
        return crc32c(payload), memoryview(payload)
    crc = crc32c_address(payload.data_ptr(), payload.numel())
    return crc, memoryview(payload.numpy())


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_file(
    path: Path, size: int, slots: Sequence[Slot], resolve: Callable[[Slot], Payload], sync: bool
) -> dict[int, int]:
    """Write one data file; returns item -> crc32c."""
    crcs = {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.ftruncate(fd, size)
        for slot in slots:
            payload = resolve(slot)
            if len(payload) != slot.length:
                raise ValueError(f"item {slot.item} has {len(payload)} bytes, not the {slot.length} planned")
            crc, view = _crc_and_view(payload)
            _pwrite_all(fd, view, slot.offset)
            crcs[slot.item] = crc
            del payload, view
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return crcs


def write_files(
    paths: Sequence[Path],
    sizes: Sequence[int],
    slots_per_file: Sequence[Sequence[Slot]],
    resolve: Callable[[Slot], Payload],
    *,
    sync: bool = True,
) -> dict[int, int]:
    """Write the data files in parallel (one thread per file); item -> crc32c.

    ``ENOSPC`` becomes ``RamdiskFullError``; the caller removes the partial step.
    """
    jobs = list(zip(paths, sizes, slots_per_file, strict=True))
    try:
        if len(jobs) <= 1:
            results = [_write_file(p, s, sl, resolve, sync) for p, s, sl in jobs]
        else:
            with ThreadPoolExecutor(len(jobs), thread_name_prefix="tierckpt-dcp-write") as pool:
                results = list(pool.map(lambda j: _write_file(*j, resolve, sync), jobs))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            where = paths[0].parent if paths else "?"
            raise RamdiskFullError(errno.ENOSPC, "ramdisk full while writing a DCP step", str(where)) from exc
        raise
    return {item: crc for r in results for item, crc in r.items()}


class MappedFile:
    """A data file mapped read-only (copy-on-write, never written) for zero-copy item reads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self._map = mmap.mmap(f.fileno(), self.size, access=mmap.ACCESS_COPY) if self.size else None

    def region(self, offset: int, length: int) -> np.ndarray:
        if offset + length > self.size:
            raise ValueError(f"{self.path}: region {offset}+{length} runs past the end ({self.size} bytes)")
        if length == 0 or self._map is None:
            return np.empty(0, dtype=np.uint8)
        return np.frombuffer(self._map, dtype=np.uint8, count=length, offset=offset)

    @staticmethod
    def crc32c(region: np.ndarray) -> int:
        return crc32c_address(region.ctypes.data, region.nbytes) if region.nbytes else 0

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view: the GC unmaps it
                self._map.close()
            self._map = None
