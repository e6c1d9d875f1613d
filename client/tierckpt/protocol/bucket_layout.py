"""THE bucket layout of tierckpt backups: every object key, and the small objects' message types.

Spec: docs/bucket-layout.md. Pure: no I/O, no cloud library. The replicator's backup service and the
``tierckpt ls gs://...`` command both build and parse keys only through this module::

    <prefix>/jobs/<namespace>/<jobset>/<uid8>/         a Kubernetes job (id from contract.job_id_for)
    <prefix>/local/<job>/                              any other job id (local and demo runs)
        catalog.json                                   CatalogChange: the last change to the catalog
        complete/<step:012d>.json                      StepBackup: the step is complete (written last)
        steps/<step:012d>/started.json                 StepStarted: an upload of the step began
        steps/<step:012d>/refused.json                 StepRefused: a rank of it was refused (never complete)
        steps/<step:012d>/ranks/<rank:05d>.json        RankBackup: one rank's objects are all present
        steps/<step:012d>/rank-<rank:05d>/<save>/COMMIT  the rank's ramdisk COMMIT marker, byte for byte
        steps/<step:012d>/rank-<rank:05d>/<save>/manifest.json  its manifest, byte for byte
        steps/<step:012d>/rank-<rank:05d>/<save>/data-NNNNN.bin, objects.pkl   its files
        steps/<step:012d>/rank-<rank:05d>/<save>/.parts/<file>/<i:03d>  slices of a parallel upload
        steps/<step:012d>/shares/<count:06d>-<writer>.json  ShareDone: a node committed its share
        steps/<step:012d>/index/<writer>/<chunk:05d>.json  RankIndex: the rank refs of 1024 ranks
        steps/<step:012d>/chunklists/<rank:05d>-<save>.json  ChunkList: its data files' chunks (layout 3)
        chunks/<sha256>.<codec>                        a content-addressed chunk of data (layout 3)
        writers/<step:012d>/<writer>.json              WriterLease: a node is writing objects of the step
        purging.json                                   PurgeFence: a purge of the job is under way
        sweeping.json                                  SweepLock: unreferenced chunks are being deleted

``jobs/`` and ``local/`` are separate roots so no job's prefix is ever a prefix of another job's
(a Kubernetes namespace may well be called ``local``). A step exists for readers only once its
``complete/`` object exists and covers every rank ``0 .. world_size-1``.

Layout version 2 (``LAYOUT_VERSION``): the completion object no longer lists every rank (it grew by
about 112 bytes a rank, past what readers accept at about 10,000 ranks); it points at index chunks of
``INDEX_CHUNK_RANKS`` ranks each, so its size grows with ``world_size / 1024`` only. Every small object
is at most ``SMALL_OBJECT_LIMIT`` bytes, which writers check before writing (``encode_small``) and
readers enforce. A node that committed its share of a step says so in a ``shares/`` object whose name
counts its ranks: the node whose listing of them counts the whole world completes the step, and a rank
commit carries its ``RankSummary`` in its object metadata, so that node learns every rank's reference
from one listing of the rank commits. ``catalog.json`` changes whenever a
step starts, completes, is refused or retired, so a node's periodic look at the bucket costs one request
while nothing changed. Layout 1 completion objects (ranks inline) stay readable.

Layout version 3: a rank's data files are content-addressed chunks (``tierckpt.protocol.chunks``),
each uploaded once per job under ``chunks/``, named by the SHA-256 of its raw bytes and the codec it is
stored with; the rank commit points at the rank's ``ChunkList`` (size and crc32c), which names every
chunk of every data file. Steps of layouts 1 and 2 (data files as whole objects) stay readable.
docs/bucket-layout.md, "Chunks (layout 3)".

Layout version 4: every object a rank's upload writes is its save's own. ``<save>`` (``save_name``) is
the crc32c of the save's manifest, which the rank commit records, so two saves of one step number (a job
that went back and saved the step again) never write the same key: an upload of an earlier save that
started before the newer one completed the step cannot change a byte of it (its rank commit is refused,
and its objects are garbage left for the step's retention). Rank commits name their save
(``RankBackup.save``); those of layouts 1-3 (no save) have their objects directly under ``rank-<rank>/``
and ``chunklists/<rank>.json``, and stay readable.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Literal

from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import COMMIT_NAME, MANIFEST_NAME, check_file_name, check_job_id

__all__ = [
    "INDEX_CHUNK_RANKS",
    "LAYOUT_VERSION",
    "LEGACY_COMPLETE_LIMIT",
    "SMALL_OBJECT_LIMIT",
    "SUMMARY_METADATA_KEY",
    "BucketLayout",
    "CatalogChange",
    "ChunkList",
    "ChunkListRef",
    "ChunkRef",
    "DataRef",
    "FileChunks",
    "IndexChunk",
    "KeyKind",
    "ObjectTooLarge",
    "ParsedKey",
    "PurgeFence",
    "RankBackup",
    "RankIndex",
    "RankRef",
    "RankSummary",
    "ShareDone",
    "StepBackup",
    "StepRefused",
    "StepStarted",
    "SweepLock",
    "WriterLease",
    "complete_read_limit",
    "encode_small",
    "job_from_prefix",
    "job_prefix",
    "parse_gs_url",
    "save_name",
    "split_job_id",
]

LAYOUT_VERSION = 4
"""1: the completion object lists every rank. 2: it points at index chunks (``RankIndex``), every small
object is bounded by ``SMALL_OBJECT_LIMIT``, rank commits carry a ``RankSummary`` in their metadata, and
``catalog.json`` marks each change of the catalog. 3: data files are content-addressed chunks
(``ChunkList``, ``chunks/``). 4: a rank's objects are under its save's name (``RankBackup.save``).
docs/bucket-layout.md, "Layout versions"."""

SMALL_OBJECT_LIMIT = 1 << 20
"""The largest small object (completion, index chunk, rank commit, started, refused, catalog, lease) any
reader accepts and any writer writes: ``encode_small`` refuses to produce more."""
LEGACY_COMPLETE_LIMIT = 16 << 20
"""Layout 1 completion objects were written without a bound (112 bytes a rank): readers accept those up
to this size (about 150,000 ranks), so steps an older version completed stay readable."""
INDEX_CHUNK_RANKS = 1024
"""Ranks per index chunk: a chunk is about 45 KiB, a completion object about 80 bytes per chunk (about
8 KiB at 100,000 ranks)."""
SUMMARY_METADATA_KEY = "tierckpt-summary"
"""The object metadata key of a rank commit that holds its ``RankSummary`` (compact JSON)."""

_DNS = r"[a-z0-9](?:[a-z0-9.-]{0,251}[a-z0-9])?"
_K8S_JOB_RE = re.compile(rf"({_DNS})_({_DNS})_([a-z0-9]{{8}})")
"""The shape ``contract.job_id_for`` produces; its parts contain no ``_``, so the split is unique."""
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*")
_STEP_PART = r"([0-9]{12,})"
_RANK_PART = r"([0-9]{5,})"
_PART_RE = re.compile(r"[0-9]{3}")
_SAVE_RE = re.compile(r"[0-9a-f]{8}")
_WRITER_RE = re.compile(r"[A-Za-z0-9_.-]{1,160}")
"""A writer's name in ``writers/<step>/<writer>.json``: the node's name (made safe) and a nonce."""
_CHUNK_KEY_RE = re.compile(r"([0-9a-f]{64})\.([a-z0-9]{1,16})")
"""``chunks/<sha256>.<codec>``."""
_SHARE_RE = re.compile(r"([0-9]{6})-([A-Za-z0-9_.-]{1,160})\.json")
"""Every pattern here is matched whole (``re.fullmatch``) and ASCII only (``[0-9]``, not ``\\d``)."""

KeyKind = Literal[
    "complete",
    "started",
    "refused",
    "rank_commit",
    "rank_file",
    "part",
    "index",
    "share",
    "writer",
    "fence",
    "catalog",
    "chunk",
    "chunk_list",
    "sweep",
    "other",
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


@functools.lru_cache(maxsize=4096)
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
    save: str | None = None


def save_name(manifest_crc32c: int) -> str:
    """The name of a save's objects in the bucket (layout 4): its manifest's crc32c, 8 hex digits."""
    if not isinstance(manifest_crc32c, int) or not 0 <= manifest_crc32c < 1 << 32:
        raise FormatError(f"invalid manifest crc32c {manifest_crc32c!r}")
    return f"{manifest_crc32c:08x}"


def _save_part(save: str | None) -> str:
    if save is None:
        return ""
    if not isinstance(save, str) or not _SAVE_RE.fullmatch(save):
        raise FormatError(f"invalid save name {save!r}")
    return f"{save}/"


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

    def rank_file_key(self, job: str, step: int, rank: int, name: str, save: str | None) -> str:
        """The object of the file ``name`` of one save of a rank (``save``: ``RankBackup.save``; None:
        a rank commit of layouts 1-3)."""
        if name not in (COMMIT_NAME, MANIFEST_NAME):
            check_file_name(name)
        return f"{self.rank_dir(job, step, rank)}{_save_part(save)}{name}"

    def part_key(self, job: str, step: int, rank: int, name: str, index: int, save: str | None) -> str:
        check_file_name(name)
        if not 0 <= index < 1000:
            raise FormatError(f"slice index {index} out of range")
        return f"{self.rank_dir(job, step, rank)}{_save_part(save)}.parts/{name}/{index:03d}"

    def index_dir(self, job: str, step: int, writer: str) -> str:
        """The index chunks one completer wrote for ``step`` (``writer``: its name and a nonce)."""
        _check_writer(writer)
        return f"{self.step_dir(job, step)}index/{writer}/"

    def index_key(self, job: str, step: int, writer: str, chunk: int) -> str:
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 <= chunk < 100_000:
            raise FormatError(f"invalid index chunk {chunk!r}")
        return f"{self.index_dir(job, step, writer)}{chunk:05d}.json"

    def shares_dir(self, job: str, step: int) -> str:
        return f"{self.step_dir(job, step)}shares/"

    def share_key(self, job: str, step: int, writer: str, ranks: int) -> str:
        """A node's ``ShareDone``: ``ranks`` (how many it committed) is in the name, so a listing of the
        step's shares counts its committed ranks."""
        _check_writer(writer)
        if not isinstance(ranks, int) or isinstance(ranks, bool) or not 0 < ranks < 1_000_000:
            raise FormatError(f"invalid share size {ranks!r}")
        return f"{self.shares_dir(job, step)}{ranks:06d}-{writer}.json"

    def ranks_of_share(self, job: str, step: int, key: str) -> int | None:
        """How many ranks the share ``key`` (a name from a listing of ``shares_dir``) counts."""
        prefix = self.shares_dir(job, step)
        m = _SHARE_RE.fullmatch(key, len(prefix)) if key.startswith(prefix) else None
        if m is None or m.group(2).startswith("."):
            return None
        return int(m.group(1))

    def catalog_key(self, job: str) -> str:
        return f"{self.job(job)}catalog.json"

    def writers_dir(self, job: str) -> str:
        return f"{self.job(job)}writers/"

    def step_writers_dir(self, job: str, step: int) -> str:
        return f"{self.writers_dir(job)}{_step(step)}/"

    def writer_key(self, job: str, step: int, writer: str) -> str:
        _check_writer(writer)
        return f"{self.step_writers_dir(job, step)}{writer}.json"

    def step_of_writer(self, job: str, key: str) -> int | None:
        """The step a writer lease ``writers/<step>/<writer>.json`` is held for."""
        m = re.fullmatch(re.escape(self.writers_dir(job)) + _STEP_PART + r"/[^/]+\.json", key)
        return int(m.group(1)) if m else None

    def purge_fence_key(self, job: str) -> str:
        return f"{self.job(job)}purging.json"

    def sweep_key(self, job: str) -> str:
        return f"{self.job(job)}sweeping.json"

    def chunks_dir(self, job: str) -> str:
        return f"{self.job(job)}chunks/"

    def chunk_key(self, job: str, name: str, codec: str) -> str:
        key = f"{name}.{codec}"
        if not _CHUNK_KEY_RE.fullmatch(key):
            raise FormatError(f"invalid chunk {key!r}")
        return f"{self.chunks_dir(job)}{key}"

    def chunk_of_key(self, job: str, key: str) -> tuple[str, str] | None:
        """``(name, codec)`` of a key from a listing of ``chunks_dir``."""
        prefix = self.chunks_dir(job)
        m = _CHUNK_KEY_RE.fullmatch(key, len(prefix)) if key.startswith(prefix) else None
        return (m.group(1), m.group(2)) if m else None

    def chunk_lists_dir(self, job: str, step: int) -> str:
        return f"{self.step_dir(job, step)}chunklists/"

    def chunk_list_key(self, job: str, step: int, rank: int, save: str | None) -> str:
        """The chunk list of one save of a rank (``save`` as in ``rank_file_key``)."""
        name = _rank(rank) if save is None else f"{_rank(rank)}-{_save_part(save)[:-1]}"
        return f"{self.chunk_lists_dir(job, step)}{name}.json"

    def chunk_lists_of(self, job: str, step: int, rank: int) -> str:
        """The prefix of every chunk list of ``rank`` in ``step`` (of every save; it also prefixes those
        of ranks with more digits: ``parse`` tells them apart)."""
        return f"{self.chunk_lists_dir(job, step)}{_rank(rank)}"

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


