"""``BackupService``: tier 3. Backs committed steps up to a bucket and restores ranks from it.

The replicator daemon calls it; every blocking bucket call runs in thread pools, so the daemon's event
loop never blocks. One pass per call, serialised per job:

1. Read the bucket's view of the job (complete steps, started-but-incomplete steps).
2. Targets: the new step if ``BackupPolicy.due`` says so, plus any backup another node started that is
   not complete yet (so nodes join the same step even when their own schedules disagree), unless it
   can no longer complete (``BackupPolicy.gives_up``: then it holds no new backup back either).
3. For each target step, upload this node's share, holding a writer lease on the step in the bucket
   (``fence.Fences.writing``: a purge on another node waits for it): of the ranks this node holds
   (primary or replica), the ones ``assign_uploads`` gives it, spread over all holders; after
   ``takeover_after`` seconds also any rank still missing in the bucket (its assigned node may be
   gone).
4. Try to complete the step (creates ``complete/<step>.json`` once every rank is committed), and when
   a step became complete run retention (and remove abandoned incomplete steps).

A failure never deletes anything complete and never makes a partial step visible (see catalog.py).
A rank refused for its job's quota (``quota.OverQuotaError``: its manifest declares more bytes than
the job's ramdisk size, as sparse files can) uploads nothing and marks its step refused in the bucket
(``refused.json``): that step never completes, so no node joins it or holds newer backups back for it.

A purge fences the job first (``fence``): no pass of it starts, the running one stops at its next
bucket write and is waited for; ``delete_backups`` then empties the bucket (``fence.Fences.purge``).

Call ``poll(job)`` periodically (every few tens of seconds) so a node that committed no new step still
joins backups others started (preemption), takes over ranks of dead nodes, and completes steps whose
last uploader died before writing the completion object.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import contextlib
import dataclasses
import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tierckpt.planning.common_step import newest_common_step
from tierckpt.protocol import leases
from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt.protocol.errors import FormatError, TierckptError
from tierckpt.protocol.format import Dir, committed_steps, read_commit, read_manifest
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.backup.catalog import BucketView, Catalog
from tierckpt_replicator.backup.chunkstore import ChunkUploads, Sweeper
from tierckpt_replicator.backup.fence import Fences, JobFenced
from tierckpt_replicator.backup.metrics import BackupMetrics
from tierckpt_replicator.backup.restorer import Restorer
from tierckpt_replicator.backup.spread import assign_uploads, data_rank, holders_of, rendezvous_score
from tierckpt_replicator.backup.store import ObjectStore, StoreError
from tierckpt_replicator.backup.uploader import Uploader
from tierckpt_replicator.inventory import InventoryScanner, PlanOf, no_plan
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.quota import JobQuotas, OverQuotaError
from tierckpt_replicator.stepio import find_committed, open_job, rank_trees

__all__ = ["BackupPools", "BackupService", "BackupStatus"]

if TYPE_CHECKING:  # the settings module imports google-cloud-storage (for GcsStore); this one need not
    from tierckpt_replicator.backup.settings import BackupSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
MiB = 1 << 20
CLOSE_GRACE = 5.0
"""Seconds ``close`` lets the uploads under way finish before it abandons them."""
FENCE_GRACE = 10.0
"""Seconds ``fence`` (a purge) waits for the job's backup pass under way to stop before it goes on without
it (a bucket that does not answer keeps a pass in its client's retries for minutes)."""
_PROGRESS_EVERY = 8 * MiB
ProgressCallback = Callable[[int], None]
"""``progress(bytes_done)``: cumulative bytes of the rank written so far."""


@dataclasses.dataclass(frozen=True)
class BackupPools:
    """Where a service's blocking work runs: ``io``, every bucket transfer and small request (its size
    bounds the requests in flight); ``ranks``, the uploads of single ranks, which wait on ``io``;
    ``ops``, the passes and calls that wait on both. No task waits on a task of its own pool, so several
    services may share one set (whose owner shuts it down)."""

    io: cf.ThreadPoolExecutor
    ops: cf.ThreadPoolExecutor
    ranks: cf.ThreadPoolExecutor

    @classmethod
    def make(cls, parallelism: int, passes: int = 4) -> BackupPools:
        """``passes`` passes at once (of different jobs), each with up to 8 ranks in flight."""
        return cls(
            io=cf.ThreadPoolExecutor(parallelism, thread_name_prefix="backup-io"),
            ops=cf.ThreadPoolExecutor(passes, thread_name_prefix="backup-op"),
            ranks=cf.ThreadPoolExecutor(8 * passes, thread_name_prefix="backup-rank"),
        )

    def shutdown(self) -> None:
        for pool in (self.ops, self.ranks, self.io):
            pool.shutdown(wait=True, cancel_futures=True)


@dataclasses.dataclass(frozen=True)
class BackupStatus:
    """This node's view of a job's backups, for the daemon's status endpoint."""

    newest_complete: int | None = None
    complete: tuple[int, ...] = ()
    last_uploaded: int | None = None
    """Newest step whose share this node finished uploading."""
    last_success_at: float | None = None
    last_error: str = ""
    uploaded_bytes: int = 0
    """Bytes this node uploaded for ``last_uploaded``."""
    uploaded_logical: int = 0
    """What those uploads would have been without replica group dedup."""


class BackupService:
    """Backups of the jobs under ``root`` (this node's ramdisk) to the bucket behind ``store``.

    ``settings``: schedule, retention and every transfer tunable (``BackupSettings``; its bucket fields
    only matter to ``for_bucket``, which makes ``store`` from them). ``node``: this node's
    name as it appears in ``holders``. ``store``: the bucket (a ``GcsStore`` in production; tests pass
    one against fake-gcs-server, or a fake at the ``ObjectStore`` boundary). ``metrics``: where to count
    (default: the process-wide ``BackupMetrics``). ``clock``: the wall clock (schedules, takeover).
    ``quotas``: each job's quota, which no rank's upload may exceed (default: the jobs' policies and
    this node's ramdisk size). ``pools``: the thread pools to run in (default: its own; the scale rig
    runs many services, one per simulated node, on one shared pair). ``assignments``: the jobs' peer
    assignments (the daemon's store: the one reader of ``peers.json``; default: a store of its own
    over ``root``), which spread the uploads over each rank's holders. ``plan_of``: the restore plan
    this node staged for a job (the daemon's stager's): the steps the run the job went back from saved
    (``RestorePlan.left_behind``) are neither backed up nor leased; training saves them again.
    """

    def __init__(
        self,
        settings: BackupSettings,
        *,
        node: str,
        root: Path,
        store: ObjectStore,
        metrics: BackupMetrics | None = None,
        clock: Callable[[], float] = time.time,
        quotas: JobQuotas | None = None,
        pools: BackupPools | None = None,
        assignments: AssignmentStore | None = None,
        plan_of: PlanOf = no_plan,
    ) -> None:
        self.settings, self.store, self.node, self.root = settings, store, node, Path(root)
        self.assignments = assignments or AssignmentStore(self.root)
        self.quotas = quotas or JobQuotas(self.root, PolicyStore(self.root))
        self.inventory = InventoryScanner(
            self.root, node=node, endpoint="", max_manifest_bytes=settings.max_manifest_bytes, plan_of=plan_of
        )
        """This node's steps as the replicator counts them (``Holdings``): with the restore plans it
        staged (``plan_of``), none that the run a job went back from saved is backed up."""
        self.policy = settings.policy()
        self.layout = BucketLayout(settings.prefix)
        self.metrics = metrics or BackupMetrics.default()
        self.clock = clock
        self._own_pools = pools is None
        pools = pools or BackupPools.make(settings.parallelism)
        self._pools = pools
        self._io, self._ops = pools.io, pools.ops
        self.fences = Fences(
            store,
            self.layout,
            node,
            self._io,
            ttl=settings.writer_ttl,
            wait_limit=settings.retry_deadline + 2 * settings.writer_ttl,
        )
        writes = self.fences.store  # every write of a job's objects: its writer lease held, not fenced here
        self.catalog = Catalog(writes, self.layout, node, self._io, view_max_age=settings.catalog_max_age)
        self.sweeper, self.uploader, self.restorer = self._transfer_parts(settings, store, writes)
        self._locks: dict[str, asyncio.Lock] = {}
        self._holders: dict[str, dict[int, tuple[str, ...]]] = {}
        self._latest: dict[str, int] = {}
        self._fetching: dict[str, collections.Counter[int]] = {}
        self._status: dict[str, BackupStatus] = {}
        self._given_up: dict[str, set[int]] = {}
        """Job -> started steps this node found unable to complete (logged once each)."""
        self._commits: dict[str, dict[int, dict[int, int]]] = {}
        """Job -> step -> rank -> the crc32c of the manifest its rank commit in the bucket names, for the
        ranks this node knows are committed there (it committed them, or saw their commit): never asked
        about again. A rank counts as committed only if that is the manifest of this node's copy: a
        commit of an earlier save of the step number (the run a job went back from) is not this one's."""
        self._seen_complete: dict[str, set[int]] = {}
        """Job -> steps this node saw complete (one no longer complete was retired: its ranks here go)."""
        self._cleaned: dict[str, set[int]] = {}
        """Job -> retired steps whose ranks this node deleted."""
        self._old_since: dict[str, dict[int, float]] = {}
        """Job -> incomplete step older than the newest complete one -> when this node first saw it so
        (monotonic; the node that completed the newest step deletes what is left of it ``incomplete_grace``
        later)."""
        self._swept: dict[str, tuple[object, ...]] = {}
        """Job -> the steps the bucket held at this node's last chunk sweep of it."""
        self._overdue_since: dict[str, float] = {}
        """Job -> when this node first saw the bucket hold complete steps its retention drops (``clock``)."""
        self._standing_in: dict[str, int] = {}
        """Job -> the newest complete step whose janitor this node is in place of its completer
        (``_retention_overdue``)."""
        self._holder = "backup." + re.sub(r"[^A-Za-z0-9_.-]", "-", node)[:100]

    def _transfer_parts(
        self, settings: BackupSettings, store: ObjectStore, writes: ObjectStore
    ) -> tuple[Sweeper, Uploader, Restorer]:
        """The parts that move a job's bytes: chunk uploads (layout 3) and their sweeper, the uploader
        (its writes through the fences) and the restorer (its reads straight from ``store``)."""
        chunks = (
            ChunkUploads(
                writes,
                self.layout,
                self.catalog,
                self._io,
                compression=settings.compression,
                max_list_bytes=settings.max_manifest_bytes,
                on_bytes=self.metrics.bytes_uploaded.inc,
                check_stop=self._check_stop,
                sweep_wait=2 * settings.writer_ttl,
            )
            if settings.chunks
            else None
        )
        sweeper = Sweeper(
            writes,
            self.layout,
            self.node,
            self._io,
            ttl=settings.writer_ttl,
            max_list_bytes=settings.max_manifest_bytes,
        )
        uploader = Uploader(
            writes,
            self.layout,
            self.catalog,
            self.node,
            self._io,
            slice_size=settings.slice_size,
            max_manifest_bytes=settings.max_manifest_bytes,
            on_bytes=self.metrics.bytes_uploaded.inc,
            should_stop=self.fences.fenced,
            group_wait=settings.group_wait,
            quotas=self.quotas,
            chunks=chunks,
        )
        restorer = Restorer(
            store,
            self.layout,
            self.catalog,
            self._io,
            range_size=settings.range_size,
            max_manifest_bytes=settings.max_manifest_bytes,
        )
        return sweeper, uploader, restorer

    @classmethod
    def for_bucket(
        cls,
        settings: BackupSettings,
        *,
        node: str,
        root: Path,
        metrics: BackupMetrics | None = None,
        quotas: JobQuotas | None = None,
        assignments: AssignmentStore | None = None,
        plan_of: PlanOf = no_plan,
    ) -> BackupService:
        """The production path: the service on ``settings.bucket`` through a ``GcsStore`` (raises
        ``ValueError`` if no bucket is configured)."""
        store = settings.store()
        return cls(
            settings,
            node=node,
            root=root,
            store=store,
            metrics=metrics,
            quotas=quotas,
            assignments=assignments,
            plan_of=plan_of,
        )

    # ------------------------------------------------------------------------------------ API

    async def on_step_committed(
        self, job: str, step: int, ranks_here: Sequence[int], holders: Mapping[int, Sequence[str]]
    ) -> None:
        """A step was committed locally (and replicated): upload this node's share if it is due.

        ``ranks_here``: ranks of ``step`` this node holds (primary or replica); ``holders``: rank -> every
        node holding a copy of it (primary first). Never raises for bucket or data errors: they are
        logged, counted (``tierckpt_backup_failures_total{op="upload"}``) and kept in ``status(job)``.
        A call that waited behind a newer step's call returns without doing anything.
        """
        self._remember_holders(job, holders)
        self._latest[job] = max(self._latest.get(job, -1), step)
        begun = self._purge_mark(job)
        async with self._lock(job):
            if self._fenced_since(job, begun):
                log.debug("step %d of %s not backed up: the job is being purged (or was)", step, job)
                return
            if step < self._latest[job]:
                log.debug("step %d of %s superseded by step %d before its turn", step, job, self._latest[job])
                return
            with contextlib.suppress(Exception):  # _pass logged and counted it
                await self._run(self._pass, job, step, tuple(ranks_here), False, False)

    async def backup_now(
        self, job: str, *, holders: Mapping[int, Sequence[str]] | None = None, all_local: bool = False
    ) -> int | None:
        """Back up the newest step committed locally (on demand: API call, SIGTERM). Returns that step
        once this node's share of it is in the bucket (or it was already complete there), None if the
        node holds no committed step of ``job``. Raises if the upload fails. ``all_local``: upload every
        rank this node holds, not only its share (for a node about to disappear). ``holders``: where
        the caller knows the step's copies are (rank -> nodes, primary first; the daemon reports its
        primaries and the peers that confirmed their replicas): a rank whose assigned uploader is not
        among them is uploaded by its primary now, not after ``takeover_after`` (a replica may have
        gone to another node than ``peers.json`` names). Raises ``JobFenced`` while the job is being
        purged, and when a purge of it began while this call waited for its turn (found by the chaos
        soak: such a call ran once the purge was over)."""
        if holders:
            self._remember_holders(job, holders)
        placed = {int(r): tuple(h) for r, h in (holders or {}).items()}
        begun = self._purge_mark(job)
        async with self._lock(job):
            if self._fenced_since(job, begun):
                raise JobFenced(
                    f"job {job} is being purged (or was, while this backup waited): not backed up"
                )
            return await self._run(self._backup_now, job, all_local, placed)

    async def poll(self, job: str) -> None:
        """Periodic housekeeping: back up the newest local step if the schedule makes it due (a step
        committed while another backup ran, or the last step of a stopped job, becomes due by time or
        steps with no new commit), join started backups, take over orphaned ranks, complete, retain."""
        begun = self._purge_mark(job)
        async with self._lock(job):
            if self._fenced_since(job, begun):
                return
            with contextlib.suppress(Exception):  # _pass logged and counted it
                await self._run(self._poll, job)

    async def complete_steps(self, job: str) -> tuple[int, ...]:
        """Steps of ``job`` complete in the bucket, oldest first."""
        return tuple(sorted(await self.complete_world_sizes(job)))

    async def complete_world_sizes(self, job: str) -> dict[int, int]:
        """Step -> world size of each step of ``job`` complete in the bucket (from its completion
        object): a cluster that lost every in-memory copy still knows which ranks each node restores."""
        done = await self._run(self.catalog.complete_steps, job)
        steps = tuple(sorted(done))
        self._set_status(job, complete=steps, newest_complete=steps[-1] if steps else None)
        return {step: done[step].world_size for step in steps}

    async def fetch_rank(
        self,
        job: str,
        step: int,
        rank: int,
        dest_rank_dir: Dir,
        progress: ProgressCallback | None = None,
        seed: Beneath | None = None,
    ) -> None:
        """Download ``rank`` of the complete ``step``, verify every byte's crc32c, and commit it as
        ``dest_rank_dir/step-<step>`` (the view of the rank's directory in its job tree, or a path) in
        the client format (manifest and COMMIT byte for byte the
        originals). ``progress(bytes_done)`` is called on the event loop as bytes arrive
        (throttled) and once at the end. Raises ``MissingCheckpointError`` if the step is not complete in
        the bucket, ``CorruptShardError`` on any checksum mismatch (nothing is committed),
        ``RamdiskFullError`` if the step does not fit, ``StoreError`` if the bucket keeps failing."""
        relay = _Progress(asyncio.get_running_loop(), progress, self.metrics.bytes_downloaded.inc)
        fetching = self._fetching.setdefault(job, collections.Counter())
        fetching[step] += 1
        started = time.monotonic()
        try:
            await self._run(self.restorer.fetch_rank, job, step, rank, dest_rank_dir, relay.add, seed)
        except BaseException:
            self.metrics.failures.labels(op="restore").inc()
            raise
        finally:
            fetching[step] -= 1
        relay.finish()
        self.metrics.restore_seconds.observe(time.monotonic() - started)

    async def data_source(self, job: str, step: int, rank: int) -> int | None:
        """The rank whose data objects hold ``rank``'s data files in the complete ``step`` (None: its
        own); a restore can then fetch that rank's step from the peer restoring it instead."""
        return await self._run(self.restorer.data_source, job, step, rank)

    async def fence(self, job: str, *, grace: float = FENCE_GRACE) -> None:
        """Stop backing ``job`` up on this node until ``unfence``: no pass of it starts, and the one
        running stops at its next bucket write (a partial step stays invisible) and is waited for, at
        most ``grace`` seconds. A pass still running then (a bucket call retrying against a bucket that
        does not answer) is left behind: it writes nothing more (the job is fenced here, and a purge
        elsewhere took its writer lease away), and a write of it that lands late is deleted again by
        its writer lease (``Fences.write``), so a purge need not wait for it. Call it before deleting
        anything of the job."""
        self.fences.fence_here(job)
        if not await self._wait_for_pass(job, grace):
            log.warning(
                "job %s: its backup pass did not stop within %.0fs of the fence (a bucket call still "
                "retrying); going on without it: it writes nothing more",
                job,
                grace,
            )

    async def _wait_for_pass(self, job: str, timeout: float) -> bool:
        """Whether the pass of ``job`` under way (if any) ended within ``timeout`` seconds."""
        lock = self._lock(job)
        try:
            await asyncio.wait_for(lock.acquire(), timeout)
        except TimeoutError:
            return False
        lock.release()
        return True

    def unfence(self, job: str) -> None:
        """Lift the fence (the job was purged): forget its state here; it starts afresh if it returns."""
        self.fences.lift(job)
        for state in (
            self._holders,
            self._latest,
            self._status,
            self._given_up,
            self._commits,
            self._seen_complete,
            self._cleaned,
            self._old_since,
            self._swept,
            self._overdue_since,
            self._standing_in,
        ):
            state.pop(job, None)  # its lock stays: a call waiting on it must not run beside a new one
        self.inventory.forget(job)
        log.info("job %s: backup state forgotten on this node", job)

    async def delete_backups(self, job: str) -> None:
        """Delete every object of ``job`` from the bucket, also while other nodes are still writing some
        (``Fences.purge``; this can take up to ``writer_ttl`` and more while they stop). Fences the job
        here first; it stays fenced until ``unfence``. Irreversible."""
        await self.fence(job)
        async with self._lock(job):
            await self._run(self.fences.purge, job)
        self.catalog.forget(job)
        self._status.pop(job, None)

    def status(self, job: str) -> BackupStatus:
        return self._status.get(job, BackupStatus())

    async def close(self, grace: float = CLOSE_GRACE) -> None:
        """Stop the pools: queued work is cancelled, work under way gets ``grace`` seconds. An upload
        still running then (a bucket that does not answer, its client retrying) is abandoned, as a
        SIGKILL would: a step completes in the bucket atomically, so what it did not finish is not there.
        The pools are shut down on a thread of their own, never the loop's default executor (which the
        loop waits for when it closes)."""
        if not self._own_pools:
            return
        loop = asyncio.get_running_loop()
        stopped = loop.create_future()

        def settle() -> None:
            if not stopped.done():
                stopped.set_result(None)

        def shut_down() -> None:
            self._pools.shutdown()
            with contextlib.suppress(RuntimeError):  # the loop closed without waiting for it
                loop.call_soon_threadsafe(settle)

        threading.Thread(target=shut_down, name="backup-shutdown", daemon=True).start()
        try:
            await asyncio.wait_for(stopped, grace)
        except TimeoutError:
            log.warning(
                "backup: uploads still under way %.0f s after the shutdown began are abandoned (the bucket "
                "keeps only steps that completed)",
                grace,
            )

    # ------------------------------------------------------------------------------------ passes (blocking)

    def _pass(
        self,
        job: str,
        step: int | None,
        ranks_here: tuple[int, ...],
        on_demand: bool,
        all_local: bool,
        placed: Mapping[int, tuple[str, ...]] | None = None,
    ) -> None:
        try:
            view = self.catalog.view(job)
            now = self.clock()
            running = self._running(job, view, now)
            targets: dict[int, str] = {}
            if step is not None and step in view.refused:
                log.info(
                    "step %d of %s not backed up: a rank of it was refused for the job's quota", step, job
                )
            elif step is not None:
                decision = self.policy.due(
                    step,
                    newest_complete=view.newest_complete,
                    in_progress=running.items(),
                    now=now,
                    on_demand=on_demand,
                )
                if decision:
                    targets[step] = decision.reason
                else:
                    log.debug("step %d of %s not backed up: %s", step, job, decision.reason)
            for s in running:
                targets.setdefault(s, "joining a backup in progress")
            for s in sorted(targets):
                hint, known = (ranks_here, placed) if s == step else ((), None)
                self._backup_step(job, s, targets[s], view.in_progress.get(s), hint, all_local, known)
            self._forget_commits(job, set(targets) | set(view.in_progress))
            self._maintain(job, view)
        except JobFenced as exc:
            if exc.elsewhere and not self.fences.fenced(job):
                log.warning(
                    "job %s: its backups are being purged from the bucket by another node; this node stops "
                    "backing it up (until the job is purged here or the replicator restarts)",
                    job,
                )
                self.fences.fence_here(job)
            else:
                log.info("backup of %s stopped: %s", job, exc)
            raise
        except Exception as exc:
            self.metrics.failures.labels(op="upload").inc()
            self._set_status(job, last_error=f"{type(exc).__name__}: {exc}")
            if isinstance(exc, (TierckptError, OSError)):
                log.error("backup of %s failed: %s", job, exc)
            else:
                log.exception("backup of %s failed unexpectedly", job)
            raise

    def _poll(self, job: str) -> None:
        self._pass(job, self._newest_local(job), (), False, False)

    def _backup_now(self, job: str, all_local: bool, placed: Mapping[int, tuple[str, ...]]) -> int | None:
        step = self._newest_local(job)
        if step is None:
            log.info("backup of %s requested, but this node holds no committed step of it", job)
            return None
        self._pass(job, step, (), True, all_local, placed)
        return step

    def _running(self, job: str, view: BucketView, now: float) -> dict[int, float]:
        """The started backups (step -> started_at) that hold new ones back and that this node joins:
        newer than the newest complete step, younger than ``stale_after``, and not given up
        (``BackupPolicy.gives_up``: past the takeover window, nobody uploading, no missing rank here)."""
        floor = view.newest_complete[0] if view.newest_complete else -1
        young = {s: t for s, t in view.in_progress.items() if s > floor and now - t < self.policy.stale_after}
        past = [s for s, t in young.items() if now - t >= self.policy.takeover_after]
        if not past:
            return young
        uploading = self.fences.uploading(job)
        given_up = self._given_up.setdefault(job, set())
        given_up &= set(young)
        for s in past:
            missing_here = self._missing_here(job, s)
            if not self.policy.gives_up(
                started_at=young[s], now=now, holds_missing=bool(missing_here), being_uploaded=s in uploading
            ):
                continue
            del young[s]
            if s not in given_up:
                given_up.add(s)
                log.warning(
                    "job %s: giving up on step %d: incomplete %.0fs after its backup began, no node is "
                    "uploading it and this node holds none of its missing ranks; moving on to newer steps",
                    job,
                    s,
                    now - view.in_progress[s],
                )
        return young

    def _missing_here(self, job: str, step: int) -> set[int]:
        """Ranks of ``step`` this node holds a committed copy of that are not committed in the bucket."""
        try:
            tree = open_job(self.root, job)
        except FileNotFoundError:
            return set()
        with tree:
            local = _manifests(self._local_copies(job, tree, step, ()))
        return set(local) - self._committed(job, step, local)

    def _committed(self, job: str, step: int, manifests: Mapping[int, int]) -> set[int]:
        """Which ranks of ``manifests`` (rank -> the crc32c of this node's manifest of it) are committed
        in the bucket with that manifest: known ones from memory, the others asked one by one (a node's
        own few ranks, never a listing of the whole step). A commit of another save of the step number
        (the run the job went back from saved it) is not this copy's: its upload replaces it."""
        known = self._commits.setdefault(job, {}).setdefault(step, {})
        unknown = {r for r, crc in manifests.items() if known.get(r) != crc}
        if unknown:
            known.update(self.catalog.committed(job, step, unknown))
        return {r for r, crc in manifests.items() if known.get(r) == crc}

    def _forget_commits(self, job: str, steps: set[int]) -> None:
        """Keep what is known of commits only for the steps still being backed up."""
        commits = self._commits.get(job, {})
        for s in [s for s in commits if s not in steps]:
            del commits[s]

    def _backup_step(
        self,
        job: str,
        step: int,
        reason: str,
        started_at: float | None,
        hint: Iterable[int],
        all_local: bool,
        placed: Mapping[int, tuple[str, ...]] | None = None,
    ) -> bool:
        """Upload this node's share of ``step``; True if the step is complete in the bucket afterwards."""
        try:
            tree = open_job(self.root, job)
        except FileNotFoundError:
            return False
        with tree:
            return self._backup_step_in(tree, job, step, reason, started_at, hint, all_local, placed)

    def _backup_step_in(
        self,
        tree: Beneath,
        job: str,
        step: int,
        reason: str,
        started_at: float | None,
        hint: Iterable[int],
        all_local: bool,
        placed: Mapping[int, tuple[str, ...]] | None,
    ) -> bool:
        local = self._local_copies(job, tree, step, hint)
        if not local:
            return False
        world_size = read_manifest(
            next(iter(local.values()))[1], limit=self.settings.max_manifest_bytes
        ).world_size
        manifests = _manifests(local)
        mine = self._my_share(job, step, world_size, manifests, started_at, all_local, placed)
        known = self._commits.get(job, {}).get(step, {})
        todo = sorted(r for r in mine if known.get(r) != manifests.get(r))
        if todo or started_at is None:
            with self.fences.writing(job, step):
                self._write_share(job, step, world_size, reason, started_at, todo, local)
                if todo:
                    self.catalog.share_done(
                        job,
                        step,
                        self._committed(job, step, {r: manifests[r] for r in mine if r in manifests}),
                    )
            if todo and self.catalog.shares_cover(job, step, world_size):
                return self._complete(job, step, world_size)  # this node's share was the last
            return False
        if self._fallback_completer(job, step, world_size, started_at, local):
            return self._complete(job, step, world_size)
        return False  # nothing to write here

    def _write_share(
        self,
        job: str,
        step: int,
        world_size: int,
        reason: str,
        started_at: float | None,
        mine: list[int],
        local: Mapping[int, tuple[Beneath, Beneath]],
    ) -> None:
        """The writes of this node's share of ``step`` (under its writer lease): mark it started,
        upload ``mine``."""
        if mine or started_at is None:  # also with no share here: a started backup is visible, so
            # its missing ranks are taken over even if no rank's assigned uploader holds a copy
            self.catalog.mark_started(job, step, world_size, reason)
        if mine:
            log.info("backing up step %d of %s (%s): ranks %s of %d", step, job, reason, mine, world_size)
            started = time.monotonic()
            with _leases({r: local[r] for r in mine}, step, self._holder, self.settings.lease_ttl) as held:
                sent, logical = self._upload_ranks(job, step, held)
            self.metrics.upload_seconds.observe(time.monotonic() - started)
            prev = self._status.get(job, BackupStatus())
            before = (prev.uploaded_bytes, prev.uploaded_logical) if prev.last_uploaded == step else (0, 0)
            self._set_status(  # every pass of this node over the step counts (its share, takeovers)
                job,
                last_uploaded=step,
                last_success_at=self.clock(),
                last_error="",
                uploaded_bytes=before[0] + sent,
                uploaded_logical=before[1] + logical,
            )
            self.metrics.last_success.labels(job=job).set(self.clock())

    def _complete(self, job: str, step: int, world_size: int) -> bool:
        """Complete ``step`` (one listing of its rank commits), retire what retention drops, and announce
        both, under a writer lease. True if the step is complete in the bucket afterwards."""
        with self.fences.writing(job, step):
            outcome = self.catalog.complete(job, step, world_size)
            if outcome != "written":
                return outcome == "exists"
            self.metrics.steps_completed.inc()
            self._retire(job, {step: time.time()}, step)
        return True

    def _fallback_completer(
        self,
        job: str,
        step: int,
        world_size: int,
        started_at: float | None,
        local: Mapping[int, object],
    ) -> bool:
        """Whether this node, with nothing of ``step`` to write, should still try to complete it: the
        node that wrote the last share may have died before it could. Once the takeover window is over,
        the holders of one rank chosen per step (rendezvous-hashed) try, at each pass (a few nodes, not
        every node listing every rank)."""
        if started_at is None or self.clock() - started_at < self.settings.takeover_after:
            return False
        return completion_rank(job, step, world_size) in local

    def _retire(self, job: str, new: Mapping[int, float], newest: int) -> None:
        """Retention, run by the node that completed the newest step (under its writer lease): delete the
        completion objects of the steps it drops, then announce the change (with the new step's)."""
        seen = self.catalog.cached_view(job)
        complete = {**(seen.complete if seen is not None else {}), **new}
        plan = self.policy.retention(complete, protect=self._protected(job))
        for s in plan.delete:
            self.catalog.retire(job, s)
        self.metrics.steps_deleted.inc(len(plan.delete))
        if new or plan.delete:
            self.catalog.announce(job, newest, "completed" if new else "retired")
        kept = tuple(s for s in sorted(complete) if s not in plan.delete)
        self._set_status(job, complete=kept, newest_complete=kept[-1] if kept else None)

    def _my_share(
        self,
        job: str,
        step: int,
        world_size: int,
        local: Mapping[int, int],
        started_at: float | None,
        all_local: bool,
        placed: Mapping[int, tuple[str, ...]] | None = None,
    ) -> list[int]:
        """The ranks this node uploads: its share of the spread over all holders, the ranks it is the
        primary of whose assigned uploader holds no copy (``placed``), plus orphans."""
        if all_local:
            return sorted(local)
        holders = self._holders_of(job, world_size)
        for r in local:  # only where no holder is known: every node must compute the same split
            holders.setdefault(r, (self.node,))
        owner = _assign_mine(job, step, self.node, holders)
        mine = {r for r in local if owner.get(r) == self.node}
        unheld = {
            r
            for r, h in (placed or {}).items()
            if r in local and h[:1] == (self.node,) and owner.get(r) not in h
        }
        if unheld - mine:
            log.info(
                "step %d of %s: uploading ranks %s here, their assigned uploaders hold no copy",
                step,
                job,
                sorted(unheld - mine),
            )
            mine |= unheld
        if started_at is not None and self.clock() - started_at >= self.settings.takeover_after:
            others = {r: crc for r, crc in local.items() if r not in mine}
            orphans = set(others) - self._committed(job, step, others)
            if orphans:
                log.warning(
                    "step %d of %s: taking over ranks %s, still missing %.0fs after its backup began",
                    step,
                    job,
                    sorted(orphans),
                    self.clock() - started_at,
                )
                mine |= orphans
        return sorted(mine)

    def _upload_ranks(self, job: str, step: int, paths: Mapping[int, Beneath]) -> tuple[int, int]:
        """Upload several ranks at once (their files share the transfer pool); raise the first failure
        after all have finished, so every rank that can be committed is. Ranks that carry their replica
        group's data files go first: members waiting for them never hold every thread. Returns (bytes
        sent, bytes a no-dedup upload would have sent)."""
        errors: list[Exception] = []
        sent = logical = 0
        if not paths:
            return 0, 0
        order = sorted(paths, key=lambda r: (not self._carries_data(job, paths[r]), r))
        futures = {self._pools.ranks.submit(self.uploader.upload_rank, job, paths[r]): r for r in order}
        for fut in cf.as_completed(futures):
            try:
                done = fut.result()
                self._commits.setdefault(job, {}).setdefault(step, {})[futures[fut]] = (
                    done.commit.manifest_crc32c
                )
                sent += done.bytes_sent
                logical += done.logical_bytes
                self.metrics.chunk_bytes_reused.inc(done.reused_bytes)
                if not done.skipped:
                    self.metrics.ranks_uploaded.inc()
            except JobFenced as exc:
                errors.insert(0, exc)  # raised first: the pass then knows the job is being purged
            except (TierckptError, OSError) as exc:
                log.error("upload of rank %d of %s failed: %s", futures[fut], job, exc)
                errors.append(exc)
        for error in errors:
            if isinstance(error, OverQuotaError):  # the step can never complete: no node joins or waits
                self.catalog.mark_refused(job, error.over.step, error.over.rank, str(error))
        if errors:
            raise errors[0]
        return sent, logical

    def _carries_data(self, job: str, step: Beneath) -> bool:
        """Whether this step's upload carries data files its replica group members may refer to."""
        try:
            m = read_manifest(step, limit=self.settings.max_manifest_bytes)
        except (FormatError, OSError):
            return True
        r = m.replica
        return r is None or r.diverged or data_rank(job, m.step, r.members) == m.rank

    def _maintain(self, job: str, view: BucketView) -> None:
        """Housekeeping after a pass, from its view (no request unless the catalog changed): delete this
        node's ranks of steps retired since its last view; on the node that completed the newest step,
        retention and the removal of what is left of old incomplete steps."""
        seen = self._seen_complete.setdefault(job, set())
        if view.fresh:
            cleaned = self._cleaned.setdefault(job, set())
            for s in [s for s in view.incomplete_old if s in seen and s not in cleaned]:
                self._delete_own_ranks(job, s)
                cleaned.add(s)
            cleaned &= set(view.incomplete_old)
            seen |= set(view.complete)
            seen &= set(view.complete) | set(view.incomplete_old)
        newest = view.newest_complete
        janitor = newest is not None and (
            view.completed_by.get(newest[0]) == self.node or self._standing_in.get(job) == newest[0]
        )
        if newest is not None and janitor:
            self._janitor(job, view, newest[0])
        elif newest is not None and self._retention_overdue(job, view, newest[0]):
            self._standing_in[job] = newest[0]  # until a newer step completes
            self._janitor(job, self.catalog.view(job, fresh=True), newest[0])
        kept = tuple(sorted(view.complete))
        self._set_status(job, complete=kept, newest_complete=kept[-1] if kept else None)
        if kept:
            self.metrics.last_step.labels(job=job).set(kept[-1])

    def _retention_overdue(self, job: str, view: BucketView, newest: int) -> bool:
        """Whether this node takes over the janitor's duties (``_standing_in``) from the node that
        completed the newest step: its views have shown complete steps that retention drops for
        ``takeover_after``, plus a spread of up to as long again (rendezvous-hashed per node, so one node,
        not every node, usually acts first). The completer may be gone for good (a preempted node), and
        a completer whose view missed a step completed beside it retained one step too few."""
        dropped = self.policy.retention(view.complete, protect=self._protected(job)).delete
        if not dropped:
            self._overdue_since.pop(job, None)
            return False
        since = self._overdue_since.setdefault(job, self.clock())
        spread = rendezvous_score(job, newest, -2, self.node) / 2**64
        if self.clock() - since < self.settings.takeover_after * (1 + spread):
            return False
        del self._overdue_since[job]  # acting now; a retirement that fails waits as long again
        log.warning(
            "job %s: the bucket holds complete steps its retention drops (%s) for %.0fs and %s, which "
            "completed the newest, has not deleted them: applying retention here",
            job,
            list(dropped),
            self.clock() - since,
            view.completed_by.get(newest),
        )
        return True

    def _protected(self, job: str) -> list[int]:
        """Steps this node is fetching for a restore: retention never drops them."""
        return [s for s, n in self._fetching.get(job, collections.Counter()).items() if n > 0]

    def _delete_own_ranks(self, job: str, step: int) -> None:
        """Delete the objects of the ranks this node is the primary of, of a retired step (every node
        its own: the bucket work of a retirement is spread like that of the upload)."""
        try:
            tree = open_job(self.root, job)
        except FileNotFoundError:
            return
        with tree:
            ranks = set(rank_trees(tree, "primary"))
        if ranks:
            n = self.catalog.delete_ranks(job, step, ranks, chunk_lists=self.settings.chunks)
            log.info("step %d of %s is retired: deleted %d objects of ranks %s", step, job, n, sorted(ranks))

    def _janitor(self, job: str, view: BucketView, newest: int) -> None:
        """The duties of the node that completed the newest step: retention when the catalog changed
        (a retirement it could not finish), and deleting incomplete steps older than the newest complete
        one ``incomplete_grace`` after it first saw them so (and once none of their objects changed for
        that long): by then every node deleted its own ranks of a retired step."""
        if not view.fresh:
            return
        if self.policy.retention(view.complete, protect=self._protected(job)).delete:
            with self.fences.writing(job, newest):
                self._retire(job, {}, newest)
        self._sweep(job, newest, view)
        since = self._old_since.setdefault(job, {})
        now, grace = time.monotonic(), self.settings.incomplete_grace
        for s in [s for s in since if s not in view.incomplete_old]:
            del since[s]
        for s in view.incomplete_old:
            if now - since.setdefault(s, now) >= grace:
                self.catalog.delete_step(job, s, grace=grace)

    def _sweep(self, job: str, newest: int, view: BucketView) -> None:
        """Delete the chunks no step in the bucket refers to any more (under a writer lease; put off
        while another node writes objects of the job), once per set of steps the bucket holds (chunks
        become garbage only when a step's objects go). A failure is logged: the next pass sweeps."""
        steps = (frozenset(view.complete), view.incomplete_old, frozenset(view.in_progress), view.refused)
        if not self.settings.chunks or self._swept.get(job) == steps:
            return  # a node that uploads no chunks (layout 2) sweeps none
        try:
            with self.fences.writing(job, newest) as lease:
                deleted = self.sweeper.sweep(job, lease.key)
        except (StoreError, FormatError) as exc:
            log.warning("job %s: chunk sweep failed: %s", job, exc)
            return
        if deleted is not None:
            self._swept[job] = steps
        if deleted:
            self.metrics.chunks_deleted.inc(deleted)

    def _check_stop(self, job: str) -> None:
        if self.fences.fenced(job):
            raise JobFenced(f"uploads of job {job} stopped: it is being purged on this node")

    # ------------------------------------------------------------------------------------ local data

    def _local_copies(
        self, job: str, tree: Beneath, step: int, hint: Iterable[int]
    ) -> dict[int, tuple[Beneath, Beneath]]:
        """Rank -> this node's committed copy of ``step`` in the job tree (the views of its rank and
        step directories; primary preferred over replica). Scans the ramdisk: the daemon reports its
        primaries, but replicas held here are uploaded too. Not a primary the run the job went back from
        saved (``Holdings.left``): it is not this step as the job saves it now, and training saves it
        again (a lease of it would fail that save)."""
        ranks = set(hint) | set(rank_trees(tree, "primary")) | set(rank_trees(tree, "replica"))
        left = {r for r, steps in self.inventory.holdings(job).left.items() if step in steps}
        if left & ranks:
            log.info(
                "step %d of %s: ranks %s here not backed up, saved by the run the job went back from "
                "(training saves the step again)",
                step,
                job,
                sorted(left & ranks),
            )
        out = {}
        for r in sorted(ranks - left):
            found = find_committed(tree, r, step)
            if found is not None:
                out[r] = found
        return out

    def _newest_local(self, job: str) -> int | None:
        """The newest step committed for every primary rank here that the job still saves
        (``Holdings.newest_common``: not the ranks of a world size it left, nor a step the run it went
        back from saved); replicas if the node has none."""
        step = self.inventory.holdings(job).newest_common()
        if step is not None:
            return step
        try:
            tree = open_job(self.root, job)
        except FileNotFoundError:
            return None
        with tree:
            return newest_common_step(committed_steps(p) for p in rank_trees(tree, "replica").values())

    # ------------------------------------------------------------------------------------ plumbing

    def _remember_holders(self, job: str, holders: Mapping[int, Sequence[str]]) -> None:
        self._holders.setdefault(job, {}).update({int(r): tuple(h) for r, h in holders.items()})

    def _holders_of(self, job: str, world_size: int) -> dict[int, tuple[str, ...]]:
        """Rank -> nodes holding it. From the job's peer assignment when there is one (every node has the
        same, so every node computes the same upload split): a node's process ranks are held by it and
        by its replication peers. Otherwise what the daemon told us in ``on_step_committed`` calls."""
        peers = self.assignments.get(job)
        holders = dict(self._holders.get(job, {}))
        if peers is not None:
            holders.update(holders_of(peers, world_size, copies=self.settings.peers_hold_copies))
        return holders

    def _lock(self, job: str) -> asyncio.Lock:
        return self._locks.setdefault(job, asyncio.Lock())

    def _purge_mark(self, job: str) -> int:
        """Where ``job``'s purges stood when a call queued for the job's lock (``_fenced_since``): the
        count of its purges here, -1 while one is under way."""
        return -1 if self.fences.fenced(job) else self.fences.purges(job)

    def _fenced_since(self, job: str, begun: int) -> bool:
        """Whether ``job`` is fenced, or was when the caller queued (``begun``, its ``_purge_mark``), or
        was fenced since: a call queued behind a purge never runs after it, not once the fence lifted."""
        return self.fences.fenced(job) or self.fences.purges(job) != begun

    def _set_status(self, job: str, **changes: Any) -> None:
        self._status[job] = dataclasses.replace(self._status.get(job, BackupStatus()), **changes)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._ops, functools.partial(fn, *args))


