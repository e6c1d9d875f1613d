"""The bucket's step catalog: which steps are complete or in progress, completing a step, deleting one.

The completion protocol (docs/bucket-layout.md, layout 2):

1. A node uploads a rank's files, its manifest and COMMIT, then creates ``steps/<s>/ranks/<r>.json``
   (create-only), with the rank's ``RankSummary`` in the object's metadata.
2. It then says how many ranks it committed (``share_done``: the count is in the key) and lists the
   step's shares (``shares_cover``). The node whose listing counts the whole world lists
   ``steps/<s>/ranks/`` once: if every rank ``0 .. world_size-1`` is there, the listing (sizes,
   crc32c, summaries) gives every rank's ``RankRef``. It writes them as index chunks of 1,024 ranks,
   then creates ``complete/<s>.json`` (create-only), which records each chunk's size and crc32c. A 412
   means another node completed it first: success.
3. Readers trust only steps whose completion object exists and decodes; each rank's objects are then
   verified by crc32c along the chain completion -> index chunk -> rank commit -> manifest -> files.

``catalog.json`` is rewritten after each change (a step started, completed, refused, retired): ``view``
looks at it first and answers from the view it made at the same generation, so a periodic pass over a
bucket where nothing changed costs one request.

Deleting a step removes its completion object first (the step stops existing at once), then the rank
commits (so it cannot be completed again from stale commits), then everything else. Purging a whole
job is ``fence.Fences.purge`` (other nodes may still be writing it).
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Literal

from tierckpt.protocol.bucket_layout import (
    INDEX_CHUNK_RANKS,
    SMALL_OBJECT_LIMIT,
    SUMMARY_METADATA_KEY,
    BucketLayout,
    CatalogChange,
    IndexChunk,
    RankBackup,
    RankIndex,
    RankRef,
    RankSummary,
    ShareDone,
    StepBackup,
    StepRefused,
    StepStarted,
    complete_read_limit,
    encode_small,
)
from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError
from tierckpt.protocol.integrity import crc32c
from tierckpt_replicator.backup.store import (
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    StoreError,
    TransientStoreError,
)

__all__ = ["SMALL_OBJECT_LIMIT", "BucketView", "Catalog", "Completion"]

log = logging.getLogger(__name__)

Completion = Literal["written", "exists", "incomplete", "refused"]
"""What an attempt to complete a step did: wrote the completion object, found one (another node
completed it), found ranks missing, or found rank commits it must not complete (they disagree)."""

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_PINNED = 16
"""Completion objects kept for restores without asking the bucket again (per service)."""
_CHUNKS = 64
"""Index chunks kept (a node restores a few ranks: one or two chunks per step)."""


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
    completed_by: dict[int, str] = dataclasses.field(default_factory=dict)
    """Complete step -> the node that completed it (the newest one's runs retention)."""
    fresh: bool = True
    """Read from the bucket just now (False: the catalog had not changed since the view was made)."""

    @property
    def newest_complete(self) -> tuple[int, float] | None:
        if not self.complete:
            return None
        step = max(self.complete)
        return step, self.complete[step]


@dataclasses.dataclass
class _Seen:
    """A view and the completion objects behind it, made at one generation of ``catalog.json``."""

    generation: int | None
    at: float
    view: BucketView
    steps: dict[int, StepBackup]
    delivered: bool = False
    """Whether ``view`` handed it to the backup pass already (later calls get it with ``fresh`` False)."""


class Catalog:
    """Reads and writes a job's catalog objects through an ``ObjectStore`` (blocking).

    ``view_max_age``: how long a view is reused while ``catalog.json`` keeps its generation (a safety
    net for a change whose announcement was lost); ``clock``: monotonic seconds."""

    def __init__(
        self,
        store: ObjectStore,
        layout: BucketLayout,
        node: str,
        pool: cf.Executor,
        *,
        view_max_age: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.layout, self.node, self.pool = store, layout, node, pool
        self.view_max_age, self.clock = view_max_age, clock
        self._complete_cache: dict[tuple[str, int], StepBackup] = {}
        self._seen: dict[str, _Seen] = {}
        self._pinned: collections.OrderedDict[tuple[str, int], StepBackup] = collections.OrderedDict()
        self._chunks: collections.OrderedDict[tuple[str, int, str, int, int], RankIndex] = (
            collections.OrderedDict()
        )
        self._unreadable: set[tuple[str, int]] = set()
        self._writer = _SAFE.sub("-", node)[:100]

    # ------------------------------------------------------------------------------------ reading

    def view(self, job: str, *, fresh: bool = False) -> BucketView:
        """The job's catalog, for the backup pass: ``fresh`` True the first time a view read from the
        bucket is handed out (``_current``; ``fresh=True`` reads it now). Reads by others
        (``complete_steps``, e.g. a status request) never take a change away from the pass."""
        seen = self._current(job, reread=fresh)
        first, seen.delivered = not seen.delivered, True
        return seen.view if first else dataclasses.replace(seen.view, fresh=False)

    def _current(self, job: str, *, reread: bool = False) -> _Seen:
        """The view made at the current generation of ``catalog.json``: read from the bucket if it
        changed since the last one (or that is older than ``view_max_age``, or ``reread``)."""
        marker = self.store.stat(self.layout.catalog_key(job))
        generation = marker.generation if marker is not None else None
        seen = None if reread else self._seen.get(job)
        if seen is None or seen.generation != generation or self.clock() - seen.at >= self.view_max_age:
            view, steps = self._read_view(job)
            seen = self._seen[job] = _Seen(generation, self.clock(), view, steps)
        return seen

    def complete_steps(self, job: str) -> dict[int, StepBackup]:
        """Every complete step of ``job``, each completion object read and validated (one request while
        nothing changed). An unreadable completion object is skipped (logged); a failing bucket raises."""
        return dict(self._current(job).steps)

    def _read_view(self, job: str) -> tuple[BucketView, dict[int, StepBackup]]:
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
        view = BucketView(
            complete=complete,
            in_progress=in_progress,
            incomplete_old=tuple(sorted(old)),
            refused=tuple(sorted(refused)),
            completed_by={s: b.completed_by for s, b in readable.items()},
        )
        return view, readable

    def _scan_complete(self, job: str) -> tuple[dict[int, StepBackup], set[int]]:
        """Readable completions, and the steps whose completion object exists but cannot be read
        (corrupt, too large, or written by a newer version): those are never taken for abandoned
        uploads, and never stop the scan (a failing bucket does)."""
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
            except TransientStoreError:
                raise
            except (FormatError, StoreError) as exc:
                if (info.name, info.generation) not in self._unreadable:
                    self._unreadable.add((info.name, info.generation))
                    log.warning("ignoring completion object %s: %s", info.name, exc)
                unreadable.add(step)
        return out, unreadable

    def read_complete(self, job: str, step: int, *, fresh: bool = False) -> StepBackup:
        """The step's completion object. Kept once read (a restore reads it once per node): ``fresh``
        asks the bucket again (after a link of the chain failed to match it)."""
        pinned = self._pinned.get((job, step))
        if pinned is not None and not fresh:
            return pinned
        info = self.store.stat(self.layout.complete_key(job, step))
        if info is None:
            self._pinned.pop((job, step), None)
            raise MissingCheckpointError(f"step {step} of job {job} is not complete in the bucket")
        done = self._read_complete(job, step, info)
        self._pinned[(job, step)] = done
        self._pinned.move_to_end((job, step))
        while len(self._pinned) > _PINNED:
            self._pinned.popitem(last=False)
        return done

    def _read_complete(self, job: str, step: int, info: ObjectInfo) -> StepBackup:
        cached = self._complete_cache.get((info.name, info.generation))
        if cached is not None:
            return cached
        body = self.store.get_bytes(info.name, max_size=complete_read_limit(info.size))
        if info.crc32c is not None and crc32c(body) != info.crc32c:
            raise CorruptShardError(f"{info.name}: crc32c mismatch", path=info.name)
        done = StepBackup.from_bytes(body)
        if done.job != job or done.step != step:
            raise FormatError(f"{info.name} describes job {done.job!r} step {done.step}")
        if done.index and len(body) > SMALL_OBJECT_LIMIT:
            raise FormatError(f"{info.name}: {len(body)} bytes, over the {SMALL_OBJECT_LIMIT} allowed")
        self._complete_cache[(info.name, info.generation)] = done
        return done

    def rank_ref(self, job: str, step: int, rank: int, *, fresh: bool = False) -> RankRef:
        """``rank``'s reference in the complete ``step``: from the completion object (layout 1) or its
        index chunk (layout 2, checked against the completion object's size and crc32c)."""
        done = self.read_complete(job, step, fresh=fresh)
        if not 0 <= rank < done.world_size:
            raise MissingCheckpointError(
                f"step {step} of {job} has no rank {rank} (world size {done.world_size})"
            )
        if not done.index:
            return done.ranks[rank]
        number, chunk = done.chunk_of(rank)
        return self._read_index(job, step, done.index_writer, number, chunk).ref(rank)

    def _read_index(self, job: str, step: int, writer: str, number: int, chunk: IndexChunk) -> RankIndex:
        cache_key = (job, step, writer, number, chunk.crc32c)
        cached = self._chunks.get(cache_key)
        if cached is not None:
            return cached
        key = self.layout.index_key(job, step, writer, number)
        body = self.store.get_bytes(key, max_size=SMALL_OBJECT_LIMIT)
        if len(body) != chunk.size or crc32c(body) != chunk.crc32c:
            raise CorruptShardError(f"{key}: does not match the step's completion object", path=key)
        index = RankIndex.from_bytes(body)
        if (index.job, index.step, index.first, len(index.sizes)) != (job, step, chunk.first, chunk.count):
            raise FormatError(f"{key} describes job {index.job!r} step {index.step} from rank {index.first}")
        self._chunks[cache_key] = index
        while len(self._chunks) > _CHUNKS:
            self._chunks.popitem(last=False)
        return index

    def rank_commits(self, job: str, step: int) -> dict[int, ObjectInfo]:
        objects, _ = self.store.list(self.layout.rank_commits_dir(job, step))
        out = {}
        for info in objects:
            rank = self.layout.rank_of_commit(job, step, info.name)
            if rank is not None:
                out[rank] = info
        return out

    def committed(self, job: str, step: int, ranks: Iterable[int]) -> dict[int, int]:
        """Rank -> the crc32c of the manifest its rank commit of ``step`` names, for those of ``ranks``
        that have one (one request each, in parallel: for a node's own few ranks, where listing every
        rank of the step would cost the world size; a commit without a readable summary is read)."""

        def manifest_of(rank: int) -> int | None:
            info = self.store.stat(self.layout.rank_commit_key(job, step, rank))
            if info is None:
                return None
            summary = _summary(info)
            if summary is not None:
                return summary.manifest_crc32c
            try:
                return self.read_rank_commit(job, step, rank).manifest_crc32c
            except ObjectNotFound:  # deleted meanwhile
                return None

        ranks = sorted(set(ranks))
        found = self.pool.map(manifest_of, ranks)
        return {r: crc for r, crc in zip(ranks, found, strict=True) if crc is not None}

    def read_rank_commit(self, job: str, step: int, rank: int, *, ref: RankRef | None = None) -> RankBackup:
        key = self.layout.rank_commit_key(job, step, rank)
        body = self.store.get_bytes(key, max_size=SMALL_OBJECT_LIMIT)
        if ref is not None and (len(body) != ref.size or crc32c(body) != ref.crc32c):
            raise CorruptShardError(f"{key}: does not match the step's completion object", path=key)
        commit = RankBackup.from_bytes(body)
        if (commit.job, commit.step, commit.rank) != (job, step, rank):
            raise FormatError(f"{key} describes job {commit.job!r} step {commit.step} rank {commit.rank}")
        return commit

    def cached_view(self, job: str) -> BucketView | None:
        """The last view made of ``job`` (no request)."""
        seen = self._seen.get(job)
        return seen.view if seen is not None else None

    # ------------------------------------------------------------------------------------ writing

    def mark_started(self, job: str, step: int, world_size: int, reason: str) -> None:
        """Create ``started.json`` unless it exists (the first starter's time is what counts), and
        announce it (other nodes join the step at their next look)."""
        msg = StepStarted(
            job=job,
            step=step,
            world_size=world_size,
            started_by=self.node,
            started_at=time.time(),
            reason=reason[:1000],
        )
        try:
            self.store.put_bytes(
                self.layout.started_key(job, step), encode_small(msg, "started.json"), create_only=True
            )
        except PreconditionFailed:
            return
        self.announce(job, step, "started")

    def mark_refused(self, job: str, step: int, rank: int, reason: str) -> None:
        """Create ``refused.json`` unless it exists: ``rank`` of ``step`` will not be uploaded (its
        manifest declares more than the job's quota), so the step never completes and nobody waits."""
        msg = StepRefused(
            job=job, step=step, rank=rank, refused_by=self.node, refused_at=time.time(), reason=reason[:1000]
        )
        try:
            self.store.put_bytes(
                self.layout.refused_key(job, step), encode_small(msg, "refused.json"), create_only=True
            )
        except PreconditionFailed:
            return
        self.announce(job, step, "refused")

    def share_done(self, job: str, step: int, ranks: Iterable[int]) -> None:
        """Say that this node committed ``ranks`` of ``step`` (a ``ShareDone`` whose key counts them)."""
        ranks = tuple(sorted(set(ranks)))
        if not ranks:
            return
        msg = ShareDone(job=job, step=step, node=self.node, ranks=ranks, at=time.time())
        key = self.layout.share_key(job, step, f"{self._writer}.{secrets.token_hex(4)}", len(ranks))
        self.store.put_bytes(key, encode_small(msg, f"the share of {self.node} in step {step}"))

    def shares_cover(self, job: str, step: int, world_size: int) -> bool:
        """Whether the shares nodes said they committed of ``step`` count ``world_size`` ranks (one
        listing of ``N`` small objects: a node that just committed its share asks it to know whether it
        was the last; takeovers may count a rank twice, so the listing of the rank commits decides)."""
        objects, _ = self.store.list(self.layout.shares_dir(job, step))
        return sum(self.layout.ranks_of_share(job, step, o.name) or 0 for o in objects) >= world_size

    def announce(self, job: str, step: int, change: str) -> None:
        """Rewrite ``catalog.json`` after a change of the catalog. A failure is logged, not raised: the
        change is made, and other nodes see it at their next full look (``view_max_age``)."""
        msg = CatalogChange(job=job, step=step, change=change, by=self.node, at=time.time())
        try:
            self.store.put_bytes(self.layout.catalog_key(job), encode_small(msg, "catalog.json"))
        except TransientStoreError as exc:
            log.warning("job %s: could not announce that step %d %s: %s", job, step, change, exc)

    def try_complete(self, job: str, step: int, world_size: int) -> bool:
        """Create the completion object if every rank is committed. True if the step is complete now
        (whoever wrote the object); False if ranks are missing or the commits disagree."""
        return self.complete(job, step, world_size) in ("written", "exists")

    def complete(self, job: str, step: int, world_size: int) -> Completion:
        """List the rank commits once; if every rank is there and they agree, write the index chunks and
        create the completion object (see the module docstring). Does not announce it (the caller does,
        once its retention is done too)."""
        infos = self.rank_commits(job, step)
        missing = [r for r in range(world_size) if r not in infos]
        if missing:
            log.debug(
                "step %d of %s: %d of %d ranks committed", step, job, world_size - len(missing), world_size
            )
            return "incomplete"
        earlier = self._earlier_save(job, step, world_size, infos)
        infos = {r: i for r, i in infos.items() if r not in earlier}
        refs = self._refs(job, step, world_size, infos)
        if refs is None:
            return "refused"
        writer = f"{self._writer}.{secrets.token_hex(4)}"
        chunks = self._write_index(job, step, writer, [refs[r] for r in range(world_size)])
        done = StepBackup(
            job=job,
            step=step,
            world_size=world_size,
            completed_by=self.node,
            completed_at=time.time(),
            index_writer=writer,
            index=chunks,
            data_bytes=sum(r.total_bytes for r in refs.values()),
        )
        body = encode_small(done, f"the completion object of step {step}")
        try:
            self.store.put_bytes(self.layout.complete_key(job, step), body, create_only=True)
        except PreconditionFailed:
            log.info("step %d of %s was completed by another node", step, job)
            self._delete_all(self.store.list(self.layout.index_dir(job, step, writer))[0])
            return "exists"
        again = {r: i for r, i in self.rank_commits(job, step).items() if r not in earlier}
        # a commit replaced or deleted meanwhile: withdraw
        changed = [
            r for r, ref in refs.items() if (r not in again) or _ref_of(again[r]) != (ref.size, ref.crc32c)
        ]
        if changed or len(again) != world_size:
            log.warning(
                "step %d of %s: rank commits %s changed while completing it; withdrawing it",
                step,
                job,
                changed[:8],
            )
            self.store.delete(self.layout.complete_key(job, step))
            return "incomplete"
        log.info(
            "step %d of %s is complete in gs://%s (%d ranks, %d bytes, %d index chunks)",
            step,
            job,
            getattr(self.store, "bucket", "?"),
            world_size,
            done.total_bytes,
            len(chunks),
        )
        return "written"

    def withdraw_unless_indexed(self, job: str, step: int, rank: int, size: int, crc: int) -> bool:
        """After ``rank``'s commit of an incomplete ``step`` was replaced by a newer save's (``size`` and
        ``crc`` bytes): if a node completed the step meanwhile from the commit replaced (its listings of
        the rank commits, before and after it wrote the completion object, both came before the
        replacement), the completion names a commit that is gone: withdraw it (the step completes
        again from the commits there). Between them, the completer's second listing and this look
        leave no order of the two in which a torn step stays complete. True if it was withdrawn."""
        if self.store.stat(self.layout.complete_key(job, step)) is None:
            return False
        try:
            ref = self.rank_ref(job, step, rank, fresh=True)
            if (ref.size, ref.crc32c) == (size, crc):
                return False
        except (FormatError, CorruptShardError, ObjectNotFound, MissingCheckpointError) as exc:
            log.info("step %d of %s: its completion cannot be read (%s)", step, job, exc)
        log.warning(
            "step %d of %s was completed from the rank %d commit this node replaced; withdrawing it",
            step,
            job,
            rank,
        )
        self.store.delete(self.layout.complete_key(job, step))
        self._drop(job, step)
        self.announce(job, step, "retired")
        return True

    def _earlier_save(
        self, job: str, step: int, world_size: int, infos: Mapping[int, ObjectInfo]
    ) -> set[int]:
        """The rank commits beyond ``world_size`` left by an earlier save of the step with more ranks,
        when ranks ``0 .. world_size-1`` were all saved later with ``world_size`` ranks (a job that went
        back to an older step and shrank saves the step again: the ranks it no longer has are never
        replaced, and the step could never complete). Empty when there are none, or when that is not
        so (then ``_refs`` refuses the step, as before)."""
        extra = sorted(r for r in infos if r >= world_size)
        if not extra:
            return set()
        try:
            commits = dict(
                zip(
                    sorted(infos),
                    self.pool.map(lambda r: self.read_rank_commit(job, step, r), sorted(infos)),
                    strict=True,
                )
            )
        except (ObjectNotFound, FormatError) as exc:  # replaced or deleted meanwhile: the next pass
            log.info("step %d of %s: cannot read its rank commits: %s", step, job, exc)
            return set()
        ours = [commits[r] for r in range(world_size)]
        if any(c.world_size != world_size for c in ours):
            return set()
        if max(commits[r].saved_at for r in extra) >= min(c.saved_at for c in ours):
            return set()
        log.warning(
            "step %d of %s: ranks %s are in the bucket from an earlier save with %d ranks; the step was "
            "saved again with %d, completing it without them",
            step,
            job,
            extra[:8],
            commits[extra[0]].world_size,
            world_size,
        )
        return set(extra)

    def _refs(
        self, job: str, step: int, world_size: int, infos: Mapping[int, ObjectInfo]
    ) -> dict[int, RankRef] | None:
        """Every rank's reference, from the listed commits' summaries (a commit without a readable one,
        e.g. uploaded by an older version, is read); None if they must not be completed (logged)."""
        refs: dict[int, RankRef] = {}
        worlds: dict[int, int] = {}
        unread = []
        for r, info in infos.items():
            summary = _summary(info)
            if summary is None:
                unread.append(r)
                continue
            refs[r], worlds[r] = summary.ref(info.size, info.crc32c or 0), summary.world_size
        for commit in self.pool.map(lambda r: self.read_rank_commit(job, step, r), unread):
            info = infos[commit.rank]
            refs[commit.rank] = RankRef(
                size=info.size,
                crc32c=info.crc32c or 0,
                manifest_crc32c=commit.manifest_crc32c,
                total_bytes=commit.total_bytes,
                data_from=commit.data.rank if commit.data is not None else None,
            )
            worlds[commit.rank] = commit.world_size
        bad = sorted(r for r, w in worlds.items() if w != world_size)
        if bad or len(infos) != world_size:
            log.error(
                "step %d of %s: rank commits disagree on the world size (ranks %s, %d commits); "
                "not completing it",
                step,
                job,
                bad[:8],
                len(infos),
            )
            return None
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
                dangling[:8],
            )
            return None
        return refs

    def _write_index(self, job: str, step: int, writer: str, refs: list[RankRef]) -> tuple[IndexChunk, ...]:
        """Write the index chunks of ``refs`` (rank order) in parallel; their pointers, in order."""

        def put(number: int) -> IndexChunk:
            first = number * INDEX_CHUNK_RANKS
            part = refs[first : first + INDEX_CHUNK_RANKS]
            body = encode_small(RankIndex.of(job, step, first, part), f"index chunk {number} of step {step}")
            self.store.put_bytes(self.layout.index_key(job, step, writer, number), body)
            return IndexChunk(first=first, count=len(part), size=len(body), crc32c=crc32c(body))

        count = -(-len(refs) // INDEX_CHUNK_RANKS)
        return tuple(self.pool.map(put, range(count)))

    # ------------------------------------------------------------------------------------ deleting

    def retire(self, job: str, step: int) -> bool:
        """Delete a complete step's completion object: the step stops existing for readers. Its other
        objects are deleted by the nodes that hold its ranks (``delete_ranks``) and whatever is left by
        ``delete_step``. The caller announces the change."""
        deleted = self.store.delete(self.layout.complete_key(job, step))
        self._drop(job, step)
        log.info("retired step %d of %s (its completion object is deleted)", step, job)
        return deleted

    def delete_ranks(self, job: str, step: int, ranks: Iterable[int], *, chunk_lists: bool = True) -> int:
        """Delete the objects of ``ranks`` of a step that is no longer complete: each rank commit, then
        its chunk lists (with ``chunk_lists``: this node uploads layout 3; the chunks they name go at the
        next sweep, if no other step names them) and the rank's files, of every save. Returns objects
        deleted."""

        def one(rank: int) -> int:
            n = int(self.store.delete(self.layout.rank_commit_key(job, step, rank)))
            if chunk_lists:
                lists, _ = self.store.list(self.layout.chunk_lists_of(job, step, rank))
                mine = [o.name for o in lists if (p := self.layout.parse(o.name)) and p.rank == rank]
                n += sum(int(self.store.delete(key)) for key in mine)
            objects, _ = self.store.list(self.layout.rank_dir(job, step, rank))
            return n + sum(int(self.store.delete(o.name)) for o in objects)

        return sum(self.pool.map(one, sorted(set(ranks))))

    def delete_step(self, job: str, step: int, *, grace: float = 0.0) -> int:
        """Delete a step: completion object first, then rank commits, then the rest. Returns objects
        deleted. If the completion object cannot be deleted, nothing else is touched. With ``grace``,
        nothing is deleted while an object of the step changed less than ``grace`` seconds ago (an
        upload may still be writing it)."""
        if grace > 0:
            rest, _ = self.store.list(self.layout.step_dir(job, step))
            now = time.time()
            if any(now - o.updated < grace for o in rest):
                return 0
        deleted = int(self.store.delete(self.layout.complete_key(job, step)))
        commits, _ = self.store.list(self.layout.rank_commits_dir(job, step))
        deleted += self._delete_all(commits)
        rest, _ = self.store.list(self.layout.step_dir(job, step))
        deleted += self._delete_all(rest)
        self._drop(job, step)
        log.info("deleted step %d of %s from the bucket (%d objects)", step, job, deleted)
        return deleted

    def _delete_all(self, objects: Iterable[ObjectInfo]) -> int:
        return sum(self.pool.map(lambda o: int(self.store.delete(o.name)), objects))

    def _drop(self, job: str, step: int) -> None:
        self._complete_cache = {
            k: v for k, v in self._complete_cache.items() if v.step != step or v.job != job
        }
        self._pinned.pop((job, step), None)

    def forget(self, job: str) -> None:
        """Drop everything cached of ``job`` (it was purged)."""
        self._complete_cache = {k: v for k, v in self._complete_cache.items() if v.job != job}
        self._seen.pop(job, None)
        for key in [k for k in self._pinned if k[0] == job]:
            del self._pinned[key]
        for ckey in [k for k in self._chunks if k[0] == job]:
            del self._chunks[ckey]


def _summary(info: ObjectInfo) -> RankSummary | None:
    text = info.metadata.get(SUMMARY_METADATA_KEY)
    if not text:
        return None
    with contextlib.suppress(FormatError):
        return RankSummary.from_bytes(text)
    return None


def _ref_of(info: ObjectInfo) -> tuple[int, int]:
    return info.size, info.crc32c or 0
