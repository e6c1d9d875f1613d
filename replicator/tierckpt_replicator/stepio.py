"""Steps on this node's ramdisk: where received and restored steps land, how they are committed
(stage, verify, commit, rename), and where committed copies are found, all inside job trees that a
training pod can write.

Every access goes through the job's ``tierckpt.protocol.safefs.Beneath`` (``open_job``): no symlink
a pod plants (a ``rank-*`` entry, a step directory, a data file, ``leases``, ``replicas``) is ever
followed; a path through one raises ``UnsafePathError``, which the callers log as a refusal.

A step being received is written into ``<rank dir>/.incoming-<step>-<nonce>/``, invisible to every
reader (``format.step_names`` only sees ``step-NNN``). Once every file's crc32c matched the manifest,
the manifest and then the COMMIT marker are written (``Beneath.write_atomic``, COMMIT last, byte for
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from tierckpt.protocol.control import RestoreStatus, restore_status_name
from tierckpt.protocol.errors import CorruptShardError, FormatError, RamdiskFullError, UnsafePathError
from tierckpt.protocol.format import (
    COMMIT_LIMIT,
    COMMIT_NAME,
    MANIFEST_NAME,
    CommitMarker,
    FileEntry,
    Manifest,
    check_job_id,
    decode_commit,
    discard_step,
    ranks_in,
    read_commit,
    read_manifest,
)
from tierckpt.protocol.integrity import crc32c, crc32c_file
from tierckpt.protocol.safefs import Beneath

__all__ = [
    "FRAGMENTS",
    "INCOMING_PREFIX",
    "REPLICAS",
    "Copy",
    "StepHeader",
    "StepWriter",
    "create_preallocated",
    "find_committed",
    "is_data_file",
    "open_files",
    "open_job",
    "parse_header",
    "preallocate",
    "rank_name",
    "rank_tree",
    "rank_trees",
    "read_header",
    "read_status",
    "remove_stale_incoming",
    "step_name",
    "verify_step",
]

log = logging.getLogger(__name__)

_STATUS_LIMIT = 1 << 20

INCOMING_PREFIX = ".incoming-"
REPLICAS = "replicas"
FRAGMENTS = "fragments"
"""Erasure-coded fragments held for other nodes' ranks (``replication.fragments``)."""
Copy = Literal["primary", "replica"]


def is_data_file(name: str) -> bool:
    """A step's tensor data file (``data-*.bin``): what a replica group's members share
    (``tierckpt.protocol.replica.content_key`` covers exactly these)."""
    return name.startswith("data-")


def rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def step_name(step: int) -> str:
    return f"step-{step:012d}"


def open_job(root: Path, job: str, *, create: bool = False) -> Beneath:
    """The job's directory under the ramdisk ``root`` as a confined tree (``FileNotFoundError`` if it
    does not exist and ``create`` is false)."""
    return Beneath.open(root, check_job_id(job), create=create)


def rank_tree(job: Beneath, copy: Copy, rank: int) -> Beneath:
    """The view of rank ``rank``'s directory of the given copy (it may not exist yet)."""
    return job.at(rank_name(rank) if copy == "primary" else f"{REPLICAS}/{rank_name(rank)}")


def rank_trees(job: Beneath, copy: Copy) -> dict[int, Beneath]:
    """Rank -> the view of its directory, for every rank directory of ``copy`` in ``job``. An entry that
    is a symlink (or anything but a directory) is refused with a warning, never followed."""
    parent = job if copy == "primary" else job.at(REPLICAS)
    out = {}
    try:
        ranks = ranks_in(parent)
        for rank in ranks:
            if parent.is_dir(rank_name(rank)):
                out[rank] = parent.at(rank_name(rank))
            else:
                log.warning(
                    "refusing %s/%s: a symlink or not a directory (never followed)",
                    parent.where,
                    rank_name(rank),
                )
    except UnsafePathError as exc:
        log.warning("refusing %s: %s", parent.where, exc)
    return out


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


def read_header(step: Beneath, *, job: str, rank: int, step_no: int, limit: int) -> StepHeader:
    """A committed step's COMMIT and manifest, read confined (a manifest over ``limit`` bytes is refused)
    and cross-checked like one received."""
    commit_bytes = step.read_bytes(COMMIT_NAME, limit=COMMIT_LIMIT)
    marker = decode_commit(commit_bytes, f"{step.where}/{COMMIT_NAME}")
    if marker.manifest_size > limit:
        raise FormatError(f"{step.where}: a manifest of {marker.manifest_size} bytes exceeds {limit}")
    manifest_bytes = step.read_bytes(MANIFEST_NAME, limit=marker.manifest_size + 1)
    return parse_header(commit_bytes, manifest_bytes, job=job, rank=rank, step=step_no)


