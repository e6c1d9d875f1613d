"""THE bucket layout of tierckpt backups: every object key, and the small objects' message types.

Spec: docs/bucket-layout.md. Pure: no I/O, no cloud library. The replicator's backup service and the
``tierckpt ls gs://...`` command both build and parse keys only through this module::

    <prefix>/jobs/<namespace>/<jobset>/<uid8>/         a Kubernetes job (id from contract.job_id_for)
    <prefix>/local/<job>/                              any other job id (local and demo runs)
        complete/<step:012d>.json                      StepBackup: the step is complete (written last)
        steps/<step:012d>/started.json                 StepStarted: an upload of the step began
        steps/<step:012d>/refused.json                 StepRefused: a rank of it was refused (never complete)
        steps/<step:012d>/ranks/<rank:05d>.json        RankBackup: one rank's objects are all present
        steps/<step:012d>/rank-<rank:05d>/COMMIT       the rank's ramdisk COMMIT marker, byte for byte
        steps/<step:012d>/rank-<rank:05d>/manifest.json  its manifest, byte for byte
        steps/<step:012d>/rank-<rank:05d>/data-NNNNN.bin, objects.pkl   its files
        steps/<step:012d>/rank-<rank:05d>/.parts/<file>/<i:03d>         slices of a parallel upload
        writers/<step:012d>/<writer>.json              WriterLease: a node is writing objects of the step
        purging.json                                   PurgeFence: a purge of the job is under way

``jobs/`` and ``local/`` are separate roots so no job's prefix is ever a prefix of another job's
(a Kubernetes namespace may well be called ``local``). A step exists for readers only once its
``complete/`` object exists and lists every rank ``0 .. world_size-1``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import COMMIT_NAME, MANIFEST_NAME, check_file_name, check_job_id

__all__ = [
    "LAYOUT_VERSION",
    "BucketLayout",
    "DataRef",
    "KeyKind",
    "ParsedKey",
    "PurgeFence",
    "RankBackup",
    "RankRef",
    "StepBackup",
    "StepRefused",
    "StepStarted",
    "WriterLease",
    "job_from_prefix",
    "job_prefix",
    "parse_gs_url",
    "split_job_id",
]

LAYOUT_VERSION = 1

_DNS = r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?"
_K8S_JOB_RE = re.compile(rf"({_DNS})_({_DNS})_([a-z0-9]{{8}})")
"""The shape ``contract.job_id_for`` produces; its parts contain no ``_``, so the split is unique."""
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")
_STEP_PART = r"([0-9]{12,})"
_RANK_PART = r"([0-9]{5,})"
_PART_RE = re.compile(r"[0-9]{3}")
_WRITER_RE = re.compile(r"[A-Za-z0-9_.-]{1,160}")
"""A writer's name in ``writers/<step>/<writer>.json``: the node's name (made safe) and a nonce."""
"""Every pattern here is matched whole (``re.fullmatch``) and ASCII only (``[0-9]``, not ``\\d``)."""

KeyKind = Literal[
    "complete", "started", "refused", "rank_commit", "rank_file", "part", "writer", "fence", "other"
]


def split_job_id(job: str) -> tuple[str, str, str] | None:
    """``(namespace, jobset, uid8)`` for an id made by ``contract.job_id_for``, else None."""
    m = _K8S_JOB_RE.fullmatch(job)
    return (m.group(1), m.group(2), m.group(3)) if m else None


def _check_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    if prefix and (not _PREFIX_RE.fullmatch(prefix) or any(p in (".", "..") for p in prefix.split("/"))):
        raise FormatError(f"invalid bucket prefix {prefix!r}: use [A-Za-z0-9_.-] path segments")
    return prefix


def job_prefix(prefix: str, job: str) -> str:
    """The key prefix (ending in ``/``) that holds everything of ``job`` and nothing else."""
    check_job_id(job)
    root = _check_prefix(prefix)
    parts = split_job_id(job)
    tail = f"jobs/{parts[0]}/{parts[1]}/{parts[2]}/" if parts else f"local/{job}/"
    return f"{root}/{tail}" if root else tail


def job_from_prefix(prefix: str, key: str) -> tuple[str, str] | None:
    """``(job, rest)`` for a key under some job's prefix, else None (the inverse of ``job_prefix``)."""
    root = _check_prefix(prefix)
    if root:
        if not key.startswith(root + "/"):
            return None
        key = key[len(root) + 1 :]
    parts = key.split("/")
    if parts[0] == "jobs" and len(parts) >= 5:
        job, rest = f"{parts[1]}_{parts[2]}_{parts[3]}", "/".join(parts[4:])
    elif parts[0] == "local" and len(parts) >= 3:
        job, rest = parts[1], "/".join(parts[2:])
    else:
        return None
    try:
        if job_prefix(prefix, job) + rest != (f"{root}/" if root else "") + key:
            return None
    except FormatError:
        return None
    return job, rest


