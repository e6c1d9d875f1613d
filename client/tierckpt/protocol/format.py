"""THE on-ramdisk format: layout, manifest, commit marker and lease files (spec: docs/format.md).

Layout under a root directory (the node ramdisk; in a pod, the job's bind mount)::

    <root>/<job>/rank-<rank:05d>/step-<step:012d>/
        data-<n:05d>.bin     tensor bytes, each tensor at an aligned offset
        objects.pkl          pickled non-tensor user objects (optional)
        dcp-metadata.json    DCP steps, coordinator rank only: the global DCP metadata (typed JSON)
        manifest.json        Manifest: every tensor's key, dtype, shape, file, offset, length, crc32c
        COMMIT               CommitMarker, written last and atomically
    <root>/<job>/rank-<rank:05d>/leases/<step:012d>.<holder>.json    Lease
    <root>/<job>/replicas/rank-<rank:05d>/step-.../                 copies held for peers, same format
    <root>/<job>/control/                                        control files (tierckpt.protocol.control)

A step directory without a valid COMMIT does not exist to readers. This module owns the types, the
paths, their encoding, and the small-file I/O of the commit protocol; it never touches tensor bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.integrity import crc32c
from tierckpt.protocol.replica import ReplicaRecord

__all__ = [
    "ALIGNMENT",
    "COMMIT_NAME",
    "DCP_METADATA_NAME",
    "FORMAT_VERSION",
    "JOB_ID_PATTERN",
    "MANIFEST_NAME",
    "OBJECTS_NAME",
    "CommitMarker",
    "FileEntry",
    "Lease",
    "Manifest",
    "TensorEntry",
    "align_up",
    "check_job_id",
    "commit_step",
    "committed_steps",
    "control_dir",
    "data_file_name",
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
    "step_dir",
    "step_dirs",
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
_TMP_SUFFIX = ".tmp"

JOB_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,252}$"
"""A valid job id, as a regular expression (also the control API's ``{job}`` path parameter)."""
_JOB_RE = re.compile(JOB_ID_PATTERN)
_RANK_RE = re.compile(r"^rank-(\d{5,})$")
_STEP_RE = re.compile(r"^step-(\d{12,})$")
_HOLDER_RE = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_DATA_RE = re.compile(r"^data-\d{5}\.bin$")

ManifestKind = Literal["state_dict", "dcp"]


# --------------------------------------------------------------------------------------------- names


def check_job_id(job: str) -> str:
    """Return ``job`` if it is a safe job id (a path component), else raise ``FormatError``."""
    if not isinstance(job, str) or not _JOB_RE.fullmatch(job) or job in (".", ".."):
        raise FormatError(f"invalid job id {job!r}: use 1-253 of [A-Za-z0-9_.-], not starting with . _ or -")
    return job


def _check_nonneg(name: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FormatError(f"invalid {name} {value!r}: must be a non-negative integer")
    return value


def check_holder(holder: str) -> str:
    if not isinstance(holder, str) or not _HOLDER_RE.match(holder):
        raise FormatError(f"invalid lease holder {holder!r}: use 1-128 of [A-Za-z0-9_.-]")
    return holder


def check_file_name(name: str) -> str:
    """A file named in a manifest must be a plain data or objects file: no separators, no traversal."""
    if name not in (OBJECTS_NAME, DCP_METADATA_NAME) and not _DATA_RE.match(name):
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
    return job_dir(root, job) / "control"


def step_dir(rank_path: str | os.PathLike[str], step: int) -> Path:
    return Path(rank_path) / f"step-{_check_nonneg('step', step):012d}"


def lease_dir(rank_path: str | os.PathLike[str]) -> Path:
    return Path(rank_path) / "leases"


def parse_step_name(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def ranks_in(parent: str | os.PathLike[str]) -> list[int]:
    """Ranks that have a ``rank-NNNNN`` directory under ``parent`` (a job dir or its replicas dir)."""
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _RANK_RE.match(n)))


def step_dirs(rank_path: str | os.PathLike[str]) -> dict[int, Path]:
    """Every step directory present, committed or not."""
    try:
        names = os.listdir(rank_path)
    except FileNotFoundError:
        return {}
    out = {}
    for n in names:
        step = parse_step_name(n)
        if step is not None:
            out[step] = Path(rank_path) / n
    return out


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


# --------------------------------------------------------------------------------------------- I/O


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a temporary name, fsync it, rename it over ``path``, fsync the directory."""
    path = Path(path)
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def commit_step(step_path: str | os.PathLike[str], manifest: Manifest) -> CommitMarker:
    """Write the manifest, then the commit marker. Data files must already be complete and synced."""
    step_path = Path(step_path)
    body = manifest.to_bytes()
    write_atomic(step_path / MANIFEST_NAME, body)
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
    write_atomic(step_path / COMMIT_NAME, body)
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


def read_commit(step_path: str | os.PathLike[str]) -> CommitMarker | None:
    """The step's commit marker, or None if the step is not committed."""
    path = Path(step_path) / COMMIT_NAME
    try:
        body = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return decode_commit(body, str(path))


def read_manifest(step_path: str | os.PathLike[str]) -> Manifest:
    """The manifest of a committed step, checked against its commit marker."""
    step_path = Path(step_path)
    marker = read_commit(step_path)
    if marker is None:
        raise FormatError(f"{step_path} is not committed")
    try:
        body = (step_path / MANIFEST_NAME).read_bytes()
    except FileNotFoundError as exc:
        raise FormatError(f"{step_path}: committed but {MANIFEST_NAME} is missing") from exc
    if len(body) != marker.manifest_size or crc32c(body) != marker.manifest_crc32c:
        raise FormatError(f"{step_path / MANIFEST_NAME}: does not match its commit marker (corrupt)")
    manifest = Manifest.from_bytes(body)
    if manifest.step != marker.step or manifest.rank != marker.rank:
        raise FormatError(f"{step_path}: manifest and commit marker disagree on step or rank")
    return manifest


def committed_steps(rank_path: str | os.PathLike[str]) -> list[int]:
    """Steps whose commit marker is present and readable, oldest first."""
    out = []
    for step, path in step_dirs(rank_path).items():
        try:
            marker = read_commit(path)
        except FormatError:
            continue
        if marker is not None and marker.step == step:
            out.append(step)
    return sorted(out)


def discard_step(step_path: str | os.PathLike[str]) -> None:
    """Remove a step: the commit marker first (so it stops existing at once), then everything else."""
    step_path = Path(step_path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(step_path / COMMIT_NAME)
        fsync_dir(step_path)
    shutil.rmtree(step_path, ignore_errors=True)


def iter_data_files(manifest: Manifest) -> Iterator[FileEntry]:
    return (f for f in manifest.files if _DATA_RE.match(f.name))