class StepWriter:
    """Stage one step under ``parent`` (a rank directory's view); ``commit()`` makes it exist,
    ``abort()`` removes it."""

    def __init__(self, parent: Beneath, header: StepHeader) -> None:
        self.parent = parent
        self.header = header
        self.final = step_name(header.manifest.step)
        parent.makedirs()
        self.name = f"{INCOMING_PREFIX}{header.manifest.step:012d}-{secrets.token_hex(4)}"
        parent.mkdir(self.name)
        self.dir = parent.at(self.name)
        self._crcs: dict[str, int] = {}

    def prepare(self) -> None:
        """Create every file still to receive at its full size now, so a full ramdisk fails before any
        byte moves."""
        for f in self.pending():
            create_preallocated(self.dir, f.name, f.size)

    def pending(self) -> list[FileEntry]:
        """The manifest's files not linked (or received) yet, in manifest order."""
        return [f for f in self.header.manifest.files if f.name not in self._crcs]

    def link_data(self, base: Beneath, base_manifest: Manifest) -> int:
        """Hard-link every data file from ``base`` (a committed step whose manifest lists the same data
        files, with the same sizes and crc32c: the caller compared content keys; its crc32c were
        verified when it was committed). Returns the bytes linked; on any failure nothing stays linked."""
        theirs = {f.name: f for f in base_manifest.files}
        linked = 0
        try:
            for f in self.header.manifest.files:
                if not is_data_file(f.name):
                    continue
                other = theirs.get(f.name)
                if other is None or (other.size, other.crc32c) != (f.size, f.crc32c):
                    raise FormatError(f"{f.name} differs from the base step's")
                base.link_to(f.name, self.dir, f.name)
                if self.dir.stat(f.name).st_size != f.size:
                    raise FormatError(f"{f.name}: the base step's file is not {f.size} bytes")
                self._crcs[f.name] = f.crc32c
                linked += f.size
        except BaseException:
            for name in [n for n in self._crcs if is_data_file(n)]:
                self.dir.unlink(name)
                del self._crcs[name]
            raise
        return linked

    def open(self, name: str) -> int:
        """A write descriptor of staged file ``name`` (a file the manifest lists; the caller closes it)."""
        self.header.manifest.file(name)
        return self.dir.open_fd(name, os.O_WRONLY)

    def open_rw(self, name: str) -> int:
        """A read-write descriptor of staged file ``name`` (bytes written are read back to verify them)."""
        self.header.manifest.file(name)
        return self.dir.open_fd(name, os.O_RDWR)

    def where(self, name: str) -> str:
        return f"{self.dir.where}/{name}"

    def record(self, name: str, crc: int) -> None:
        """Note the crc32c computed while ``name`` was written; a mismatch raises ``CorruptShardError``."""
        want = self.header.manifest.file(name).crc32c
        if crc != want:
            raise CorruptShardError(
                f"{name} of step {self.header.manifest.step} rank {self.header.manifest.rank}: crc32c "
                f"{crc:08x}, manifest says {want:08x}",
                path=self.where(name),
            )
        self._crcs[name] = crc

    def commit(self) -> Beneath:
        """Write manifest then COMMIT (the source's bytes), rename into place. Returns the step's view."""
        missing = [f.name for f in self.header.manifest.files if f.name not in self._crcs]
        if missing:
            raise FormatError(f"cannot commit: files not received {missing}")
        self.dir.write_atomic(MANIFEST_NAME, self.header.manifest_bytes)
        self.dir.write_atomic(COMMIT_NAME, self.header.commit_bytes)
        final = self.parent.at(self.final)
        if self.parent.exists(self.final):
            with contextlib.suppress(FormatError):
                if read_commit(final) is not None:
                    log.info("%s already committed meanwhile; dropping the duplicate", final.where)
                    self.abort()
                    return final
            discard_step(final)  # a torn leftover of an earlier attempt (or something planted: unlinked)
        self.parent.rename(self.name, self.final)
        return final

    def abort(self) -> None:
        with contextlib.suppress(OSError, UnsafePathError):
            self.parent.remove_tree(self.name)

    def __enter__(self) -> StepWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.abort()