def parse_gs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ``("bucket", "some/prefix")``."""
    if not url.startswith("gs://"):
        raise FormatError(f"{url!r} is not a gs:// URL")
    bucket, _, prefix = url[5:].partition("/")
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]{1,221}[a-z0-9]", bucket):
        raise FormatError(f"invalid bucket name {bucket!r}")
    return bucket, _check_prefix(prefix)


@dataclasses.dataclass(frozen=True)
class ParsedKey:
    """What an object key of a job means."""

    job: str
    kind: KeyKind
    step: int | None = None
    rank: int | None = None
    file: str | None = None
    part: int | None = None


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Keys of one bucket prefix. ``BucketLayout("tierckpt").complete_key(job, 100)`` and so on."""

    prefix: str = "tierckpt"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", _check_prefix(self.prefix))

    def job(self, job: str) -> str:
        return job_prefix(self.prefix, job)

    def jobs_roots(self) -> tuple[str, str]:
        """The two prefixes under which job prefixes live (for listing every job)."""
        root = f"{self.prefix}/" if self.prefix else ""
        return f"{root}jobs/", f"{root}local/"

    def complete_dir(self, job: str) -> str:
        return f"{self.job(job)}complete/"

    def complete_key(self, job: str, step: int) -> str:
        return f"{self.complete_dir(job)}{_step(step)}.json"

    def steps_dir(self, job: str) -> str:
        return f"{self.job(job)}steps/"

    def step_dir(self, job: str, step: int) -> str:
        return f"{self.steps_dir(job)}{_step(step)}/"

    def started_key(self, job: str, step: int) -> str:
        return f"{self.step_dir(job, step)}started.json"

    def refused_key(self, job: str, step: int) -> str:
        return f"{self.step_dir(job, step)}refused.json"

    def rank_commits_dir(self, job: str, step: int) -> str:
        return f"{self.step_dir(job, step)}ranks/"

    def rank_commit_key(self, job: str, step: int, rank: int) -> str:
        return f"{self.rank_commits_dir(job, step)}{_rank(rank)}.json"

    def rank_dir(self, job: str, step: int, rank: int) -> str:
        return f"{self.step_dir(job, step)}rank-{_rank(rank)}/"

    def rank_file_key(self, job: str, step: int, rank: int, name: str) -> str:
        if name not in (COMMIT_NAME, MANIFEST_NAME):
            check_file_name(name)
        return f"{self.rank_dir(job, step, rank)}{name}"

    def part_key(self, job: str, step: int, rank: int, name: str, index: int) -> str:
        check_file_name(name)
        if not 0 <= index < 1000:
            raise FormatError(f"slice index {index} out of range")
        return f"{self.rank_dir(job, step, rank)}.parts/{name}/{index:03d}"

    def writers_dir(self, job: str) -> str:
        return f"{self.job(job)}writers/"

    def writer_key(self, job: str, step: int, writer: str) -> str:
        if not _WRITER_RE.fullmatch(writer) or writer.startswith("."):
            raise FormatError(f"invalid writer name {writer!r}")
        return f"{self.writers_dir(job)}{_step(step)}/{writer}.json"

    def step_of_writer(self, job: str, key: str) -> int | None:
        """The step a writer lease ``writers/<step>/<writer>.json`` is held for."""
        m = re.fullmatch(re.escape(self.writers_dir(job)) + _STEP_PART + r"/[^/]+\.json", key)
        return int(m.group(1)) if m else None

    def purge_fence_key(self, job: str) -> str:
        return f"{self.job(job)}purging.json"

    def parse(self, key: str) -> ParsedKey | None:
        """Classify a key; None if it is not under any job of this prefix."""
        found = job_from_prefix(self.prefix, key)
        if found is None:
            return None
        job, rest = found
        return _classify(job, rest.split("/"))

    def step_of_dir(self, job: str, dir_prefix: str) -> int | None:
        """The step of a ``steps/<step>/`` prefix as returned by a delimiter listing."""
        m = re.fullmatch(re.escape(self.steps_dir(job)) + _STEP_PART + "/", dir_prefix)
        return int(m.group(1)) if m else None

    def step_of_complete(self, job: str, key: str) -> int | None:
        m = re.fullmatch(re.escape(self.complete_dir(job)) + _STEP_PART + r"\.json", key)
        return int(m.group(1)) if m else None

    def rank_of_commit(self, job: str, step: int, key: str) -> int | None:
        m = re.fullmatch(re.escape(self.rank_commits_dir(job, step)) + _RANK_PART + r"\.json", key)
        return int(m.group(1)) if m else None


