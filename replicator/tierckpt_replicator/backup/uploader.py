"""Upload one rank's committed step from the ramdisk to the bucket (blocking; transfers in a pool).

Order, per rank: every file (in parallel; files larger than ``slice_size`` as parallel slices composed
server side), then the ``COMMIT`` and ``manifest.json`` bytes, then the create-only rank commit object.
Every object is checked against the crc32c the manifest (or commit marker) records, so a shard that
rotted on the ramdisk or in flight never gets a rank commit. Objects already in the bucket with the
right size and crc32c (an earlier, interrupted attempt) are not uploaded again.

Every object of a rank's upload is its save's own (bucket layout 4: keys under ``save_name`` of its
manifest's crc32c), so an upload never writes over another save's objects. If a rank commit for the
same step and rank already exists with a different manifest (a step number saved again by a later
attempt of the job), the newer save wins while the step is incomplete; a complete step is never
touched (an upload of another save that was under way when it completed writes only objects of its own
save, then its rank commit is refused).

A rank saved in a replica group whose data rank (``spread.data_rank``: one member per group and step)
is another member uploads only its small files when that member's rank commit appears (within
``group_wait`` seconds) with a manifest of the same content key (recomputed from both manifests); its
rank commit then names the member (``RankBackup.data``), and readers take the data objects from there.
Otherwise (a diverged save, other content, no such commit in time) it uploads everything, as without
groups.

The step is read through its job's confined tree (a ``Beneath`` view): a data file, COMMIT or manifest
that a pod replaced by a symlink is refused (``UnsafePathError``), so no other job's bytes are uploaded.
A rank whose manifest declares more bytes than its job's quota is refused before any object is written
(``quota.OverQuotaError``: a pod's sparse files would cost the bucket what they never cost the pod).

With ``chunks`` (bucket layout 3, the default), a rank's data files are uploaded as content-addressed
chunks (``chunkstore.ChunkUploads``): the chunks the same rank's previous complete step already holds
are not sent again, and the rank commit points at the rank's chunk list. Its other files (COMMIT,
manifest, pickled objects) stay whole objects.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable

from tierckpt.protocol.bucket_layout import (
    SUMMARY_METADATA_KEY,
    BucketLayout,
    DataRef,
    RankBackup,
    RankSummary,
    encode_small,
    save_name,
)
from tierckpt.protocol.errors import CorruptShardError, FormatError
from tierckpt.protocol.format import (
    COMMIT_LIMIT,
    COMMIT_NAME,
    MANIFEST_NAME,
    CommitMarker,
    Dir,
    FileEntry,
    Manifest,
    as_tree,
)
from tierckpt.protocol.integrity import crc32c
from tierckpt.protocol.replica import content_key
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.backup.catalog import Catalog
from tierckpt_replicator.backup.chunkstore import ChunkUploads
from tierckpt_replicator.backup.fence import JobFenced
from tierckpt_replicator.backup.spread import data_rank
from tierckpt_replicator.backup.store import ObjectInfo, ObjectNotFound, ObjectStore, PreconditionFailed
from tierckpt_replicator.quota import JobQuotas
from tierckpt_replicator.stepio import is_data_file, open_files

__all__ = ["RankUpload", "StaleStepError", "Uploader", "plan_slices"]

log = logging.getLogger(__name__)

MAX_COMPOSE = 32


class StaleStepError(FormatError):
    """The bucket already holds this step and rank from a different (newer, or complete) save."""


@dataclasses.dataclass(frozen=True)
class RankUpload:
    """What uploading one rank did."""

    commit: RankBackup
    bytes_sent: int
    skipped: bool
    """True when the rank was already committed in the bucket with the same manifest."""
    logical_bytes: int = 0
    """Bytes this upload would have sent without replica group dedup (0 when skipped)."""
    reused_bytes: int = 0
    """Raw bytes of chunks not sent because the bucket holds them from the previous step (layout 3)."""


def plan_slices(size: int, slice_size: int) -> list[tuple[int, int]]:
    """``(offset, length)`` slices of a file: one if ``slice_size`` is 0 or the file is small, else at
    most 32 (the compose limit) of equal size rounded up to 256 KiB."""
    if slice_size <= 0 or size <= slice_size:
        return [(0, size)]
    count = min(MAX_COMPOSE, math.ceil(size / slice_size))
    step = -(-math.ceil(size / count) // (256 << 10)) * (256 << 10)
    return [(off, min(step, size - off)) for off in range(0, size, step)]


class Uploader:
    def __init__(
        self,
        store: ObjectStore,
        layout: BucketLayout,
        catalog: Catalog,
        node: str,
        pool: cf.Executor,
        *,
        slice_size: int = 0,
        max_manifest_bytes: int = 64 << 20,
        on_bytes: Callable[[int], None] | None = None,
        should_stop: Callable[[str], bool] | None = None,
        group_wait: float = 60.0,
        quotas: JobQuotas,
        chunks: ChunkUploads | None = None,
    ) -> None:
        self.chunks = chunks
        self.group_wait = group_wait
        self.quotas = quotas
        self.store, self.layout, self.catalog, self.node, self.pool = store, layout, catalog, node, pool
        self.should_stop = should_stop or (lambda job: False)
        self.slice_size = slice_size
        self.max_manifest_bytes = max_manifest_bytes
        self.on_bytes = on_bytes or (lambda n: None)

    def upload_rank(self, job: str, step_path: Dir) -> RankUpload:
        """Upload the committed step at ``step_path`` (the view of a primary or replica step dir of
        ``job`` in its job tree, or a path)."""
        with as_tree(step_path) as step:
            return self._upload_rank(job, step)

    def _upload_rank(self, job: str, step_path: Beneath) -> RankUpload:
        self._check_stop(job)
        commit_bytes, manifest_bytes, marker, manifest = self._read_local(step_path)
        rank, step = manifest.rank, manifest.step
        if manifest.job != job:
            raise FormatError(f"{step_path.where} belongs to job {manifest.job!r}, not {job!r}")
        with open_files(step_path, manifest) as fds:  # before anything goes to the bucket
            self.quotas.check(manifest, fds=fds)
        save = save_name(marker.manifest_crc32c)
        present = {o.name: o for o in self.store.list(self.layout.rank_dir(job, step, rank))[0]}
        replaced = False
        if self._saved_before(job, step, rank, present):
            # this rank's COMMIT or manifest is in the bucket: it may be committed (by this save or
            # another one), or be an older save's upload that this one replaces
            existing = self._existing_commit(job, step, rank)
            if existing is not None:
                if existing.manifest_crc32c == marker.manifest_crc32c:
                    return RankUpload(existing, 0, skipped=True)
                self._replace_stale(job, step, rank, existing, manifest)
                replaced = True
        ref = self._data_ref(job, manifest)
        chunked = self.chunks is not None and ref is None
        whole = tuple(f for f in manifest.files if (ref is None and not chunked) or not is_data_file(f.name))
        sent = self._upload_files(job, step, rank, save, step_path, whole, present)
        listed, reused = None, 0
        if self.chunks is not None and chunked:
            reuse = self.chunks.reusable(job, step, rank)
            data = [f for f in manifest.files if is_data_file(f.name)]
            lists, more, reused = self.chunks.upload_files(job, step_path, data, manifest.tensors, reuse)
            listed = self.chunks.put_list(job, step, rank, save, lists)
            sent += more
        self._check_stop(job)
        for name, body in ((COMMIT_NAME, commit_bytes), (MANIFEST_NAME, manifest_bytes)):
            self.store.put_bytes(self.layout.rank_file_key(job, step, rank, name, save), body)
        commit = RankBackup(
            job=job,
            step=step,
            rank=rank,
            world_size=manifest.world_size,
            commit_size=len(commit_bytes),
            commit_crc32c=crc32c(commit_bytes),
            manifest_size=len(manifest_bytes),
            manifest_crc32c=marker.manifest_crc32c,
            total_bytes=manifest.total_bytes,
            saved_at=manifest.created_at,
            uploaded_by=self.node,
            uploaded_at=time.time(),
            data=ref,
            chunks=listed,
            save=save,
        )
        other = self._put_commit(commit, replaced=replaced)
        if other is not None:
            return RankUpload(
                other, sent, skipped=False, logical_bytes=manifest.total_bytes, reused_bytes=reused
            )
        how = f", data files are rank {ref.rank}'s" if ref is not None else ""
        how += f", {reused} bytes of chunks reused" if listed is not None else ""
        log.info("uploaded rank %d of step %d of %s (%d bytes sent%s)", rank, step, job, sent, how)
        return RankUpload(
            commit, sent, skipped=False, logical_bytes=manifest.total_bytes, reused_bytes=reused
        )

    def _put_commit(self, commit: RankBackup, *, replaced: bool) -> RankBackup | None:
        """Create the rank commit (create-only, its ``RankSummary`` in its metadata): None once it is in,
        or the commit another node created first of the same save (``StaleStepError`` if of another
        save). ``replaced``: this upload replaced another save's commit, and a node may have completed
        the step from that one meanwhile (``Catalog.withdraw_unless_indexed``)."""
        job, step, rank = commit.job, commit.step, commit.rank
        summary = RankSummary(
            world_size=commit.world_size,
            manifest_crc32c=commit.manifest_crc32c,
            total_bytes=commit.total_bytes,
            data_from=commit.data.rank if commit.data is not None else None,
        )
        body = encode_small(commit, f"the rank commit of rank {rank} of step {step}")
        try:
            self.store.put_bytes(
                self.layout.rank_commit_key(job, step, rank),
                body,
                create_only=True,
                metadata={SUMMARY_METADATA_KEY: summary.to_bytes().decode()},
            )
        except PreconditionFailed:
            other = self.catalog.read_rank_commit(job, step, rank)
            if other.manifest_crc32c != commit.manifest_crc32c:
                raise StaleStepError(
                    f"rank {rank} of step {step} was committed by {other.uploaded_by} with another manifest "
                    "while we uploaded it"
                ) from None
            return other
        if replaced:
            self.catalog.withdraw_unless_indexed(job, step, rank, len(body), crc32c(body))
        return None

    def _data_ref(self, job: str, manifest: Manifest) -> DataRef | None:
        """The member whose uploaded data files are this rank's, or None (upload them here)."""
        record = manifest.replica
        if record is None or not record.known or record.diverged or len(record.members) < 2:
            return None
        step, rank = manifest.step, manifest.rank
        source = data_rank(job, step, record.members)
        mine = content_key(manifest.files, manifest.tensors)
        if source == rank or mine != record.content:
            return None
        deadline = time.monotonic() + self.group_wait
        while (other := self._existing_commit(job, step, source)) is None:
            self._check_stop(job)
            if time.monotonic() >= deadline:
                log.info(
                    "rank %d of step %d of %s: rank %d (its group's data rank) is not in the bucket after "
                    "%.0fs; uploading the data files here",
                    rank,
                    step,
                    job,
                    source,
                    self.group_wait,
                )
                return None
            time.sleep(0.2)
        if other.data is not None:
            return None
        key = self.layout.rank_file_key(job, step, source, MANIFEST_NAME, other.save)
        body = self.store.get_bytes(key, max_size=self.max_manifest_bytes)
        if len(body) != other.manifest_size or crc32c(body) != other.manifest_crc32c:
            raise CorruptShardError(f"gs object {key} does not match its rank commit", path=key)
        theirs = Manifest.from_bytes(body)
        same = (
            theirs.replica is not None
            and not theirs.replica.diverged
            and theirs.replica.group == record.group
            and content_key(theirs.files, theirs.tensors) == mine
        )
        if not same:
            log.warning(
                "rank %d of step %d of %s: rank %d in the bucket holds other content; uploading its own "
                "data files (replica group %s not deduplicated)",
                rank,
                step,
                job,
                source,
                record.group,
            )
            return None
        return DataRef(rank=source, content=mine)

    # ------------------------------------------------------------------------------------ helpers

    def _check_stop(self, job: str) -> None:
        if self.should_stop(job):
            raise JobFenced(f"uploads of job {job} stopped: it is being purged on this node")

    def _read_local(self, step_path: Beneath) -> tuple[bytes, bytes, CommitMarker, Manifest]:
        where = step_path.where
        commit_bytes = step_path.read_bytes(COMMIT_NAME, limit=COMMIT_LIMIT)
        marker = CommitMarker.from_bytes(commit_bytes)
        if marker.manifest_size > self.max_manifest_bytes:
            raise FormatError(f"{where}: manifest of {marker.manifest_size} bytes is over the limit")
        manifest_bytes = step_path.read_bytes(MANIFEST_NAME, limit=marker.manifest_size + 1)
        if len(manifest_bytes) != marker.manifest_size or crc32c(manifest_bytes) != marker.manifest_crc32c:
            raise CorruptShardError(f"{where}/{MANIFEST_NAME} does not match its commit marker", path=where)
        manifest = Manifest.from_bytes(manifest_bytes)
        if (manifest.step, manifest.rank) != (marker.step, marker.rank):
            raise FormatError(f"{where}: manifest and commit marker disagree on step or rank")
        return commit_bytes, manifest_bytes, marker, manifest

    def _saved_before(self, job: str, step: int, rank: int, present: dict[str, ObjectInfo]) -> bool:
        """Whether a save of this rank (any) got as far as its COMMIT or manifest: a rank commit is created
        only after both, and deleted before them. A fresh upload (none there) reads no rank commit."""
        names = (COMMIT_NAME, MANIFEST_NAME)
        return any(
            (p := self.layout.parse(key)) is not None
            and (p.kind, p.step, p.rank) == ("rank_file", step, rank)
            and p.file in names
            for key in present
        )

    def _existing_commit(self, job: str, step: int, rank: int) -> RankBackup | None:
        try:
            return self.catalog.read_rank_commit(job, step, rank)
        except ObjectNotFound:
            return None

    def _replace_stale(self, job: str, step: int, rank: int, old: RankBackup, manifest: Manifest) -> None:
        if self.store.stat(self.layout.complete_key(job, step)) is not None:
            raise StaleStepError(f"step {step} of {job} is already complete in the bucket from another save")
        if old.saved_at >= manifest.created_at:
            raise StaleStepError(
                f"rank {rank} of step {step} is in the bucket from a newer save "
                f"({old.saved_at:.3f} >= {manifest.created_at:.3f}); not uploading this copy"
            )
        log.warning("rank %d of step %d of %s: replacing an older save's upload", rank, step, job)
        self.store.delete(self.layout.rank_commit_key(job, step, rank))

    def _upload_files(
        self,
        job: str,
        step: int,
        rank: int,
        save: str,
        step_path: Beneath,
        files: tuple[FileEntry, ...],
        present: dict[str, ObjectInfo],
    ) -> int:
        """Upload the files not already present; large ones as slices composed afterwards. All transfers
        go to the pool from this (orchestrating) thread, so pool workers never wait on each other."""
        # Kept over google.cloud.storage.transfer_manager.upload_chunks_concurrently: it uses the XML
        # multipart upload API, which fake-gcs-server does not implement (404 on the initiate request,
        # bench/gcs_bench.py --transfer-manager), so it could not be measured, nor tested end to end
        # like every other bucket path here. It also fits less well: no cancellation (``should_stop``),
        # no progress callback, and a pool of its own per file (ours: one pool bounds every transfer
        # of the service). Ours on the same runs (8 workers, 64 MiB slices): 1 GiB at 112 / 80 MB/s,
        # plain upload_from_filename 66 / 55 MB/s; 256 MiB at 107 / 65, plain 85 / 78.
        futures: list[cf.Future[None]] = []
        composed: list[tuple[FileEntry, list[str]]] = []
        key_of: dict[str, str] = {}
        sent = 0
        for f in files:
            key = self.layout.rank_file_key(job, step, rank, f.name, save)
            have = present.get(key)
            if have is not None and have.size == f.size and have.crc32c == f.crc32c:
                continue
            sent += f.size
            slices = plan_slices(f.size, self.slice_size)
            if len(slices) == 1:
                futures.append(self.pool.submit(self._put, job, key, step_path, f.name, 0, f.size, f.crc32c))
                continue
            parts = [self.layout.part_key(job, step, rank, f.name, i, save) for i in range(len(slices))]
            composed.append((f, parts))
            key_of[f.name] = key
            for part, (off, length) in zip(parts, slices, strict=True):
                futures.append(self.pool.submit(self._put, job, part, step_path, f.name, off, length, None))
        try:
            _wait_all(futures)
            _wait_all(
                [
                    self.pool.submit(self._compose, key_of[f.name], step_path, f, parts)
                    for f, parts in composed
                ]
            )
        finally:
            leftovers = [p for _, parts in composed for p in parts]
            cf.wait([self.pool.submit(self.store.delete, p) for p in leftovers])
        return sent

    def _put(
        self, job: str, key: str, step: Beneath, name: str, offset: int, length: int, crc: int | None
    ) -> None:
        self._check_stop(job)
        fd = step.open_fd(name)  # a regular file of the step, reached through no symlink
        try:
            self.store.upload_file(key, fd, offset=offset, length=length, crc32c=crc)
        finally:
            os.close(fd)
        self.on_bytes(length)

    def _compose(self, key: str, path: Beneath, f: FileEntry, parts: list[str]) -> None:
        """Compose a file's slices into ``key`` and check the result against the manifest's size and
        crc32c."""
        info = self.store.compose(key, parts)
        if info.crc32c != f.crc32c or info.size != f.size:
            self.store.delete(key)
            raise CorruptShardError(
                f"{path.where}/{f.name}: composed object has crc32c {info.crc32c} size {info.size}, "
                f"manifest says {f.crc32c:08x} size {f.size}",
                path=f"{path.where}/{f.name}",
            )


def _wait_all(futures: list[cf.Future[None]]) -> None:
    """Wait for every future; re-raise the first failure after cancelling what has not started."""
    try:
        for fut in cf.as_completed(futures):
            fut.result()
    except BaseException:
        for fut in futures:
            fut.cancel()
        cf.wait(futures)
        raise
