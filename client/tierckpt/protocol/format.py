"""THE on-ramdisk format: layout, manifest, commit marker and lease files (spec: docs/format.md).

Layout under a root directory (the node ramdisk; in a pod, the job's bind mount)::

    <root>/<job>/rank-<rank:05d>/step-<step:012d>/
        data-<n:05d>.bin     tensor bytes, each tensor at an aligned offset
        objects.pkl          pickled non-tensor user objects (optional)
        dcp-metadata.json    DCP steps, one rank per node: the global DCP metadata (typed JSON)
        manifest.json        Manifest: every tensor's key, dtype, shape, file, offset, length, crc32c
        COMMIT               CommitMarker, written last and atomically
    <root>/<job>/rank-<rank:05d>/leases/<step:012d>.<holder>.json    Lease
    <root>/<job>/replicas/rank-<rank:05d>/step-.../                 copies held for peers, same format
    <root>/<job>/control/restore-rank-<rank:05d>.json            restore progress, for the client
    <root>/<job>/control/fetch-rank-<rank:05d>.json              fetch progress, for the client
    <root>/<job>/requests/                                       what training ranks ask their replicator
    <root>/.tierckpt/jobs/<job>/                                 the replicator's own state (peers, policy,
                                                                 restore plan): never inside a pod's view

A step directory without a valid COMMIT does not exist to readers. This module owns the types, the
paths, their encoding, and the small-file I/O of the commit protocol; it never touches tensor bytes.

Every file access here goes through ``tierckpt.protocol.safefs.Beneath``: a reader is given a tree
(``Dir``: a ``Beneath``, or a plain path, opened as a ``Beneath`` of its parent), and follows no
symlink beneath it. Daemons pass the ``Beneath`` of a job directory (or a view into it); the client
passes its own paths.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, TypeAlias

from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.errors import FormatError, UnsafePathError
from tierckpt.protocol.integrity import crc32c
from tierckpt.protocol.replica import ReplicaRecord
from tierckpt.protocol.safefs import Beneath

__all__ = [
    "ALIGNMENT",
    "COMMIT_LIMIT",
    "COMMIT_NAME",
    "DCP_METADATA_NAME",
    "FORMAT_VERSION",
    "JOB_ID_PATTERN",
    "MANIFEST_LIMIT",
    "MANIFEST_NAME",
    "OBJECTS_NAME",
    "SPARE_DIR",
    "STATE_DIR_NAME",
    "WRITER_LOCK",
    "WRITER_LOCK_LIMIT",
    "CommitMarker",
    "Dir",
    "FileEntry",
    "Lease",
    "Manifest",
    "TensorEntry",
    "WriterLock",
    "align_up",
    "as_tree",
    "check_job_id",
    "commit_step",
    "committed_steps",
    "control_dir",
    "data_file_name",
    "dcp_save_id",
    "decode_commit",
    "discard_step",
    "fsync_dir",
    "job_dir",
    "lease_dir",
    "rank_dir",
    "ranks_in",
    "read_commit",
    "read_manifest",
    "replica_rank_dir",
    "requests_dir",
    "state_dir",
    "step_dir",
    "step_dirs",
    "step_names",
    "write_atomic",
]

FORMAT_VERSION = 1
ALIGNMENT = 256
"""Every tensor starts at a multiple of this many bytes inside its data file."""

MANIFEST_NAME = "manifest.json"
COMMIT_NAME = "COMMIT"
OBJECTS_NAME = "objects.pkl"
DCP_METADATA_NAME = "dcp-metadata.json"
"""DCP steps only: the coordinator's typed-JSON DCP ``Metadata`` (see tierckpt.dcp.metadata)."""
STATE_DIR_NAME = ".tierckpt"
"""The replicator's own directory under the ramdisk root; job ids never start with ".", so it is never a
job, and no pod ever sees it (pods get their job directory only)."""
WRITER_LOCK = ".writer.lock"
"""In a primary rank directory: the file a live ``Checkpointer`` holds locked (``flock``) while it writes
the rank; ``tierckpt gc`` leaves a rank whose lock is held to that process."""
SPARE_DIR = ".spare"
"""In a primary rank directory: the client's spare slots (preallocated data files for the next saves)."""
COMMIT_LIMIT = 64 << 10
"""The largest COMMIT marker read (one is ~300 bytes)."""
MANIFEST_LIMIT = 1 << 30
"""The largest manifest read unless the reader names a smaller limit (daemons do)."""

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,252}$"
"""A valid job id, as a regular expression (also the control API's ``{job}`` path parameter); always
matched whole (``re.fullmatch``: ``$`` alone would accept a trailing newline)."""
_JOB_RE = re.compile(JOB_ID_PATTERN)
_RANK_RE = re.compile(r"rank-([0-9]{5,})")
_STEP_RE = re.compile(r"step-([0-9]{12,})")
_HOLDER_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_DATA_RE = re.compile(r"data-[0-9]{5}\.bin")
_MAX_INDEX = (1 << 63) - 1
"""Ranks, steps and file indices fit a signed 64-bit integer."""