def _step(step: int) -> str:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise FormatError(f"invalid step {step!r}")
    return f"{step:012d}"


def _rank(rank: int) -> str:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise FormatError(f"invalid rank {rank!r}")
    return f"{rank:05d}"


def _classify(job: str, parts: list[str]) -> ParsedKey:
    other = ParsedKey(job, "other")
    if parts == ["purging.json"]:
        return ParsedKey(job, "fence")
    if len(parts) == 3 and parts[0] == "writers" and re.fullmatch(_STEP_PART, parts[1]):
        name = parts[2].removesuffix(".json")
        if parts[2].endswith(".json") and _WRITER_RE.fullmatch(name) and not name.startswith("."):
            return ParsedKey(job, "writer", step=int(parts[1]))
        return other
    if len(parts) == 2 and parts[0] == "complete" and (m := re.fullmatch(_STEP_PART + r"\.json", parts[1])):
        return ParsedKey(job, "complete", step=int(m.group(1)))
    if len(parts) < 3 or parts[0] != "steps" or not re.fullmatch(_STEP_PART, parts[1]):
        return other
    step = int(parts[1])
    if parts[2:] == ["started.json"]:
        return ParsedKey(job, "started", step=step)
    if parts[2:] == ["refused.json"]:
        return ParsedKey(job, "refused", step=step)
    if len(parts) == 4 and parts[2] == "ranks" and (m := re.fullmatch(_RANK_PART + r"\.json", parts[3])):
        return ParsedKey(job, "rank_commit", step=step, rank=int(m.group(1)))
    m = re.fullmatch(r"rank-" + _RANK_PART, parts[2])
    if not m:
        return other
    rank = int(m.group(1))
    if len(parts) == 4:
        return ParsedKey(job, "rank_file", step=step, rank=rank, file=parts[3])
    if len(parts) == 6 and parts[3] == ".parts" and _PART_RE.fullmatch(parts[5]):
        return ParsedKey(job, "part", step=step, rank=rank, file=parts[4], part=int(parts[5]))
    return other


# --------------------------------------------------------------------------------------------- messages


@dataclasses.dataclass(frozen=True)
class DataRef(Record):
    """Where a rank's data files are when another member of its replica group uploaded them: the
    ``rank-<rank>/data-*.bin`` objects of the same step. ``content`` is the content key
    (``tierckpt.protocol.replica.content_key``) both manifests have, recomputed by the uploader from
    each; a reader still checks every file against this rank's own manifest (size and crc32c)."""

    rank: int
    content: str