def _check_writer(writer: str) -> None:
    if not _WRITER_RE.fullmatch(writer) or writer.startswith("."):
        raise FormatError(f"invalid writer name {writer!r}")


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
    if parts == ["catalog.json"]:
        return ParsedKey(job, "catalog")
    if parts == ["sweeping.json"]:
        return ParsedKey(job, "sweep")
    if len(parts) == 2 and parts[0] == "chunks" and _CHUNK_KEY_RE.fullmatch(parts[1]):
        return ParsedKey(job, "chunk", file=parts[1])
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
    if len(parts) == 4 and parts[2] == "chunklists":
        m = re.fullmatch(_RANK_PART + r"(?:-([0-9a-f]{8}))?\.json", parts[3])
        if m:
            return ParsedKey(job, "chunk_list", step=step, rank=int(m.group(1)), save=m.group(2))
        return other
    if len(parts) == 4 and parts[2] == "shares" and (m := _SHARE_RE.fullmatch(parts[3])):
        if not m.group(2).startswith("."):
            return ParsedKey(job, "share", step=step, part=int(m.group(1)))
        return other
    if len(parts) == 5 and parts[2] == "index" and (m := re.fullmatch(r"([0-9]{5})\.json", parts[4])):
        if _WRITER_RE.fullmatch(parts[3]) and not parts[3].startswith("."):
            return ParsedKey(job, "index", step=step, part=int(m.group(1)))
        return other
    m = re.fullmatch(r"rank-" + _RANK_PART, parts[2])
    if not m:
        return other
    rank = int(m.group(1))
    save = parts[3] if len(parts) > 4 and _SAVE_RE.fullmatch(parts[3]) else None
    rest = parts[4:] if save is not None else parts[3:]
    if len(rest) == 1:
        return ParsedKey(job, "rank_file", step=step, rank=rank, file=rest[0], save=save)
    if len(rest) == 3 and rest[0] == ".parts" and _PART_RE.fullmatch(rest[2]):
        return ParsedKey(job, "part", step=step, rank=rank, file=rest[1], part=int(rest[2]), save=save)
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
    chunks: ChunkListRef | None = None
    """Layout 3: the rank's data files are chunks, listed in the save's chunk list
    (``BucketLayout.chunk_list_key``; this size and crc32c); None: they are whole objects (layouts 1
    and 2)."""
    save: str | None = None
    """Layout 4: the name of this save's objects (``save_name`` of ``manifest_crc32c``), in every key
    of them (``BucketLayout.rank_file_key``, ``chunk_list_key``); None: layouts 1-3."""

    def __post_init__(self) -> None:
        if self.data is not None and self.data.rank in (self.rank, None):
            raise FormatError(f"rank {self.rank}: a data reference must name another rank")
        if self.save is not None and self.save != save_name(self.manifest_crc32c):
            raise FormatError(f"rank {self.rank}: save {self.save!r} is not its manifest's crc32c")