Dir: TypeAlias = str | os.PathLike[str] | Beneath
"""A directory a format function works in: a confined tree (``Beneath``, or a view of one), or a path
(opened as a tree: the path's parent is followed as given, nothing at or below the path is)."""

ManifestKind = Literal["state_dict", "dcp", "orbax"]
"""Who wrote a step: ``Checkpointer``, the DCP adapter, or stock Orbax (a step the replicator adopted,
``tierckpt.protocol.orbax``; its files and directories are in ``extra["orbax"]``)."""


# --------------------------------------------------------------------------------------------- names


def check_job_id(job: str) -> str:
    """Return ``job`` if it is a safe job id (a path component), else raise ``FormatError``."""
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job) or job in (".", ".."):
        raise FormatError(f"invalid job id {job!r}: use 1-253 of [A-Za-z0-9_.-], not starting with . _ or -")
    return job


def _check_nonneg(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= _MAX_INDEX:
        raise FormatError(f"invalid {name} {value!r}: must be a non-negative 64-bit integer")
    return value


def check_holder(holder: str) -> str:
    if not isinstance(holder, str) or not _HOLDER_RE.fullmatch(holder):
        raise FormatError(f"invalid lease holder {holder!r}: use 1-128 of [A-Za-z0-9_.-]")
    return holder


def check_file_name(name: str) -> str:
    """A file named in a manifest must be a plain data or objects file: no separators, no traversal."""
    if name not in (OBJECTS_NAME, DCP_METADATA_NAME) and not _DATA_RE.fullmatch(name):
        raise FormatError(f"invalid shard file name {name!r}")
    return name


def data_file_name(index: int) -> str:
    return f"data-{_check_nonneg('file index', index):05d}.bin"


def align_up(offset: int, alignment: int = ALIGNMENT) -> int:
    return (offset + alignment - 1) // alignment * alignment


# --------------------------------------------------------------------------------------------- paths


def job_dir(root: str | os.PathLike[str], job: str) -> Path:
    return Path(root) / check_job_id(job)


def rank_dir(root: str | os.PathLike[str], job: str, rank: int) -> Path:
    """Where the client on this node writes rank ``rank``'s own steps."""
    return job_dir(root, job) / f"rank-{_check_nonneg('rank', rank):05d}"


def replica_rank_dir(root: str | os.PathLike[str], job: str, rank: int) -> Path:
    """Where this node keeps copies of another node's rank ``rank`` (kept apart from primaries)."""
    return job_dir(root, job) / "replicas" / f"rank-{_check_nonneg('rank', rank):05d}"


def control_dir(root: str | os.PathLike[str], job: str) -> Path:
    """The client-visible control directory: the replicator writes restore progress there, nothing
    else in it is read by anyone."""
    return job_dir(root, job) / "control"


def requests_dir(root: str | os.PathLike[str], job: str) -> Path:
    """Where training ranks leave requests for their node's replicator (``control.FetchRequest``); the
    replicator treats everything in it as untrusted input."""
    return job_dir(root, job) / "requests"


def state_dir(root: str | os.PathLike[str], job: str) -> Path:
    """The replicator's own state of ``job`` (peer assignment, policy, restore plan): outside the job
    directory, where no pod can write."""
    return Path(root) / STATE_DIR_NAME / "jobs" / check_job_id(job)


def step_dir(rank_path: str | os.PathLike[str], step: int) -> Path:
    return Path(rank_path) / f"step-{_check_nonneg('step', step):012d}"


def lease_dir(rank_path: str | os.PathLike[str]) -> Path:
    return Path(rank_path) / "leases"


def parse_step_name(name: str) -> int | None:
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m and int(m.group(1)) <= _MAX_INDEX else None


def _parse_rank_name(name: str) -> int | None:
    m = _RANK_RE.fullmatch(name)
    return int(m.group(1)) if m and int(m.group(1)) <= _MAX_INDEX else None


@contextlib.contextmanager
def as_tree(where: Dir) -> Iterator[Beneath]:
    """``where`` as a confined tree: a ``Beneath`` as it is; a path as a view of its last component
    beneath its parent (``FileNotFoundError`` if the parent does not exist)."""
    if isinstance(where, Beneath):
        yield where
        return
    path = Path(where)
    with Beneath.open(path.parent) as parent:
        yield parent.at(path.name) if path.name else parent


def ranks_in(parent: Dir) -> list[int]:
    """Ranks that have a ``rank-NNNNN`` entry under ``parent`` (a job dir or its replicas dir)."""
    try:
        with as_tree(parent) as tree:
            names = tree.listdir()
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(r for n in names if (r := _parse_rank_name(n)) is not None)


def step_names(rank: Dir) -> dict[int, str]:
    """Step -> the name of its directory in ``rank``, for every step directory present (committed or not)."""
    try:
        with as_tree(rank) as tree:
            names = tree.listdir()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    return {step: n for n in names if (step := parse_step_name(n)) is not None}


def step_dirs(rank_path: str | os.PathLike[str]) -> dict[int, Path]:
    """Every step directory present, committed or not, as paths."""
    return {step: Path(rank_path) / name for step, name in step_names(rank_path).items()}


# --------------------------------------------------------------------------------------------- types


@dataclasses.dataclass(frozen=True)
class FileEntry(Record):
    """One file of a step: its name inside the step directory, its size and its crc32c."""

    name: str
    size: int
    crc32c: int

    def __post_init__(self) -> None:
        check_file_name(self.name)
        _check_nonneg("file size", self.size)


@dataclasses.dataclass(frozen=True)
class TensorEntry(Record):
    """One tensor: contiguous row-major bytes of ``dtype`` and ``shape`` at ``file[offset:offset+length]``."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    length: int
    crc32c: int

    def __post_init__(self) -> None:
        check_file_name(self.file)
        _check_nonneg("offset", self.offset)
        _check_nonneg("length", self.length)


@dataclasses.dataclass(frozen=True)
class Manifest(Message):
    """Everything needed to read one step of one rank back, and to verify it.

    ``tree`` is the JSON skeleton of the saved state (see docs/format.md, "State tree"): containers and
    scalars inline, ``{"tensor": i}`` pointing into ``tensors`` and ``{"object": i}`` into the list
    pickled in ``objects.pkl``. ``extra`` carries kind-specific data (for ``dcp``: the DCP metadata).
    """

    KIND = "tierckpt.manifest"
    VERSION = FORMAT_VERSION

    job: str
    rank: int
    world_size: int
    step: int
    created_at: float
    files: tuple[FileEntry, ...]
    tensors: tuple[TensorEntry, ...]
    tree: Any = None
    object_count: int = 0
    manifest_kind: ManifestKind = "state_dict"
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    replica: ReplicaRecord | None = None
    """The step's replica group, when the rank saved as a member of one (``tierckpt.protocol.replica``)."""

    def __post_init__(self) -> None:
        check_job_id(self.job)
        _check_nonneg("rank", self.rank)
        _check_nonneg("step", self.step)
        if self.replica is not None and self.replica.known:
            self.replica.check_rank(self.rank)
        names = {f.name for f in self.files}
        if len(names) != len(self.files):
            raise FormatError("manifest lists a file twice")
        sizes = {f.name: f.size for f in self.files}
        for t in self.tensors:
            if t.file not in sizes:
                raise FormatError(f"tensor {t.key!r} points at unlisted file {t.file!r}")
            if t.offset + t.length > sizes[t.file]:
                raise FormatError(f"tensor {t.key!r} runs past the end of {t.file!r}")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, name: str) -> FileEntry:
        for f in self.files:
            if f.name == name:
                return f
        raise FormatError(f"no file {name!r} in manifest of step {self.step}")


