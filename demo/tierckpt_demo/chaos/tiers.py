"""What the tiers hold, seen by the harness itself: every committed step on every ramdisk, every complete
step in the bucket, and whether each is whole.

These are the harness's own eyes, independent of the replicators' inventories: a committed step is a
rank directory's ``step-*`` with its COMMIT marker (``tierckpt.protocol.format``), checked byte for byte
by ``tierckpt.verify.step_problems``; a complete backup is a ``complete/<step>.json`` object whose chain
(index chunks, rank commits, COMMIT and manifest objects, every data object's size and crc32c as the
bucket reports them, or in layout 3 the chunk list and every chunk object it names) is checked link by
link (``tierckpt.protocol.bucket_layout``). A step that vanishes while it is
checked (retention, a purge) is not torn: a problem counts only if the step is still committed when
looked at again.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tierckpt.protocol.bucket_layout import (
    BucketLayout,
    ChunkList,
    ChunkListRef,
    RankBackup,
    RankIndex,
    RankRef,
    StepBackup,
)
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import (
    Manifest,
    committed_steps,
    iter_data_files,
    job_dir,
    rank_dir,
    ranks_in,
    read_commit,
    read_manifest,
    replica_rank_dir,
    state_dir,
    step_dir,
)
from tierckpt.protocol.integrity import crc32c, crc32c_concat
from tierckpt.verify import step_problems
from tierckpt_demo.chaos.oracle import Held

__all__ = ["BucketView", "job_leftovers", "scan_node", "torn_on_node"]

log = logging.getLogger(__name__)

_RECHECK_DELAY = 0.2


def _rank_dirs(root: Path, job: str) -> Iterable[tuple[int, bool, Path]]:
    """(rank, replica?, directory) of every rank directory of ``job`` on this ramdisk."""
    for rank in ranks_in(job_dir(root, job)):
        yield rank, False, rank_dir(root, job, rank)
    for rank in ranks_in(job_dir(root, job) / "replicas"):
        yield rank, True, replica_rank_dir(root, job, rank)


def scan_node(node: str, root: Path, job: str) -> list[Held]:
    """Every committed step of ``job`` on this ramdisk (primaries and replicas), with its world size."""
    out = []
    for rank, replica, path in _rank_dirs(root, job):
        for step in committed_steps(path):
            try:
                world = read_manifest(step_dir(path, step)).world_size
            except (FormatError, OSError):
                continue  # retired between the listing and the read
            out.append(Held(node=node, rank=rank, step=step, world=world, replica=replica))
    return out


def torn_on_node(root: Path, job: str) -> list[str]:
    """Committed steps of ``job`` on this ramdisk that are not whole (still so when checked again)."""
    found = []
    for _, _, path in _rank_dirs(root, job):
        for step in committed_steps(path):
            where = step_dir(path, step)
            problems = _problems(where)
            if not problems:
                continue
            time.sleep(_RECHECK_DELAY)
            if not _still_committed(where, step):
                continue
            problems = _problems(where)
            if problems:
                found.append(f"{where}: {'; '.join(problems[:3])}")
    return found


def _problems(where: Path) -> list[str]:
    try:
        return [str(p) for p in step_problems(where)]
    except (FormatError, OSError) as exc:
        return [str(exc)]


def _still_committed(where: Path, step: int) -> bool:
    try:
        marker = read_commit(where)
    except (FormatError, OSError):
        return False
    return marker is not None and marker.step == step


def job_leftovers(root: Path, job: str) -> list[str]:
    """What of ``job`` is on this ramdisk: its directory, its replicator state (after a purge: nothing)."""
    return [str(p) for p in (job_dir(root, job), state_dir(root, job)) if p.exists()]


# --------------------------------------------------------------------------------------------- bucket


@dataclasses.dataclass(frozen=True)
class _Object:
    size: int
    crc32c: int


class BucketView:
    """The job's objects in the bucket (``bucket``: a google-cloud-storage bucket, reached directly)."""

    def __init__(self, bucket: Any, prefix: str = "tierckpt") -> None:
        self.bucket = bucket
        self.layout = BucketLayout(prefix)
        self._whole: set[tuple[str, int, int]] = set()
        """(job, step, generation of its completion object) already checked whole: complete steps are
        never rewritten."""

    def objects(self, job: str) -> dict[str, _Object]:
        out = {}
        for blob in self.bucket.client.list_blobs(self.bucket, prefix=self.layout.job(job)):
            crc = int.from_bytes(base64.b64decode(blob.crc32c), "big") if blob.crc32c else -1
            out[blob.name] = _Object(int(blob.size or 0), crc)
        return out

    def complete(self, job: str) -> dict[int, int]:
        """Step -> world size of every complete step (its completion object decodes)."""
        out = {}
        for blob in self.bucket.client.list_blobs(self.bucket, prefix=self.layout.complete_dir(job)):
            step = self.layout.step_of_complete(job, blob.name)
            if step is None:
                continue
            try:
                record = StepBackup.from_bytes(blob.download_as_bytes())
            except Exception:  # deleted meanwhile, or not a record: not a complete step
                continue
            out[step] = record.world_size
        return out

    def torn(self, job: str) -> list[str]:
        """Complete steps of ``job`` with a missing or damaged object (still so when checked again)."""
        found = []
        for step in sorted(self.complete(job)):
            problem = self._check(job, step)
            if problem and self._check(job, step):
                found.append(f"step {step}: {problem}")
        return found

    def _check(self, job: str, step: int) -> str:
        """Why ``step`` is not whole ("" if it is, or if it is no longer complete)."""
        blob = self.bucket.get_blob(self.layout.complete_key(job, step))
        if blob is None:
            return ""
        key = (job, step, int(blob.generation or 0))
        if key in self._whole:
            return ""
        objects = self.objects(job)
        try:
            record = StepBackup.from_bytes(blob.download_as_bytes())
        except Exception as exc:
            return f"completion object unreadable: {exc}"
        refs = self._refs(job, step, record, objects)
        if isinstance(refs, str):
            return refs if self.bucket.get_blob(self.layout.complete_key(job, step)) is not None else ""
        for rank in sorted(refs):
            problem = self._rank(job, step, rank, refs, objects)
            if problem:
                if self.bucket.get_blob(self.layout.complete_key(job, step)) is None:
                    return ""  # retired meanwhile
                return f"rank {rank}: {problem}"
        self._whole.add(key)
        return ""

    def _refs(
        self, job: str, step: int, record: StepBackup, objects: dict[str, _Object]
    ) -> dict[int, RankRef] | str:
        """Every rank's reference: inline (layout 1) or from the index chunks (layout 2 and later)."""
        if not record.index:
            return dict(record.ranks)
        out: dict[int, RankRef] = {}
        for number, chunk in enumerate(record.index):
            key = self.layout.index_key(job, step, record.index_writer, number)
            body = self._fetch(key, chunk.size, chunk.crc32c, objects)
            if isinstance(body, str):
                return f"index chunk {number}: {body}"
            index = RankIndex.from_bytes(body)
            for rank in range(chunk.first, chunk.first + chunk.count):
                out[rank] = index.ref(rank)
        return out

    def _commit(
        self, job: str, step: int, rank: int, ref: RankRef, objects: dict[str, _Object]
    ) -> RankBackup | str:
        body = self._fetch(self.layout.rank_commit_key(job, step, rank), ref.size, ref.crc32c, objects)
        return body if isinstance(body, str) else RankBackup.from_bytes(body)

    def _rank(
        self, job: str, step: int, rank: int, refs: dict[int, RankRef], objects: dict[str, _Object]
    ) -> str:
        commit = self._commit(job, step, rank, refs[rank], objects)
        if isinstance(commit, str):
            return f"rank commit: {commit}"
        marker = self._fetch(
            self.layout.rank_file_key(job, step, rank, "COMMIT", commit.save),
            commit.commit_size,
            commit.commit_crc32c,
            objects,
        )
        if isinstance(marker, str):
            return f"COMMIT: {marker}"
        manifest_key = self.layout.rank_file_key(job, step, rank, "manifest.json", commit.save)
        raw = self._fetch(manifest_key, commit.manifest_size, commit.manifest_crc32c, objects)
        if isinstance(raw, str):
            return f"manifest: {raw}"
        manifest = Manifest.from_bytes(raw)
        data_from = refs[rank].data_from
        data_rank = data_from if data_from is not None else rank
        data_names = {f.name for f in iter_data_files(manifest)}
        owner_commit: RankBackup | str = commit
        if data_rank != rank:
            if data_rank not in refs:
                return f"its data rank {data_rank} is not in the step"
            owner_commit = self._commit(job, step, data_rank, refs[data_rank], objects)
        if isinstance(owner_commit, str):
            return f"rank commit of its data rank {data_rank}: {owner_commit}"
        chunked: dict[str, str] = {}
        if owner_commit.chunks is not None and data_names:
            chunked = self._chunked(
                job, step, owner_commit.chunks, owner_commit, manifest, data_names, objects
            )
        for entry in manifest.files:
            if entry.name in chunked:
                if chunked[entry.name]:
                    return chunked[entry.name]
                continue
            owner = owner_commit if entry.name in data_names else commit
            obj = objects.get(self.layout.rank_file_key(job, step, owner.rank, entry.name, owner.save))
            if obj is None:
                return f"{entry.name} (of rank {owner.rank}) missing"
            if (obj.size, obj.crc32c) != (entry.size, entry.crc32c):
                return (
                    f"{entry.name}: {obj.size} bytes crc32c {obj.crc32c:08x}, manifest says "
                    f"{entry.size} {entry.crc32c:08x}"
                )
        return ""

    def _chunked(
        self,
        job: str,
        step: int,
        ref: ChunkListRef,
        owner_commit: RankBackup,
        manifest: Manifest,
        data_names: set[str],
        objects: dict[str, _Object],
    ) -> dict[str, str]:
        """Layout 3: data file -> why its chunks are not whole ("" if they are): the chunk list of the
        save ``owner_commit`` names (checked against ``ref``, its pointer) names chunks that add up to
        the manifest's size and crc32c, each in the bucket with its stored size (stored raw: its crc32c)."""
        owner = owner_commit.rank
        key = self.layout.chunk_list_key(job, step, owner, owner_commit.save)
        body = self._fetch(key, ref.size, ref.crc32c, objects)
        if isinstance(body, str):
            return dict.fromkeys(data_names, f"chunk list of rank {owner}: {body}")
        listed = {f.name: f for f in ChunkList.from_bytes(body).files}
        out = {}
        for entry in manifest.files:
            if entry.name not in data_names:
                continue
            chunks = listed.get(entry.name)
            if chunks is None:
                out[entry.name] = f"{entry.name}: not in the chunk list of rank {owner}"
                continue
            out[entry.name] = ""
            for c in chunks.chunks:
                obj = objects.get(self.layout.chunk_key(job, c.name, c.codec))
                if obj is None:
                    out[entry.name] = f"{entry.name}: chunk {c.name}.{c.codec} missing"
                    break
                if obj.size != c.stored or (c.codec == "raw" and obj.crc32c != c.crc32c):
                    out[entry.name] = f"{entry.name}: chunk {c.name}.{c.codec} is not what its list says"
                    break
            whole = (
                sum(c.size for c in chunks.chunks),
                crc32c_concat([(c.crc32c, c.size) for c in chunks.chunks]),
            )
            if not out[entry.name] and whole != (entry.size, entry.crc32c):
                out[entry.name] = f"{entry.name}: its chunks do not add up to the manifest's size and crc32c"
        return out

    def _fetch(self, key: str, size: int, crc: int, objects: dict[str, _Object]) -> bytes | str:
        if key not in objects:
            return "missing"
        blob = self.bucket.get_blob(key)
        if blob is None:
            return "missing"
        body: bytes = blob.download_as_bytes()
        if len(body) != size or crc32c(body) != crc:
            return f"{len(body)} bytes crc32c {crc32c(body):08x}, the chain says {size} {crc:08x}"
        return body