@dataclasses.dataclass(frozen=True)
class ChunkListRef(Record):
    """A rank commit's pointer to its ``ChunkList`` object."""

    size: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class ChunkRef(Record):
    """One chunk of a data file: ``chunks/<name>.<codec>``, ``stored`` bytes in the bucket that decode
    to ``size`` raw bytes whose SHA-256 is ``name`` and whose crc32c is ``crc32c`` (the crc32c of the
    chunks, combined, is the file's in its manifest)."""

    name: str
    codec: str
    size: int
    stored: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class FileChunks(Record):
    """A data file's chunks, in order and back to back (each at most ``ChunkList.chunk_size`` bytes)."""

    name: str
    chunks: tuple[ChunkRef, ...]


@dataclasses.dataclass(frozen=True)
class ChunkList(Message):
    """``steps/<step>/chunklists/<rank>.json`` (layout 3): the chunks of each of the rank's data files.
    Written before the rank commit, which records its size and crc32c. Retention keeps every chunk any
    chunk list in the bucket names (``chunkstore.Sweeper``)."""

    KIND = "tierckpt.backup.chunk-list"
    VERSION = 1

    job: str
    step: int
    rank: int
    chunk_size: int
    """The largest chunk the list may hold (4 MiB from writers before 16 MiB chunks inside large
    tensors); readers refuse a larger chunk, and a list saying more than ``chunks.MAX_CHUNK_SIZE``."""
    files: tuple[FileChunks, ...]

    def names(self) -> set[tuple[str, str]]:
        """Every ``(name, codec)`` this list refers to."""
        return {(c.name, c.codec) for f in self.files for c in f.chunks}


