"""Replica groups in the on-ramdisk format: the record a step's manifest carries, and the node mark.

A *replica group* is a set of ranks that hold identical tensors: every rank under DDP, the replicate
dimension of HSDP (FSDP2 with a replicate mesh dimension), the data-parallel dimension of TP x DP. The
client compares its members' content at every save and, on a node hosting several members, writes the
shard once: the others commit steps whose data files are hard links to the writer's (docs/format.md,
"Replica groups"). What the replicators and the operator read is defined here:

* ``ReplicaRecord`` (``Manifest.replica``): the group, this rank's role, the fingerprint the members
  compared, whether they diverged, the bytes written against the bytes a save without deduplication
  would have written;
* ``content_key``: equal for two steps whose data files are byte-identical (given their crc32c);
  anyone recomputes it from a manifest, so it can be checked, never trusted;
* ``group_id``: the id every member derives from the member list alone;
* the node mark (``<job>/.node``): a random id created once per job directory, so the ranks that see
  the same one share a job directory, hence a filesystem (hard links work between their rank
  directories). A device and inode number would not do: a fresh tmpfs numbers its inodes alike on
  every machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Literal, Protocol

from tierckpt.protocol.codec import Record
from tierckpt.protocol.errors import FormatError

__all__ = [
    "NODE_MARK_NAME",
    "REPLICA_VERSION",
    "ReplicaRecord",
    "ReplicaRole",
    "content_key",
    "group_id",
    "node_mark",
]

REPLICA_VERSION = 1
"""The version of ``ReplicaRecord`` this build writes; a reader ignores a record of a newer version
(the step then reads as one without a group), so the manifest stays readable."""

NODE_MARK_NAME = ".node"
"""``<job>/.node``: 32 lowercase hex digits, created once (atomically) by the first client of the job
directory; never changed, never read by anything but clients."""

ReplicaRole = Literal["writer", "linked"]
"""``writer``: this rank wrote its data files; ``linked``: its data files are hard links to those of
rank ``source``'s step (same node, same job directory), committed after that step's COMMIT."""

_HEX = re.compile(r"[0-9a-f]{1,128}")
_MARK = re.compile(r"[0-9a-f]{32}")


def group_id(members: Sequence[int]) -> str:
    """The id of the group of ``members`` (ranks, any order): ``g`` + 16 hex digits of their hash."""
    text = ",".join(str(m) for m in sorted(members))
    return "g" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


class _File(Protocol):
    """What ``content_key`` reads of a manifest's file entry (``format.FileEntry``)."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...
    @property
    def crc32c(self) -> int: ...


class _Tensor(Protocol):
    """What ``content_key`` reads of a manifest's tensor entry (``format.TensorEntry``)."""

    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def file(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def crc32c(self) -> int: ...


def content_key(files: Iterable[_File], tensors: Iterable[_Tensor]) -> str:
    """32 hex digits identifying a step's tensor content: a hash of its data files' names, sizes and
    crc32c and of its tensor table (keys, dtypes, shapes, places, crc32c). Objects, tree, rank and times
    are not part of it: two members' steps have the same key exactly when their data files hold the same
    bytes (up to crc32c collisions) in the same layout."""
    doc = {
        "files": sorted([f.name, f.size, f.crc32c] for f in files if f.name.startswith("data-")),
        "tensors": [[t.key, t.dtype, list(t.shape), t.file, t.offset, t.length, t.crc32c] for t in tensors],
    }
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()
    return hashlib.blake2b(body, digest_size=16).hexdigest()


@dataclasses.dataclass(frozen=True)
class ReplicaRecord(Record):
    """A step's place in its replica group (in ``Manifest.replica``; see docs/format.md)."""

    version: int
    """``REPLICA_VERSION`` of the writer."""
    group: str
    """``group_id(members)``."""
    members: tuple[int, ...]
    """The ranks holding identical tensors, ascending."""
    role: ReplicaRole
    source: int
    """The rank whose data files these are: this rank for a writer, the node's writer for ``linked``."""
    node: str
    """The node mark of the job directory this rank saved in (members with equal marks share inodes)."""
    fingerprint: str
    """Hex digest of this rank's tensors that the members compared at save time (structure, CPU crc32c,
    device digest: ``tierckpt.snapshot.fingerprint``); comparable between members of one save only."""
    diverged: bool
    """The members' fingerprints were not all equal at this save: every member wrote its own copy."""
    differs: tuple[int, ...]
    """Members whose fingerprint differed from this rank's (empty unless ``diverged``)."""
    content: str
    """``content_key`` of this manifest's files and tensors."""
    written_bytes: int
    """Bytes of this step's files that this rank wrote (data files not linked, plus objects.pkl)."""
    logical_bytes: int
    """Bytes a save without deduplication writes: every file of the step (``Manifest.total_bytes``)."""

    def __post_init__(self) -> None:
        if isinstance(self.version, bool) or self.version < 1:
            raise FormatError(f"replica record: invalid version {self.version!r}")
        if not self.members or list(self.members) != sorted(set(self.members)) or self.members[0] < 0:
            raise FormatError(f"replica record: members must be distinct ranks, ascending: {self.members}")
        if self.source not in self.members:
            raise FormatError(f"replica record: source {self.source} is not a member of {self.members}")
        if not set(self.differs) <= set(self.members) or (self.differs and not self.diverged):
            raise FormatError(f"replica record: differs {self.differs} must be diverged members")
        if not _MARK.fullmatch(self.node):
            raise FormatError(f"replica record: invalid node mark {self.node!r}")
        for name in ("fingerprint", "content"):
            if not _HEX.fullmatch(getattr(self, name)):
                raise FormatError(f"replica record: {name} must be lowercase hex")
        if not 0 <= self.written_bytes <= self.logical_bytes:
            raise FormatError(
                f"replica record: written_bytes {self.written_bytes} not within logical {self.logical_bytes}"
            )
        if self.role == "linked" and self.diverged:
            raise FormatError("replica record: a diverged save links nothing")

    @property
    def known(self) -> bool:
        """Whether this build understands the record (else: treat the step as having no group)."""
        return self.version <= REPLICA_VERSION

    def check_rank(self, rank: int) -> None:
        """The invariants that involve the manifest's rank (``Manifest`` checks them)."""
        if rank not in self.members:
            raise FormatError(f"replica record: rank {rank} is not a member of {self.members}")
        if (self.role == "writer") != (self.source == rank):
            raise FormatError(f"replica record: role {self.role!r} with source {self.source} on rank {rank}")


def node_mark(job_path: str | os.PathLike[str]) -> str:
    """The job directory's node mark, created if missing (atomically: the first creator wins)."""
    job_path = Path(job_path)
    path = job_path / NODE_MARK_NAME
    for _ in range(3):
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            _create_mark(job_path, path)
            continue
        except (UnicodeDecodeError, OSError) as exc:
            raise FormatError(f"{path}: unreadable node mark ({exc})") from exc
        if not _MARK.fullmatch(text):
            raise FormatError(f"{path}: not a node mark (32 hex digits): {text[:40]!r}")
        return text
    raise FormatError(f"{path}: could not create the node mark")


def _create_mark(job_path: Path, path: Path) -> None:
    mark = uuid.uuid4().hex
    job_path.mkdir(parents=True, exist_ok=True)
    tmp = job_path / f"{NODE_MARK_NAME}.{mark}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, mark.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # fails if another process created it first: its mark stands
    except FileExistsError:
        pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