def read_status(job: Beneath, rank: int) -> RestoreStatus | None:
    """Rank ``rank``'s restore status in the job tree (``control/restore-rank-NNNNN.json``; a pod can write
    it, so it is read confined and bounded), or None when it is absent, unreadable or another rank's."""
    name = restore_status_name(rank)
    try:
        status = RestoreStatus.from_bytes(job.read_bytes(f"control/{name}", limit=_STATUS_LIMIT))
    except (OSError, FormatError, UnsafePathError):
        return None
    return status if status.rank == rank else None


def find_committed(job: Beneath, rank: int, step: int) -> tuple[Beneath, Beneath] | None:
    """This node's committed copy of a step, as the views of its rank directory and its step directory:
    its primary if it has one, else its replica. A copy reached through a symlink is not found."""
    for copy in ("primary", "replica"):
        parent = rank_tree(job, copy, rank)
        path = parent.at(step_name(step))
        try:
            if read_commit(path) is not None:
                return parent, path
        except UnsafePathError as exc:
            log.warning("refusing the %s copy of rank %d step %d: %s", copy, rank, step, exc)
        except FormatError:
            continue
    return None


@contextlib.contextmanager
def open_files(step: Beneath, manifest: Manifest) -> Iterator[list[int]]:
    """Read descriptors of every file of a step, in manifest order, each a regular file of the manifest's
    size reached through no symlink; opened all before any is used, so a refusal comes before a byte of
    the step moves. Closed at the end of the block."""
    fds: list[int] = []
    try:
        for f in manifest.files:
            fds.append(step.open_fd(f.name))
            size = os.fstat(fds[-1]).st_size
            if size != f.size:
                raise FormatError(f"{step.where}/{f.name}: {size} bytes on disk, manifest says {f.size}")
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def verify_step(path: Beneath, *, limit: int) -> list[str]:
    """Re-read a committed step and check every file against the manifest; returns the problems."""
    try:
        manifest = read_manifest(path, limit=limit)
    except FormatError as exc:
        return [str(exc)]
    problems = []
    for f in manifest.files:
        try:
            fd = path.open_fd(f.name)
        except FileNotFoundError:
            problems.append(f"{f.name} is missing")
            continue
        except UnsafePathError as exc:
            problems.append(str(exc))
            continue
        try:
            size = os.fstat(fd).st_size
            if size != f.size:
                problems.append(f"{f.name} has {size} bytes, manifest says {f.size}")
            elif crc32c_file(fd) != f.crc32c:
                problems.append(f"{f.name} fails its crc32c")
        finally:
            os.close(fd)
    return problems


def remove_stale_incoming(root: Path, max_age: float = 0.0) -> int:
    """Remove staging dirs older than ``max_age`` seconds under every job (torn transfers)."""
    removed = 0
    now = time.time()
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return 0
    for name in names:
        try:
            job = open_job(root, name)
        except (FormatError, OSError):  # not a job (``.tierckpt``, a file, a link): not ours to clean
            continue
        with job:
            parents = [*rank_trees(job, "primary").values(), *rank_trees(job, "replica").values()]
            with contextlib.suppress(UnsafePathError):  # a planted link is refused, never followed
                fragments = job.at(FRAGMENTS)
                parents += [fragments.at(rank_name(r)) for r in ranks_in(fragments)]
            for parent in parents:
                with contextlib.suppress(OSError, UnsafePathError):
                    for entry, st in parent.entries():
                        if entry.startswith(INCOMING_PREFIX) and now - st.st_mtime >= max_age:
                            with contextlib.suppress(OSError, UnsafePathError):
                                parent.remove_tree(entry)
                                removed += 1
    return removed


def preallocate(fd: int, size: int, where: str) -> None:
    """Reserve ``size`` bytes now; ENOSPC becomes ``RamdiskFullError``."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise RamdiskFullError(f"no room for {size} bytes at {where}") from exc
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def create_preallocated(tree: Beneath, name: str, size: int) -> None:
    """Create file ``name`` of ``tree`` (exclusively, never through a link) holding ``size`` reserved
    bytes (``RamdiskFullError`` if they do not fit)."""
    fd = tree.open_fd(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        preallocate(fd, size, f"{tree.where}/{name}")
    finally:
        os.close(fd)