@dataclasses.dataclass(frozen=True)
class RankBackup(Message):
    """``steps/<step>/ranks/<rank>.json``, created (create-only) once all of a rank's objects are uploaded
    and verified. ``commit_*`` and ``manifest_*`` describe the ``COMMIT`` and ``manifest.json`` objects;
    the manifest in turn lists every file's size and crc32c."""

    KIND = "tierckpt.backup.rank"
    VERSION = LAYOUT_VERSION

    job: str
    step: int
    rank: int
    world_size: int
    commit_size: int
    commit_crc32c: int
    manifest_size: int
    manifest_crc32c: int
    total_bytes: int
    saved_at: float
    """The manifest's ``created_at``: when the client saved this rank's step."""
    uploaded_by: str
    uploaded_at: float
    data: DataRef | None = None
    """Set when this rank's data files were not uploaded under its own prefix: they are rank
    ``data.rank``'s (an identical replica group member; only COMMIT, manifest and the other files are
    here)."""

    def __post_init__(self) -> None:
        if self.data is not None and self.data.rank in (self.rank, None):
            raise FormatError(f"rank {self.rank}: a data reference must name another rank")


@dataclasses.dataclass(frozen=True)
class RankRef(Record):
    """A completion object's pointer to one rank commit object, checked by readers."""

    size: int
    crc32c: int
    manifest_crc32c: int
    total_bytes: int
    data_from: int | None = None
    """The rank whose data objects hold this rank's data files (``RankBackup.data``); None: its own."""


@dataclasses.dataclass(frozen=True)
class StepBackup(Message):
    """``complete/<step>.json``: written last, create-only, by any node that saw every rank committed."""

    KIND = "tierckpt.backup.step"
    VERSION = LAYOUT_VERSION

    job: str
    step: int
    world_size: int
    ranks: dict[int, RankRef]
    completed_by: str
    completed_at: float

    def __post_init__(self) -> None:
        if self.world_size < 1 or set(self.ranks) != set(range(self.world_size)):
            raise FormatError(
                f"step {self.step} completion lists ranks {sorted(self.ranks)[:8]}... for world size "
                f"{self.world_size}: every rank 0..{self.world_size - 1} must be listed exactly once"
            )

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.ranks.values())


@dataclasses.dataclass(frozen=True)
class StepStarted(Message):
    """``steps/<step>/started.json``: the first node to upload a share of a step writes it, so the
    other nodes holding ranks of that step join the backup even if their own schedule skipped it."""

    KIND = "tierckpt.backup.started"
    VERSION = LAYOUT_VERSION

    job: str
    step: int
    world_size: int
    started_by: str
    started_at: float
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class StepRefused(Message):
    """``steps/<step>/refused.json``: a node refused to upload one of the step's ranks because its
    manifest declares more bytes than the job's quota (sparse files cost a pod nothing on its ramdisk,
    the bucket all of it). The step can never complete, so no node joins it or holds newer backups back
    for it; it is removed like any incomplete step once a newer one is complete."""

    KIND = "tierckpt.backup.refused"
    VERSION = LAYOUT_VERSION

    job: str
    step: int
    rank: int
    refused_by: str
    refused_at: float
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class WriterLease(Message):
    """``writers/<step>/<writer>.json``: a node is writing objects of ``step`` (uploading its share,
    marking the step started, completing it). Created before the first write and deleted after the
    last; rewritten (conditional on its generation) every ``ttl / 5`` seconds while the writes go on.
    A purge waits until every lease is gone or has not changed for ``ttl`` seconds (its writer is dead,
    cut off, or stopped writing when its lease could no longer be renewed in time); see
    docs/bucket-layout.md, "Purging a job"."""

    KIND = "tierckpt.backup.writer"
    VERSION = LAYOUT_VERSION

    job: str
    step: int
    node: str
    renewed_at: float
    ttl: float


@dataclasses.dataclass(frozen=True)
class PurgeFence(Message):
    """``purging.json``: a purge of the job is under way. A writer that finds it writes nothing more of
    the job; the purge deletes it last, once nothing else of the job is left."""

    KIND = "tierckpt.backup.purging"
    VERSION = LAYOUT_VERSION

    job: str
    purged_by: str
    started_at: float