def _assign_mine(job: str, step: int, node: str, holders: Mapping[int, Sequence[str]]) -> dict[int, str]:
    """``assign_uploads`` of the ranks whose holders include ``node``: each block of ranks is dealt
    over its own holders, so this is what every node computes for them, from this node's neighbourhood
    of the peer plan alone."""
    return assign_uploads(job, step, {r: h for r, h in holders.items() if node in h})


def completion_rank(job: str, step: int, world_size: int) -> int:
    """The rank whose holders try to complete ``step`` when its last writer did not (rendezvous-hashed:
    a different rank, so different nodes, every step)."""
    return rendezvous_score(job, step, -1, "complete") % max(1, world_size)


@contextlib.contextmanager
def _leases(
    copies: Mapping[int, tuple[Beneath, Beneath]], step: int, holder: str, ttl: float
) -> Iterator[dict[int, Beneath]]:
    """Lease each rank's copy of ``step`` (renewed by one background thread) so retention leaves it
    alone while it is read. Yields rank -> the step's view, for the ranks whose step still existed when
    leased."""
    with leases.hold_all({r: rank for r, (rank, _) in copies.items()}, step, holder, ttl=ttl) as held:
        for r in held.missing:
            log.warning(
                "rank %d step %d vanished from %s before it could be uploaded", r, step, copies[r][0].where
            )
        yield {r: copies[r][1] for r in held.held()}