@dataclasses.dataclass(frozen=True)
class SweepLock(Message):
    """``sweeping.json``: a node is deleting the job's unreferenced chunks. While it exists, uploads
    reuse no chunk (they upload every chunk again); docs/bucket-layout.md, "Deleting chunks"."""

    KIND = "tierckpt.backup.sweep"
    VERSION = 1

    job: str
    node: str
    started_at: float


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
class RankSummary(Message):
    """What a rank commit says that its completion needs, in the rank commit object's metadata
    (``SUMMARY_METADATA_KEY``): a listing of ``ranks/`` then gives every rank's ``RankRef`` (with the
    object's own size and crc32c) without reading each commit. The commit's body stays the authority:
    readers check the chain against it."""

    KIND = "tierckpt.backup.rank-summary"
    VERSION = 1

    world_size: int
    manifest_crc32c: int
    total_bytes: int
    data_from: int | None = None

    def ref(self, size: int, crc: int) -> RankRef:
        return RankRef(
            size=size,
            crc32c=crc,
            manifest_crc32c=self.manifest_crc32c,
            total_bytes=self.total_bytes,
            data_from=self.data_from,
        )


@dataclasses.dataclass(frozen=True)
class RankIndex(Message):
    """``steps/<step>/index/<writer>/<chunk>.json``: the ``RankRef`` of ranks ``first ..
    first+len(sizes)-1``, column by column (about 45 bytes a rank). Written by the completer before the
    completion object, which records each chunk's size and crc32c."""

    KIND = "tierckpt.backup.index"
    VERSION = 1

    job: str
    step: int
    first: int
    sizes: tuple[int, ...]
    crc32c: tuple[int, ...]
    manifest_crc32c: tuple[int, ...]
    total_bytes: tuple[int, ...]
    data_from: tuple[int | None, ...]

    def __post_init__(self) -> None:
        n = len(self.sizes)
        columns = (self.crc32c, self.manifest_crc32c, self.total_bytes, self.data_from)
        if not 0 < n <= INDEX_CHUNK_RANKS or any(len(c) != n for c in columns) or self.first < 0:
            raise FormatError(f"index chunk of step {self.step} at rank {self.first}: malformed columns")

    @classmethod
    def of(cls, job: str, step: int, first: int, refs: Sequence[RankRef]) -> RankIndex:
        return cls(
            job=job,
            step=step,
            first=first,
            sizes=tuple(r.size for r in refs),
            crc32c=tuple(r.crc32c for r in refs),
            manifest_crc32c=tuple(r.manifest_crc32c for r in refs),
            total_bytes=tuple(r.total_bytes for r in refs),
            data_from=tuple(r.data_from for r in refs),
        )

    def ref(self, rank: int) -> RankRef:
        i = rank - self.first
        if not 0 <= i < len(self.sizes):
            raise FormatError(f"index chunk at rank {self.first} does not hold rank {rank}")
        return RankRef(
            size=self.sizes[i],
            crc32c=self.crc32c[i],
            manifest_crc32c=self.manifest_crc32c[i],
            total_bytes=self.total_bytes[i],
            data_from=self.data_from[i],
        )