@dataclasses.dataclass(frozen=True)
class CommitMarker(Message):
    """Written last: its presence, with a matching manifest crc, is what makes a step exist."""

    KIND = "tierckpt.commit"
    VERSION = FORMAT_VERSION

    job: str
    rank: int
    step: int
    manifest_size: int
    manifest_crc32c: int
    total_bytes: int
    committed_at: float
    marker_crc32c: int | None = None
    """crc32c of this marker's own compact JSON object without this member, which is written last (so a
    flipped byte anywhere in COMMIT is detected, ``committed_at`` included). Readers require it."""


@dataclasses.dataclass(frozen=True)
class Lease(Message):
    """A claim on a step: retention never deletes a step with an unexpired lease.

    File: ``<rank dir>/leases/<step:012d>.<holder>.json``. Holders renew by rewriting it with a later
    ``expires_at`` and release by deleting it. An expired lease is ignored and may be removed by anyone.
    """

    KIND = "tierckpt.lease"
    VERSION = FORMAT_VERSION

    step: int
    holder: str
    pid: int
    host: str
    expires_at: float

    def expired(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.expires_at


@dataclasses.dataclass(frozen=True)
class WriterLock(Message):
    """Who holds a rank's writer lock: the content of ``<rank dir>/.writer.lock``, written by the
    ``Checkpointer`` that took the ``flock`` on it, so that the next writer kept waiting can name it.

    ``pid`` is in the writer's pid namespace (on Kubernetes, its pod's), ``host`` is its hostname (the
    pod's name).
    """

    KIND = "tierckpt.writer-lock"
    VERSION = FORMAT_VERSION

    pid: int
    host: str
    command: tuple[str, ...]
    """The holder's command line (``/proc/<pid>/cmdline``), as far as it fits ``WRITER_LOCK_LIMIT``."""
    since: float


WRITER_LOCK_LIMIT = 8 << 10
"""Most bytes of a ``.writer.lock`` that are read back (its command line is cut to fit)."""


# --------------------------------------------------------------------------------------------- I/O


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a temporary name, fsync it, rename it over ``path``, fsync the directory
    (``Beneath.write_atomic`` in ``path``'s directory: the temporary file is created exclusively, never
    through a link)."""
    path = Path(path)
    with Beneath.open(path.parent) as parent:
        parent.write_atomic(path.name, data)


def commit_step(step_path: Dir, manifest: Manifest) -> CommitMarker:
    """Write the manifest, then the commit marker. Data files must already be complete and synced."""
    body = manifest.to_bytes()
    with as_tree(step_path) as step:
        return _commit_in(step, manifest, body)


def _commit_in(step: Beneath, manifest: Manifest, body: bytes) -> CommitMarker:
    step.write_atomic(MANIFEST_NAME, body)
    marker = CommitMarker(
        job=manifest.job,
        rank=manifest.rank,
        step=manifest.step,
        manifest_size=len(body),
        manifest_crc32c=crc32c(body),
        total_bytes=manifest.total_bytes,
        committed_at=time.time(),
    )
    body = _encode_marker(marker)
    step.write_atomic(COMMIT_NAME, body)
    return CommitMarker.from_bytes(body)


_MARKER_CRC_MEMBER = b',"marker_crc32c":'


def _encode_marker(marker: CommitMarker) -> bytes:
    """Compact JSON of the marker, with ``marker_crc32c`` appended last as the crc of what precedes it."""
    fields = marker.to_dict()
    fields.pop("marker_crc32c", None)
    body = json.dumps(fields, separators=(",", ":")).encode()
    return body[:-1] + _MARKER_CRC_MEMBER + str(crc32c(body)).encode() + b"}"


def decode_commit(body: bytes, where: str = COMMIT_NAME) -> CommitMarker:
    """Parse COMMIT bytes and check the marker's own crc32c (``where`` names the file in errors)."""
    marker = CommitMarker.from_bytes(body)
    cut = body.rfind(_MARKER_CRC_MEMBER)
    if marker.marker_crc32c is None or cut < 0 or crc32c(body[:cut] + b"}") != marker.marker_crc32c:
        raise FormatError(f"{where}: commit marker does not match its own crc32c (corrupt)")
    return marker


def read_commit(step_path: Dir) -> CommitMarker | None:
    """The step's commit marker, or None if the step is not committed."""
    try:
        with as_tree(step_path) as step:
            body = step.read_bytes(COMMIT_NAME, limit=COMMIT_LIMIT)
            where = f"{step.where}/{COMMIT_NAME}"
    except (FileNotFoundError, NotADirectoryError):
        return None
    return decode_commit(body, where)


def dcp_save_id(manifest: Manifest) -> str:
    """The DCP save a rank's step was written for (``extra["dcp"]["save_id"]``, the id its checkpoint's
    metadata names); ``""`` for a step of another kind or one that names none."""
    dcp = manifest.extra.get("dcp") if manifest.manifest_kind == "dcp" else None
    save_id = dcp.get("save_id") if isinstance(dcp, dict) else None
    return save_id if isinstance(save_id, str) else ""


def read_manifest(step_path: Dir, *, limit: int = MANIFEST_LIMIT) -> Manifest:
    """The manifest of a committed step, checked against its commit marker (a manifest of more than
    ``limit`` bytes raises ``FormatError`` without being read)."""
    with as_tree(step_path) as step:
        return _read_manifest_in(step, limit)


def _read_manifest_in(step: Beneath, limit: int) -> Manifest:
    marker = read_commit(step)
    if marker is None:
        raise FormatError(f"{step.where} is not committed")
    if marker.manifest_size > limit:
        raise FormatError(
            f"{step.where}: a manifest of {marker.manifest_size} bytes exceeds the limit of {limit}"
        )
    try:
        # one byte more than the marker says: a longer file is read far enough to fail the check below
        body = step.read_bytes(MANIFEST_NAME, limit=marker.manifest_size + 1)
    except FileNotFoundError as exc:
        raise FormatError(f"{step.where}: committed but {MANIFEST_NAME} is missing") from exc
    except FormatError as exc:
        if isinstance(exc, UnsafePathError):
            raise
        raise FormatError(
            f"{step.where}/{MANIFEST_NAME}: does not match its commit marker (corrupt)"
        ) from exc
    if len(body) != marker.manifest_size or crc32c(body) != marker.manifest_crc32c:
        raise FormatError(f"{step.where}/{MANIFEST_NAME}: does not match its commit marker (corrupt)")
    manifest = Manifest.from_bytes(body)
    if manifest.step != marker.step or manifest.rank != marker.rank:
        raise FormatError(f"{step.where}: manifest and commit marker disagree on step or rank")
    return manifest


def committed_steps(rank_path: Dir) -> list[int]:
    """Steps whose commit marker is present and readable, oldest first (a step directory that is a
    symlink, or whose COMMIT is one, is not readable)."""
    out = []
    with contextlib.ExitStack() as stack:
        try:
            rank = stack.enter_context(as_tree(rank_path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        for step, name in step_names(rank).items():
            try:
                marker = read_commit(rank.at(name))
            except FormatError:
                continue
            if marker is not None and marker.step == step:
                out.append(step)
    return sorted(out)


def discard_step(step_path: Dir) -> None:
    """Remove a step: the commit marker first (so it stops existing at once), then everything else. A
    step directory that is a symlink is unlinked, never followed."""
    try:
        with as_tree(step_path) as step:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError, UnsafePathError):
                step.unlink(COMMIT_NAME, missing_ok=False)
                step.fsync()
            with contextlib.suppress(OSError):
                step.remove_tree()
    except (FileNotFoundError, NotADirectoryError):
        return


def iter_data_files(manifest: Manifest) -> Iterator[FileEntry]:
    return (f for f in manifest.files if _DATA_RE.fullmatch(f.name))