class _Progress:
    """Per-chunk byte counts from worker threads -> a metric, and throttled cumulative
    ``progress(done)`` calls on the event loop (in order: the final call comes last)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, progress: ProgressCallback | None, count: Callable[[int], None]
    ) -> None:
        self._loop, self._progress, self._count = loop, progress, count
        self._lock = threading.Lock()
        self.done = self._reported = 0

    def add(self, n: int) -> None:
        """From a worker thread, as bytes arrive."""
        self._count(n)
        with self._lock:
            self.done += n
            if self.done - self._reported < _PROGRESS_EVERY:
                return
            self._reported = done = self.done
        if self._progress is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                self._loop.call_soon_threadsafe(self._progress, done)

    def finish(self) -> None:
        """On the loop, after the transfer: calls scheduled by the workers have already run."""
        if self._progress is not None:
            self._progress(self.done)


def _manifests(local: Mapping[int, tuple[Beneath, Beneath]]) -> dict[int, int]:
    """Rank -> the crc32c of the manifest of this node's committed copy (``_local_copies``), for those
    whose commit marker is still readable (a copy retired meanwhile is left out)."""
    out = {}
    for rank, (_, step) in local.items():
        try:
            marker = read_commit(step)
        except (FormatError, OSError):
            continue
        if marker is not None:
            out[rank] = marker.manifest_crc32c
    return out
