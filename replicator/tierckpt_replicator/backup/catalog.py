"""The bucket's step catalog: which steps are complete or in progress, completing a step, deleting one.

The completion protocol (docs/bucket-layout.md):

1. A node uploads a rank's files, its manifest and COMMIT, then creates ``steps/<s>/ranks/<r>.json``
   (create-only).
2. Any node that lists ``steps/<s>/ranks/`` and finds every rank ``0 .. world_size-1`` reads those
   commits, checks they agree, and creates ``complete/<s>.json`` (create-only). A 412 means another
   node completed it first: success.
3. Readers trust only steps whose completion object exists and lists every rank; each rank's objects
   are then verified by crc32c along the chain completion -> rank commit -> manifest -> files.

Deleting a step removes its completion object first (the step stops existing at once), then the rank
commits (so it cannot be completed again from stale commits), then everything else. Purging a whole
job is ``fence.Fences.purge`` (other nodes may still be writing it).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable

from tierckpt.protocol.bucket_layout import (
    BucketLayout,
    RankBackup,
    RankRef,
    StepBackup,
    StepRefused,
    StepStarted,
)
from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError
from tierckpt.protocol.integrity import crc32c
from tierckpt_replicator.backup.store import ObjectInfo, ObjectNotFound, ObjectStore, PreconditionFailed

__all__ = ["BucketView", "Catalog"]

log = logging.getLogger(__name__)

SMALL_OBJECT_LIMIT = 1 << 20
"""Largest completion, started or rank-commit object accepted."""


@dataclasses.dataclass(frozen=True)
class BucketView:
    """What the bucket holds for one job at one moment."""

    complete: dict[int, float]
    """Complete step -> completed_at."""
    in_progress: dict[int, float]
    """Started but incomplete step (newer than the newest complete one) -> started_at."""
    incomplete_old: tuple[int, ...]
    """Incomplete steps older than the newest complete one (garbage once their uploads stopped)."""
    refused: tuple[int, ...] = ()
    """Incomplete steps newer than the newest complete one that a node refused a rank of (its quota):
    they never complete, so they are neither joined nor in progress."""

    @property
    def newest_complete(self) -> tuple[int, float] | None:
        if not self.complete:
            return None
        step = max(self.complete)
        return step, self.complete[step]


class Catalog:
    """Reads and writes a job's catalog objects through an ``ObjectStore`` (blocking)."""

    def __init__(self, store: ObjectStore, layout: BucketLayout, node: str, pool: cf.Executor) -> None:
        self.store, self.layout, self.node, self.pool = store, layout, node, pool
        self._complete_cache: dict[tuple[str, int], StepBackup] = {}

    # ------------------------------------------------------------------------------------ reading

    def complete_steps(self, job: str) -> dict[int, StepBackup]:
        """Every complete step of ``job``, each completion object read and validated. A completion
        object that cannot be decoded is skipped (logged); a failing bucket raises."""
        return self._scan_complete(job)[0]

    def _scan_complete(self, job: str) -> tuple[dict[int, StepBackup], set[int]]:
        """Readable completions, and the steps whose completion object exists but cannot be read
        (corrupt, or written by a newer version): those are never taken for abandoned uploads."""
        objects, _ = self.store.list(self.layout.complete_dir(job))
        out: dict[int, StepBackup] = {}
        unreadable: set[int] = set()
        for info in objects:
            step = self.layout.step_of_complete(job, info.name)
            if step is None:
                continue
            try:
                out[step] = self._read_complete(job, step, info)
            except ObjectNotFound:
                continue  # deleted since the listing
            except FormatError as exc:
                log.warning("ignoring completion object %s: %s", info.name, exc)
                unreadable.add(step)
        return out, unreadable

    def read_complete(self, job: str, step: int) -> StepBackup:
        info = self.store.stat(self.layout.complete_key(job, step))
        if info is None:
            raise MissingCheckpointError(f"step {step} of job {job} is not complete in the bucket")
        return self._read_complete(job, step, info)

    def _read_complete(self, job: str, step: int, info: ObjectInfo) -> StepBackup:
        cached = self._complete_cache.get((info.name, info.generation))
        if cached is not None:
            return cached
        body = self.store.get_bytes(info.name, max_size=SMALL_OBJECT_LIMIT)
        if info.crc32c is not None and crc32c(body) != info.crc32c:
            raise CorruptShardError(f"{info.name}: crc32c mismatch", path=info.name)
        done = StepBackup.from_bytes(body)
        if done.job != job or done.step != step:
            raise FormatError(f"{info.name} describes job {done.job!r} step {done.step}")
        self._complete_cache[(info.name, info.generation)] = done
        return done

    def view(self, job: str) -> BucketView:
        readable, unreadable = self._scan_complete(job)
        complete = {s: b.completed_at for s, b in readable.items()}
        _, dirs = self.store.list(self.layout.steps_dir(job), delimiter="/")
        newest = max(complete, default=-1)
        in_progress: dict[int, float] = {}
        old, refused = [], []
        for d in dirs:
            step = self.layout.step_of_dir(job, d)
            if step is None or step in complete or step in unreadable:
                continue
            if step < newest:
                old.append(step)
                continue
            if self.store.stat(self.layout.refused_key(job, step)) is not None:
                refused.append(step)
                continue
            started = self.store.stat(self.layout.started_key(job, step))
            in_progress[step] = started.updated if started else 0.0
        return BucketView(
            complete=complete,
            in_progress=in_progress,
            incomplete_old=tuple(sorted(old)),
            refused=tuple(sorted(refused)),
        )

    def rank_commits(self, job: str, step: int) -> dict[int, ObjectInfo]:
        objects, _ = self.store.list(self.layout.rank_commits_dir(job, step))
        out = {}
        for info in objects:
            rank = self.layout.rank_of_commit(job, step, info.name)
            if rank is not None:
                out[rank] = info
        return out

    def read_rank_commit(self, job: str, step: int, rank: int, *, ref: RankRef | None = None) -> RankBackup:
        key = self.layout.rank_commit_key(job, step, rank)
        body = self.store.get_bytes(key, max_size=SMALL_OBJECT_LIMIT)
        if ref is not None and (len(body) != ref.size or crc32c(body) != ref.crc32c):
            raise CorruptShardError(f"{key}: does not match the step's completion object", path=key)
        commit = RankBackup.from_bytes(body)
        if (commit.job, commit.step, commit.rank) != (job, step, rank):
            raise FormatError(f"{key} describes job {commit.job!r} step {commit.step} rank {commit.rank}")
        return commit

    # ------------------------------------------------------------------------------------ writing

    def mark_started(self, job: str, step: int, world_size: int, reason: str) -> None:
        """Create ``started.json`` unless it exists (the first starter's time is what counts)."""
        msg = StepStarted(
            job=job,
            step=step,
            world_size=world_size,
            started_by=self.node,
            started_at=time.time(),
            reason=reason,
        )
        with contextlib.suppress(PreconditionFailed):
            self.store.put_bytes(self.layout.started_key(job, step), msg.to_bytes(), create_only=True)

    def mark_refused(self, job: str, step: int, rank: int, reason: str) -> None:
        """Create ``refused.json`` unless it exists: ``rank`` of ``step`` will not be uploaded (its
        manifest declares more than the job's quota), so the step never completes and nobody waits."""
        msg = StepRefused(
            job=job, step=step, rank=rank, refused_by=self.node, refused_at=time.time(), reason=reason[:1000]
        )
        with contextlib.suppress(PreconditionFailed):
            self.store.put_bytes(self.layout.refused_key(job, step), msg.to_bytes(), create_only=True)

    def try_complete(self, job: str, step: int, world_size: int) -> bool:
        """Create the completion object if every rank is committed. True if the step is complete now
        (whoever wrote the object); False if ranks are missing or the commits disagree."""
        infos = self.rank_commits(job, step)
        missing = [r for r in range(world_size) if r not in infos]
        if missing:
            log.debug(
                "step %d of %s: %d of %d ranks committed", step, job, world_size - len(missing), world_size
            )
            return False
        commits = list(self.pool.map(lambda r: self.read_rank_commit(job, step, r), range(world_size)))
        bad = [c.rank for c in commits if c.world_size != world_size]
        if bad or len(infos) != world_size:
            log.error(
                "step %d of %s: rank commits disagree on the world size (ranks %s, %d commits); "
                "not completing it",
                step,
                job,
                bad[:8],
                len(infos),
            )
            return False
        refs = {
            c.rank: RankRef(
                size=infos[c.rank].size,
                crc32c=infos[c.rank].crc32c or 0,
                manifest_crc32c=c.manifest_crc32c,
                total_bytes=c.total_bytes,
                data_from=c.data.rank if c.data is not None else None,
            )
            for c in commits
        }
        dangling = [
            r
            for r, ref in refs.items()
            if ref.data_from is not None
            and (ref.data_from not in refs or refs[ref.data_from].data_from is not None)
        ]
        if dangling:
            log.error(
                "step %d of %s: ranks %s refer to data files that are not uploaded; not completing it",
                step,
                job,
                dangling,
            )
            return False
        done = StepBackup(
            job=job,
            step=step,
            world_size=world_size,
            ranks=refs,
            completed_by=self.node,
            completed_at=time.time(),
        )
        try:
            self.store.put_bytes(self.layout.complete_key(job, step), done.to_bytes(), create_only=True)
        except PreconditionFailed:
            log.info("step %d of %s was completed by another node", step, job)
            return True
        if len(self.rank_commits(job, step)) != world_size:  # deleted meanwhile (retention raced us)
            log.warning("step %d of %s lost rank commits while completing; withdrawing it", step, job)
            self.store.delete(self.layout.complete_key(job, step))
            return False
        log.info(
            "step %d of %s is complete in gs://%s (%d ranks, %d bytes)",
            step,
            job,
            getattr(self.store, "bucket", "?"),
            world_size,
            done.total_bytes,
        )
        return True

    # ------------------------------------------------------------------------------------ deleting

    def delete_step(self, job: str, step: int) -> int:
        """Delete a step: completion object first, then rank commits, then the rest. Returns objects
        deleted. If the completion object cannot be deleted, nothing else is touched."""
        deleted = int(self.store.delete(self.layout.complete_key(job, step)))
        commits, _ = self.store.list(self.layout.rank_commits_dir(job, step))
        deleted += sum(self.pool.map(lambda o: self.store.delete(o.name), commits))
        rest, _ = self.store.list(self.layout.step_dir(job, step))
        deleted += sum(self.pool.map(lambda o: self.store.delete(o.name), rest))
        self._complete_cache = {
            k: v for k, v in self._complete_cache.items() if v.step != step or v.job != job
        }
        log.info("deleted step %d of %s from the bucket (%d objects)", step, job, deleted)
        return deleted

    def collect_garbage(self, job: str, view: BucketView, delete: Iterable[int], grace: float) -> list[int]:
        """Delete the complete steps in ``delete`` and incomplete steps older than the newest complete
        one whose objects were last written more than ``grace`` seconds ago. Returns the steps removed."""
        removed = []
        for step in sorted(delete):
            self.delete_step(job, step)
            removed.append(step)
        now = time.time()
        for step in view.incomplete_old:
            objects, _ = self.store.list(self.layout.step_dir(job, step))
            if all(now - o.updated >= grace for o in objects):
                self.delete_step(job, step)
                removed.append(step)
        return removed

    def forget(self, job: str) -> None:
        """Drop the cached completion objects of ``job`` (it was purged)."""
        self._complete_cache = {k: v for k, v in self._complete_cache.items() if v.job != job}
