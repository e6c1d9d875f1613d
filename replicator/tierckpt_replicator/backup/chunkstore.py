"""Content-addressed chunks of bucket layout 3: uploading a rank's data files as chunks, reading them
back, and deleting the chunks no step refers to any more (blocking; transfers in the service's pool).

Spec: docs/bucket-layout.md, "Chunks (layout 3)". In short:

* **Upload** (``ChunkUploads``, under the writer's lease of the step): wait until no sweep runs
  (``sweeping.json`` absent), then read the chunk list of the same rank in the newest complete step
  before this one (or of the replica group member its data files referred to there), and check that
  step is still complete. Its chunks are in the bucket and stay there
  (below), so every chunk of this rank whose ``(SHA-256, codec)`` it names is not uploaded again. Every
  other chunk is read once into memory, hashed, checked and encoded from that one copy (a pod that
  rewrites its file meanwhile cannot make a chunk's content differ from its name), and uploaded. The
  chunks' crc32c, combined, must be the manifest's for the file, or nothing is committed.
* **Restore** (``ChunkReads``): every distinct chunk of a rank is downloaded once, its stored size
  bounded by the chunk list, decoded with its raw size as the bound, and trusted only if its SHA-256 is
  its name (a raw chunk's taken as it streams into place); the chunk list's crc32c of its chunks,
  combined, must be the manifest's for the file.
* **Sweep** (``Sweeper``, by the node that runs retention, under its writer lease): create
  ``sweeping.json``; if any other writer holds a live lease, give up until the next pass; otherwise list
  the chunks, then every chunk list of every step still in the bucket (complete, in progress, or
  abandoned), delete the chunks none of them names, and delete ``sweeping.json``.

Why a chunk a step needs is never deleted: a step's chunk lists are deleted only after its completion
object, so while a step is complete its chunk lists are there for every sweep to see. An upload that
reuses a chunk holds its writer lease from before it looked for ``sweeping.json`` until its rank commit
returned: a sweep that creates ``sweeping.json`` later sees the lease and deletes nothing; one that
created it before had finished (the upload waited for it to be gone), and the step it reuses chunks of
was still complete after that, so that sweep kept them. A purge deletes the chunks with the rest of the
job (``fence.Fences.purge``); a sweep, like any writer, holds a lease the purge waits for.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence

from tierckpt.protocol.bucket_layout import (
    BucketLayout,
    ChunkList,
    ChunkListRef,
    ChunkRef,
    FileChunks,
    RankBackup,
    SweepLock,
    encode_small,
)
from tierckpt.protocol.chunks import (
    CHUNK_SIZE,
    MAX_CHUNK_SIZE,
    MAX_CHUNKS,
    TENSOR_CHUNK_SIZE,
    ChunkDigest,
    chunk_name,
    is_chunk_name,
    plan_chunks,
)
from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError
from tierckpt.protocol.format import FileEntry, TensorEntry
from tierckpt.protocol.integrity import crc32c, crc32c_concat
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.backup.catalog import Catalog
from tierckpt_replicator.backup.chunkcodec import (
    CODECS,
    Compression,
    chunk_width,
    decode,
    encode,
    stored_limit,
)
from tierckpt_replicator.backup.store import (
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    UploadCorrupted,
)

__all__ = ["ChunkReads", "ChunkUploads", "Sweeper", "check_chunks"]

log = logging.getLogger(__name__)

Reuse = Mapping[tuple[str, str], ChunkRef]


def check_chunks(entry: FileEntry, chunks: FileChunks, chunk_size: int) -> list[int]:
    """A chunk list's chunks of ``entry`` as every reader requires them: well-named, a known codec,
    1 to ``chunk_size`` raw bytes each (the list's, at most ``MAX_CHUNK_SIZE``), the file's size in all,
    stored sizes within the codec's bound (what is then downloaded is bounded by the chunk list alone).
    Returns each chunk's offset."""
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise FormatError(f"chunk size {chunk_size} out of range")
    if len(chunks.chunks) > MAX_CHUNKS:
        raise FormatError(f"{entry.name}: {len(chunks.chunks)} chunks, more than {MAX_CHUNKS}")
    offsets, end = [], 0
    for c in chunks.chunks:
        if not is_chunk_name(c.name) or c.codec not in CODECS or not 0 < c.size <= chunk_size:
            raise FormatError(f"{entry.name}: malformed chunk {c.name[:70]!r}.{c.codec[:20]!r}")
        if not 0 <= c.stored <= stored_limit(c.size):
            raise FormatError(f"{entry.name}: chunk {c.name} of {c.stored} stored bytes for {c.size}")
        offsets.append(end)
        end += c.size
    if end != entry.size:
        raise FormatError(f"{entry.name}: its chunks hold {end} bytes, the manifest says {entry.size}")
    return offsets


@dataclasses.dataclass
class _Sent:
    bytes: int = 0
    reused: int = 0


class ChunkUploads:
    """The uploader's side: ``reusable`` then ``upload_files`` and ``put_list``, under a writer lease."""

    def __init__(
        self,
        store: ObjectStore,
        layout: BucketLayout,
        catalog: Catalog,
        pool: cf.Executor,
        *,
        compression: Compression,
        max_list_bytes: int,
        on_bytes: Callable[[int], None],
        check_stop: Callable[[str], None],
        sweep_wait: float = 120.0,
        chunk_size: int = CHUNK_SIZE,
        tensor_chunk_size: int = TENSOR_CHUNK_SIZE,
    ) -> None:
        self.store, self.layout, self.catalog, self.pool = store, layout, catalog, pool
        self.compression, self.max_list_bytes = compression, max_list_bytes
        self.on_bytes, self.check_stop = on_bytes, check_stop
        self.sweep_wait, self.chunk_size, self.tensor_chunk_size = sweep_wait, chunk_size, tensor_chunk_size

    def reusable(self, job: str, step: int, rank: int) -> Reuse:
        """The chunks this rank may refer to without uploading them: those of its data files in the
        newest complete step before ``step``: its own chunk list, or, if its data files there were
        another replica group member's (``RankBackup.data``: the group's upload rotates over its
        members), that member's (none if there is none, or it cannot be read)."""
        self._wait_for_sweep(job)
        complete = [s for s in self.catalog.complete_steps(job) if s < step]
        if not complete:
            return {}
        prev = max(complete)
        try:
            commit = self.catalog.read_rank_commit(
                job, prev, rank, ref=self.catalog.rank_ref(job, prev, rank)
            )
            source = rank if commit.data is None else commit.data.rank
            listed = read_chunk_list(
                self.store,
                self.layout,
                self.catalog,
                job,
                prev,
                source,
                self.max_list_bytes,
                commit if source == rank else None,
            )
        except (FormatError, ObjectNotFound, MissingCheckpointError) as exc:
            log.info("rank %d of %s: no chunks of step %d to reuse (%s)", rank, job, prev, exc)
            return {}
        if listed is None:
            return {}
        if self.store.stat(self.layout.complete_key(job, prev)) is None:
            log.info("rank %d of %s: step %d was retired meanwhile; reusing no chunk", rank, job, prev)
            return {}
        return {(c.name, c.codec): c for f in listed.files for c in f.chunks}

    def _wait_for_sweep(self, job: str) -> None:
        """Return once no sweep of ``job``'s chunks is under way: ``sweeping.json`` gone, or left by a
        sweeper that died (its generation unchanged for ``sweep_wait`` seconds: deleted)."""
        key = self.layout.sweep_key(job)
        seen: tuple[int, float] | None = None
        while (info := self.store.stat(key)) is not None:
            now = time.monotonic()
            if seen is None or seen[0] != info.generation:
                seen = (info.generation, now)
            elif now - seen[1] >= self.sweep_wait:
                log.warning("job %s: %s unchanged for %.0fs: its sweeper is gone", job, key, self.sweep_wait)
                self.store.delete(key)
                return
            self.check_stop(job)
            time.sleep(0.2)

    def upload_files(
        self,
        job: str,
        step_path: Beneath,
        files: Sequence[FileEntry],
        tensors: Sequence[TensorEntry],
        reuse: Reuse,
    ) -> tuple[tuple[FileChunks, ...], int, int]:
        """Upload the chunks of ``files`` that ``reuse`` does not name; ``(chunks of each file, bytes
        sent, bytes reused)``."""
        sent = _Sent()
        jobs: list[tuple[FileEntry, list[cf.Future[ChunkRef]]]] = []
        for f in files:
            mine = sorted((t for t in tensors if t.file == f.name), key=lambda t: t.offset)
            futures = [
                self.pool.submit(self._chunk, job, step_path, f.name, off, length, mine, reuse, sent)
                for off, length in plan_chunks(
                    f.size,
                    [(t.offset, t.length) for t in mine],
                    self.chunk_size,
                    tensor_chunk_size=self.tensor_chunk_size,
                )
            ]
            jobs.append((f, futures))
        out = []
        try:
            for f, futures in jobs:
                refs = tuple(fut.result() for fut in futures)
                got = crc32c_concat([(c.crc32c, c.size) for c in refs]) if refs else crc32c(b"")
                if got != f.crc32c:
                    raise CorruptShardError(
                        f"{step_path.where}/{f.name}: its chunks have crc32c {got:08x}, manifest says "
                        f"{f.crc32c:08x}",
                        path=f"{step_path.where}/{f.name}",
                    )
                out.append(FileChunks(name=f.name, chunks=refs))
        except BaseException:
            for _, futures in jobs:
                for fut in futures:
                    fut.cancel()
            cf.wait([fut for _, futures in jobs for fut in futures])
            raise
        return tuple(out), sent.bytes, sent.reused

    def _chunk(
        self,
        job: str,
        step_path: Beneath,
        name: str,
        offset: int,
        length: int,
        tensors: Sequence[TensorEntry],
        reuse: Reuse,
        sent: _Sent,
    ) -> ChunkRef:
        self.check_stop(job)
        fd = step_path.open_fd(name)
        try:
            raw = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(raw) != length:
            raise FormatError(f"{step_path.where}/{name}: short read at {offset}")
        digest, crc = chunk_name(raw), crc32c(raw)
        width = chunk_width(tensors, offset, length)
        for codec in _candidates(self.compression, width):
            known = reuse.get((digest, codec))
            if known is not None and known.size == length and known.crc32c == crc:
                sent.reused += length
                return known
        codec, blob = encode(raw, self.compression, width)
        key = self.layout.chunk_key(job, digest, codec)
        info = self.store.put_bytes(key, blob)
        if info.crc32c is not None and info.crc32c != crc32c(blob):
            self.store.delete(key)
            raise UploadCorrupted(f"{key}: stored crc32c {info.crc32c:08x} is not the sent bytes'")
        sent.bytes += len(blob)
        self.on_bytes(len(blob))
        return ChunkRef(name=digest, codec=codec, size=length, stored=len(blob), crc32c=crc)

    def put_list(
        self, job: str, step: int, rank: int, save: str, files: tuple[FileChunks, ...]
    ) -> ChunkListRef:
        """Write the chunk list of a save of the rank (before its rank commit, which records the returned
        pointer)."""
        largest = max(self.chunk_size, self.tensor_chunk_size)  # what readers bound every chunk by
        body = ChunkList(job=job, step=step, rank=rank, chunk_size=largest, files=files).to_bytes()
        if len(body) > self.max_list_bytes:
            raise FormatError(f"the chunk list of rank {rank} of step {step} would be {len(body)} bytes")
        self.store.put_bytes(self.layout.chunk_list_key(job, step, rank, save), body)
        return ChunkListRef(size=len(body), crc32c=crc32c(body))


def _candidates(policy: Compression, width: int) -> tuple[str, ...]:
    """The codecs a chunk may already be stored with under ``policy`` (the one it would get, or raw)."""
    if policy == "off":
        return ("raw",)
    if policy == "grouped" and width in (2, 4, 8):
        return (f"g{width}zst", "raw")
    return ("zst", "raw")


def read_chunk_list(
    store: ObjectStore,
    layout: BucketLayout,
    catalog: Catalog,
    job: str,
    step: int,
    rank: int,
    limit: int,
    commit: RankBackup | None = None,
) -> ChunkList | None:
    """The chunk list of ``rank`` in the complete ``step``, verified along the chain (completion ->
    rank commit -> chunk list); None if the rank's data files are not chunks (layouts 1 and 2).
    ``commit``: the rank commit, if the caller verified it already."""
    if commit is None:
        commit = catalog.read_rank_commit(job, step, rank, ref=catalog.rank_ref(job, step, rank))
    if commit.chunks is None:
        return None
    key = layout.chunk_list_key(job, step, rank, commit.save)
    if commit.chunks.size > limit:
        raise FormatError(f"{key}: {commit.chunks.size} bytes, over the {limit} allowed")
    body = store.get_bytes(key, max_size=commit.chunks.size)
    if len(body) != commit.chunks.size or crc32c(body) != commit.chunks.crc32c:
        raise CorruptShardError(f"gs object {key} does not match its rank commit", path=key)
    listed = ChunkList.from_bytes(body)
    if (listed.job, listed.step, listed.rank) != (job, step, rank):
        raise FormatError(f"{key} describes job {listed.job!r} step {listed.step} rank {listed.rank}")
    return listed


class ChunkReads:
    """The restorer's side: a file's chunks into a staged file."""

    def __init__(self, store: ObjectStore, layout: BucketLayout, pool: cf.Executor) -> None:
        self.store, self.layout, self.pool = store, layout, pool

    def fetch(
        self,
        job: str,
        listed: ChunkList,
        entries: Sequence[FileEntry],
        open_fd: Callable[[str], int],
        on_bytes: Callable[[int], None] | None,
    ) -> dict[str, int]:
        """Download the chunks of ``entries`` (each distinct chunk once) and write them at their offsets
        in the files ``open_fd(name)`` opens; the crc32c of each file's bytes, by name."""
        by_name = {f.name: f for f in listed.files}
        places: dict[tuple[str, str], list[tuple[str, int]]] = {}
        refs: dict[tuple[str, str], ChunkRef] = {}
        crcs: dict[str, list[tuple[int, int]]] = {}
        for entry in entries:
            chunks = by_name.get(entry.name)
            if chunks is None:
                raise FormatError(f"the chunk list of rank {listed.rank} has no file {entry.name}")
            offsets = check_chunks(entry, chunks, listed.chunk_size)
            for offset, c in zip(offsets, chunks.chunks, strict=True):
                refs.setdefault((c.name, c.codec), c)
                places.setdefault((c.name, c.codec), []).append((entry.name, offset))
            crcs[entry.name] = [(c.crc32c, c.size) for c in chunks.chunks]
        futures = [self.pool.submit(self._get, job, refs[k], places[k], open_fd, on_bytes) for k in places]
        try:
            for fut in cf.as_completed(futures):
                fut.result()
        except BaseException:
            for fut in futures:
                fut.cancel()
            cf.wait(futures)
            raise
        return {name: crc32c_concat(parts) if parts else crc32c(b"") for name, parts in crcs.items()}

    def _get(
        self,
        job: str,
        ref: ChunkRef,
        places: list[tuple[str, int]],
        open_fd: Callable[[str], int],
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        key = self.layout.chunk_key(job, ref.name, ref.codec)
        raw: bytes | None = None
        if ref.codec == "raw":  # streamed into its first place, its SHA-256 and crc32c taken on the way
            self._stream(key, ref, places[0], open_fd)
            stored, first, places = ref.size, places[0], places[1:]
            if places:  # the same chunk elsewhere in the files: copied from the first, checked again
                raw = _pread(open_fd, first[0], ref.size, first[1])
        else:
            blob = self.store.get_bytes(key, max_size=ref.stored)
            if len(blob) != ref.stored:
                raise CorruptShardError(
                    f"gs object {key}: {len(blob)} bytes, chunk list says {ref.stored}", path=key
                )
            raw = decode(blob, ref.codec, ref.size, what=f"gs object {key}")
            stored = len(blob)
        if raw is not None:
            if len(raw) != ref.size or chunk_name(raw) != ref.name:  # then its crc32c is the list's
                raise CorruptShardError(f"gs object {key}: its content is not its name's", path=key)
            for name, offset in places:
                fd = open_fd(name)
                try:
                    os.pwrite(fd, raw, offset)
                finally:
                    os.close(fd)
        if on_bytes is not None:
            on_bytes(stored)

    def _stream(self, key: str, ref: ChunkRef, place: tuple[str, int], open_fd: Callable[[str], int]) -> None:
        """Download the raw chunk ``ref`` into ``place``, trusted only if the bytes that arrived have the
        listed crc32c and hash to its name (computed as they stream in: not read back)."""
        digest = ChunkDigest()
        fd = open_fd(place[0])
        try:
            got = self.store.download_to(
                key, fd, start=0, length=ref.size, file_offset=place[1], digest=digest
            )
        finally:
            os.close(fd)
        if got != ref.crc32c:
            raise CorruptShardError(
                f"gs object {key}: crc32c {got:08x}, its chunk list says {ref.crc32c:08x}", path=key
            )
        if digest.name() != ref.name:
            raise CorruptShardError(f"gs object {key}: its content is not its name's", path=key)


def _pread(open_fd: Callable[[str], int], name: str, length: int, offset: int) -> bytes:
    fd = open_fd(name)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


class Sweeper:
    """Deletes a job's chunks that no chunk list in the bucket names (see the module docstring)."""

    def __init__(
        self,
        store: ObjectStore,
        layout: BucketLayout,
        node: str,
        pool: cf.Executor,
        *,
        ttl: float,
        max_list_bytes: int,
    ) -> None:
        self.store, self.layout, self.node, self.pool = store, layout, node, pool
        self.ttl, self.max_list_bytes = ttl, max_list_bytes
        self._lists: dict[tuple[str, int], frozenset[tuple[str, str]]] = {}
        """(key, generation) of a chunk list -> the chunks it names (a chunk list never changes)."""

    def sweep(self, job: str, own_lease: str) -> int | None:
        """One sweep of ``job``'s chunks; the chunks deleted, or None if it did not run (another writer
        is active, or another sweep). Call it under a writer lease of the job (``own_lease``: its key)."""
        lock_key = self.layout.sweep_key(job)
        body = encode_small(SweepLock(job=job, node=self.node, started_at=time.time()), "sweeping.json")
        began = time.monotonic()
        try:
            lock = self.store.put_bytes(lock_key, body, create_only=True)
        except PreconditionFailed:
            log.info("job %s: another node is sweeping its chunks", job)
            return None
        try:
            leases, _ = self.store.list(self.layout.writers_dir(job))
            live = [o.name for o in leases if o.name != own_lease and o.updated > lock.updated - self.ttl]
            if live:
                log.info("job %s: chunk sweep put off: %d writer(s) active (%s)", job, len(live), live[0])
                return None
            chunks, _ = self.store.list(self.layout.chunks_dir(job))
            needed = self._referenced(job)
            doomed = [o for o in chunks if self.layout.chunk_of_key(job, o.name) not in needed]
            deleted = 0
            for i in range(0, len(doomed), 256):
                if time.monotonic() - began > self.ttl / 2:  # writers take a lock this old for dead
                    log.warning(
                        "job %s: chunk sweep stopped after %.0fs; the rest at the next", job, self.ttl / 2
                    )
                    break
                deleted += sum(self.pool.map(lambda o: int(self.store.delete(o.name)), doomed[i : i + 256]))
            log.info(
                "job %s: chunk sweep deleted %d of %d chunks (%d referenced)",
                job,
                deleted,
                len(chunks),
                len(needed),
            )
            return deleted
        finally:
            self.store.delete(lock_key)

    def _referenced(self, job: str) -> set[tuple[str, str]]:
        """Every chunk any chunk list of any step in the bucket names. A chunk list that cannot be read
        raises (nothing is deleted)."""
        _, dirs = self.store.list(self.layout.steps_dir(job), delimiter="/")
        infos: list[ObjectInfo] = []
        for d in dirs:
            step = self.layout.step_of_dir(job, d)
            if step is not None:
                infos += self.store.list(self.layout.chunk_lists_dir(job, step))[0]
        needed: set[tuple[str, str]] = set()
        for names in self.pool.map(self._names, infos):
            needed |= names
        seen = {(o.name, o.generation) for o in infos}
        self._lists = {k: v for k, v in self._lists.items() if k in seen}
        return needed

    def _names(self, info: ObjectInfo) -> frozenset[tuple[str, str]]:
        cached = self._lists.get((info.name, info.generation))
        if cached is not None:
            return cached
        try:
            body = self.store.get_bytes(info.name, max_size=self.max_list_bytes)
        except ObjectNotFound:
            return frozenset()  # deleted since the listing: its step is gone
        names = frozenset(ChunkList.from_bytes(body).names())
        self._lists[(info.name, info.generation)] = names
        return names