@dataclasses.dataclass(frozen=True)
class IndexChunk(Record):
    """A completion object's pointer to one index chunk: ranks ``first .. first+count-1``."""

    first: int
    count: int
    size: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class StepBackup(Message):
    """``complete/<step>.json``: written last, create-only, by a node that saw every rank committed.

    Layout 2 (this version writes): ``index`` points at the index chunks ``index_writer`` wrote, which
    hold the ``RankRef`` of every rank; ``data_bytes`` is the step's total. Layout 1 objects (read
    only) list every rank inline in ``ranks``."""

    KIND = "tierckpt.backup.step"
    VERSION = LAYOUT_VERSION

    job: str
    step: int
    world_size: int
    completed_by: str
    completed_at: float
    ranks: dict[int, RankRef] = dataclasses.field(default_factory=dict)
    """Layout 1: every rank's reference, inline. Empty in layout 2."""
    index_writer: str = ""
    index: tuple[IndexChunk, ...] = ()
    """Layout 2: chunks of ``INDEX_CHUNK_RANKS`` ranks each (the last may hold fewer), in rank order."""
    data_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise FormatError(f"step {self.step} completion: world size {self.world_size}")
        if self.index:
            expected = [
                (first, min(INDEX_CHUNK_RANKS, self.world_size - first))
                for first in range(0, self.world_size, INDEX_CHUNK_RANKS)
            ]
            if self.ranks or [(c.first, c.count) for c in self.index] != expected:
                raise FormatError(
                    f"step {self.step} completion: its index chunks do not cover ranks "
                    f"0..{self.world_size - 1} in chunks of {INDEX_CHUNK_RANKS}"
                )
            _check_writer(self.index_writer)
        elif set(self.ranks) != set(range(self.world_size)):
            raise FormatError(
                f"step {self.step} completion lists ranks {sorted(self.ranks)[:8]}... for world size "
                f"{self.world_size}: every rank 0..{self.world_size - 1} must be listed exactly once"
            )

    @property
    def total_bytes(self) -> int:
        if self.data_bytes is not None:
            return self.data_bytes
        return sum(r.total_bytes for r in self.ranks.values())

    def chunk_of(self, rank: int) -> tuple[int, IndexChunk]:
        """The index chunk holding ``rank`` (layout 2) and its number."""
        if not 0 <= rank < self.world_size or not self.index:
            raise FormatError(f"step {self.step} has no index chunk for rank {rank}")
        number = rank // INDEX_CHUNK_RANKS
        return number, self.index[number]


