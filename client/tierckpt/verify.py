"""Checking a committed step end to end: COMMIT, manifest, every file's size and crc32c.

``verify_step(step_path)`` is the one check shared by the client (before trusting a step), the
replicator (before serving or after receiving one) and the CLI. It is fast in the common case:
one crc32c pass per file over its mapped memory. Only when a data file's crc disagrees does it
narrow down, tensor by tensor, to name the damaged tensor in the ``CorruptShardError``.

It needs neither torch nor numpy (the CLI runs it in the daemons' torch-free image): a file is mapped
with ``mmap`` alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

from tierckpt.protocol.errors import CorruptShardError, FormatError
from tierckpt.protocol.format import (
    FileEntry,
    Manifest,
    parse_step_name,
    read_commit,
    read_manifest,
)
from tierckpt.protocol.integrity import crc32c_address
from tierckpt.snapshot.checksum import region_crcs

__all__ = ["VerifyReport", "step_problems", "verify_file", "verify_step"]


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    step: int
    files: int
    bytes: int


@contextlib.contextmanager
def _mapped(fd: int, size: int) -> Iterator[int]:
    """The address of the file's first ``size`` bytes, mapped for reading (0 when ``size`` is 0).

    The mapping is private (``ACCESS_COPY``) only so that ctypes may take its address; nothing writes
    through it, so every page stays the file's own.
    """
    if size == 0:
        yield 0
        return
    with mmap.mmap(fd, size, access=mmap.ACCESS_COPY) as mm:
        view = ctypes.c_char.from_buffer(mm)
        try:
            yield ctypes.addressof(view)
        finally:
            del view  # the mapping cannot close while ctypes holds it


def verify_file(step_path: str | os.PathLike[str], manifest: Manifest, entry: FileEntry) -> None:
    """Check one file of a step; ``CorruptShardError`` names the file and, if found, the tensor."""
    path = Path(step_path) / entry.name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError as exc:
        raise CorruptShardError(f"{path}: missing", path=str(path)) from exc
    try:
        size = os.fstat(fd).st_size
        if size != entry.size:
            raise CorruptShardError(f"{path}: {size} bytes, manifest says {entry.size}", path=str(path))
        with _mapped(fd, size) as address:
            crc = region_crcs([(address, size)])[0] if size else 0
            if crc == entry.crc32c:
                return
            data_file = any(t.file == entry.name for t in manifest.tensors)
            if data_file:
                _narrow(path, address, manifest, entry)
        raise CorruptShardError(
            f"{path}: crc32c {crc:08x}, manifest says {entry.crc32c:08x}"
            + (" (every tensor matches: the padding is damaged)" if data_file else ""),
            path=str(path),
        )
    finally:
        os.close(fd)


def _narrow(path: Path, address: int, manifest: Manifest, entry: FileEntry) -> None:
    for t in manifest.tensors:
        if t.file == entry.name:
            crc = crc32c_address(address + t.offset, t.length)
            if crc != t.crc32c:
                raise CorruptShardError(
                    f"{path}: tensor {t.key!r} at [{t.offset}, {t.offset + t.length}) has crc32c {crc:08x}, "
                    f"manifest says {t.crc32c:08x}",
                    path=str(path),
                    key=t.key,
                )


def _check_identity(step_path: Path, manifest: Manifest) -> None:
    marker = read_commit(step_path)
    if marker is None:
        raise FormatError(f"{step_path} is not committed")
    if marker.total_bytes != manifest.total_bytes:
        raise FormatError(f"{step_path}: commit marker and manifest disagree on total bytes")
    named = parse_step_name(step_path.name)
    if named is not None and named != manifest.step:
        raise FormatError(f"{step_path}: directory name says step {named}, manifest says {manifest.step}")


def verify_step(step_path: str | os.PathLike[str]) -> VerifyReport:
    """Verify a committed step completely; the first problem raises ``FormatError``/``CorruptShardError``."""
    step_path = Path(step_path)
    manifest = read_manifest(step_path)
    _check_identity(step_path, manifest)
    for entry in manifest.files:
        verify_file(step_path, manifest, entry)
    return VerifyReport(step=manifest.step, files=len(manifest.files), bytes=manifest.total_bytes)


def step_problems(step_path: str | os.PathLike[str]) -> list[FormatError]:
    """Every problem of a step (empty when it verifies), for reports that list them all."""
    step_path = Path(step_path)
    try:
        manifest = read_manifest(step_path)
        _check_identity(step_path, manifest)
    except FormatError as exc:
        return [exc]
    problems: list[FormatError] = []
    for entry in manifest.files:
        try:
            verify_file(step_path, manifest, entry)
        except FormatError as exc:
            problems.append(exc)
    return problems
