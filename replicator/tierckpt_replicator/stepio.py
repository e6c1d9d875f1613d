"""Steps on this node's ramdisk: where received and restored steps land, and how they are committed
(stage, verify, commit, rename), and where committed copies are found.

A step being received is written into ``<rank dir>/.incoming-<step>-<nonce>/``, invisible to every
reader (``format.step_dirs`` only sees ``step-NNN``). Once every file's crc32c matched the manifest,
the manifest and then the COMMIT marker are written (``format.write_atomic``, COMMIT last, byte for
byte the source's own), and the directory is renamed to ``step-NNN``. A failure at any point removes
the staging directory and leaves every committed step untouched.

The same writer stages replicas (``<job>/replicas/rank-N/``, from the replication worker) and restored
primaries (``<job>/rank-N/``, from a peer or from the bucket through the backup restorer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from tierckpt.protocol.errors import CorruptShardError, FormatError, RamdiskFullError
from tierckpt.protocol.format import (
    COMMIT_NAME,
    MANIFEST_NAME,
    CommitMarker,
    Manifest,
    committed_steps,
    decode_commit,
    discard_step,
    fsync_dir,
    rank_dir,
    ranks_in,
    read_commit,
    read_manifest,
    replica_rank_dir,
    step_dir,
    write_atomic,
)
from tierckpt.protocol.integrity import crc32c, crc32c_file

__all__ = [
    "INCOMING_PREFIX",
    "StepHeader",
    "StepWriter",
    "create_preallocated",
    "find_committed",
    "parse_header",
    "preallocate",
    "remove_stale_incoming",
    "verify_step",
]

log = logging.getLogger(__name__)

INCOMING_PREFIX = ".incoming-"


@dataclasses.dataclass(frozen=True)
class StepHeader:
    """A step's COMMIT and manifest as sent on the wire, parsed and cross-checked."""

    commit_bytes: bytes
    manifest_bytes: bytes
    marker: CommitMarker
    manifest: Manifest


def parse_header(commit_bytes: bytes, manifest_bytes: bytes, *, job: str, rank: int, step: int) -> StepHeader:
    """Decode and cross-check a step's COMMIT and manifest; anything inconsistent raises ``FormatError``."""
    marker = decode_commit(commit_bytes)
    if len(manifest_bytes) != marker.manifest_size or crc32c(manifest_bytes) != marker.manifest_crc32c:
        raise FormatError("manifest does not match its commit marker")
    manifest = Manifest.from_bytes(manifest_bytes)
    for what, got, want in (
        ("job", (marker.job, manifest.job), job),
        ("rank", (marker.rank, manifest.rank), rank),
        ("step", (marker.step, manifest.step), step),
    ):
        if got != (want, want):
            raise FormatError(f"{what} {got} does not match the request's {want!r}")
    if marker.total_bytes != manifest.total_bytes:
        raise FormatError("commit marker and manifest disagree on total bytes")
    return StepHeader(commit_bytes, manifest_bytes, marker, manifest)


class StepWriter:
    """Stage one step under ``parent`` (a rank dir); ``commit()`` makes it exist, ``abort()`` removes it."""

    def __init__(self, parent: Path, header: StepHeader) -> None:
        self.parent = parent
        self.header = header
        self.final = step_dir(parent, header.manifest.step)
        parent.mkdir(parents=True, exist_ok=True)
        self.dir = parent / f"{INCOMING_PREFIX}{header.manifest.step:012d}-{secrets.token_hex(4)}"
        self.dir.mkdir()
        self._crcs: dict[str, int] = {}

    def prepare(self) -> None:
        """Create every file at its full size now, so a full ramdisk fails before any byte moves."""
        for f in self.header.manifest.files:
            create_preallocated(self.dir / f.name, f.size)

    def path(self, name: str) -> Path:
        self.header.manifest.file(name)  # only files the manifest lists
        return self.dir / name

    def record(self, name: str, crc: int) -> None:
        """Note the crc32c computed while ``name`` was written; a mismatch raises ``CorruptShardError``."""
        want = self.header.manifest.file(name).crc32c
        if crc != want:
            raise CorruptShardError(
                f"{name} of step {self.header.manifest.step} rank {self.header.manifest.rank}: crc32c "
                f"{crc:08x}, manifest says {want:08x}",
                path=str(self.path(name)),
            )
        self._crcs[name] = crc

    def commit(self) -> Path:
        """Write manifest then COMMIT (the source's bytes), rename into place. Returns the step dir."""
        missing = [f.name for f in self.header.manifest.files if f.name not in self._crcs]
        if missing:
            raise FormatError(f"cannot commit: files not received {missing}")
        write_atomic(self.dir / MANIFEST_NAME, self.header.manifest_bytes)
        write_atomic(self.dir / COMMIT_NAME, self.header.commit_bytes)
        if self.final.exists():
            if read_commit(self.final) is not None:
                log.info("%s already committed meanwhile; dropping the duplicate", self.final)
                self.abort()
                return self.final
            discard_step(self.final)  # a torn leftover of an earlier attempt
        os.rename(self.dir, self.final)
        fsync_dir(self.parent)
        return self.final

    def abort(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.abort()


def find_committed(root: Path, job: str, rank: int, step: int) -> Path | None:
    """This node's committed copy of a step: its primary if it has one, else its replica."""
    for parent in (rank_dir(root, job, rank), replica_rank_dir(root, job, rank)):
        path = step_dir(parent, step)
        with contextlib.suppress(FormatError):
            if read_commit(path) is not None:
                return path
    return None


def verify_step(path: Path) -> list[str]:
    """Re-read a committed step and check every file against the manifest; returns the problems."""
    try:
        manifest = read_manifest(path)
    except FormatError as exc:
        return [str(exc)]
    problems = []
    for f in manifest.files:
        p = path / f.name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            problems.append(f"{f.name} is missing")
            continue
        if size != f.size:
            problems.append(f"{f.name} has {size} bytes, manifest says {f.size}")
        elif crc32c_file(p) != f.crc32c:
            problems.append(f"{f.name} fails its crc32c")
    return problems


def remove_stale_incoming(root: Path, max_age: float = 0.0) -> int:
    """Remove staging dirs older than ``max_age`` seconds under every job (torn transfers)."""
    removed = 0
    now = time.time()
    try:
        jobs = [p for p in root.iterdir() if p.is_dir()]
    except FileNotFoundError:
        return 0
    for job in jobs:
        parents = [job / f"rank-{r:05d}" for r in ranks_in(job)]
        parents += [job / "replicas" / f"rank-{r:05d}" for r in ranks_in(job / "replicas")]
        for parent in parents:
            for entry in _incoming(parent):
                with contextlib.suppress(FileNotFoundError):
                    if now - entry.stat().st_mtime >= max_age:
                        shutil.rmtree(entry, ignore_errors=True)
                        removed += 1
    return removed


def _incoming(parent: Path) -> list[Path]:
    try:
        return [parent / n for n in os.listdir(parent) if n.startswith(INCOMING_PREFIX)]
    except (FileNotFoundError, NotADirectoryError):
        return []


def newest_committed(parent: Path) -> int | None:
    steps = committed_steps(parent)
    return steps[-1] if steps else None


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


def create_preallocated(path: Path, size: int) -> None:
    """Create ``path`` holding ``size`` reserved bytes (``RamdiskFullError`` if they do not fit)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        preallocate(fd, size, path)
    finally:
        os.close(fd)