@dataclasses.dataclass(frozen=True)
class ShareDone(Message):
    """``steps/<step>/shares/<count>-<writer>.json``: ``node`` committed ``ranks`` of the step (its
    share, or a takeover). The count is in the key too: a listing of the step's shares sums them
    without reading any, and the node whose sum reaches the world size completes the step."""

    KIND = "tierckpt.backup.share"
    VERSION = 1

    job: str
    step: int
    node: str
    ranks: tuple[int, ...]
    at: float


@dataclasses.dataclass(frozen=True)
class CatalogChange(Message):
    """``catalog.json``: the last change to the job's catalog (a step started, completed, was refused or
    retired), rewritten after each one. A node whose last look at the bucket was made at this object's
    current generation need not look again: one request tells it nothing changed."""

    KIND = "tierckpt.backup.catalog"
    VERSION = 1

    job: str
    step: int
    change: str
    by: str
    at: float


class ObjectTooLarge(FormatError):
    """A small object of the layout would exceed ``SMALL_OBJECT_LIMIT``: every reader would refuse it."""


def encode_small(msg: Message, what: str) -> bytes:
    """``msg``'s bytes, or ``ObjectTooLarge`` if they exceed what every reader accepts."""
    body = msg.to_bytes()
    if len(body) > SMALL_OBJECT_LIMIT:
        raise ObjectTooLarge(
            f"{what} would be {len(body)} bytes, over the {SMALL_OBJECT_LIMIT} bytes every reader of the "
            "bucket accepts; not written"
        )
    return body


def complete_read_limit(listed_size: int) -> int:
    """How many bytes a reader accepts of a completion object of ``listed_size`` bytes: the bound of
    every small object, or for a layout 1 object written before the bound, ``LEGACY_COMPLETE_LIMIT``."""
    return SMALL_OBJECT_LIMIT if listed_size <= SMALL_OBJECT_LIMIT else LEGACY_COMPLETE_LIMIT


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
