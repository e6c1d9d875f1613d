"""What the control API does on this node: ``NodeControls``, the ``Controls`` the routes call.

Inventory (the ramdisk scan plus the steps complete in the bucket, cached a few seconds), peer
assignments, restore plans and policies (newest generation wins), on-demand backups, restore staging,
purging a job, and the node's status and readiness. The parts it works on (stores, scanner, stager,
replication, backup service) are built and run by the composition root, ``tierckpt_replicator.daemon``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import tierckpt_replicator
from tierckpt.planning.common_step import newest_common_step
from tierckpt.protocol.control import (
    JobPolicy,
    JobStatus,
    NodeInventory,
    NodeStatus,
    PeerAssignment,
    RestorePlan,
    RestoreState,
    StepBytes,
    read_control,
    write_control,
)
from tierckpt.protocol.errors import FormatError, UnsafePathError
from tierckpt.protocol.format import check_job_id, discard_step, state_dir, step_names
from tierckpt.protocol.orbax import OrbaxSession
from tierckpt_replicator.api.auth import Authorizer
from tierckpt_replicator.assignments import AssignmentStore
from tierckpt_replicator.backup.jobs import NO_BACKUP, BackupPort
from tierckpt_replicator.commits import NewSteps
from tierckpt_replicator.inventory import InventoryScanner, list_jobs
from tierckpt_replicator.metrics import Metrics
from tierckpt_replicator.orbax import OrbaxJobs
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.replication.manager import ReplicationManager
from tierckpt_replicator.replication.replicas import free_bytes
from tierckpt_replicator.replication.supervisor import WorkerSupervisor
from tierckpt_replicator.restore.requests import FetchRequests
from tierckpt_replicator.restore.stage import Stager
from tierckpt_replicator.settings import Settings
from tierckpt_replicator.stepio import open_job, rank_trees
from tierckpt_replicator.waits import done_within
from tierckpt_replicator.watch import CommitWatcher

__all__ = ["LocalInventory", "NodeControls", "remove_job_tree", "step_bytes"]

log = logging.getLogger(__name__)

_GCS_CACHE_SECONDS = 10.0
_GCS_WAIT_SECONDS = 1.0
"""How long an inventory waits for the bucket's listing before it answers with the last one it had."""


class LocalInventory:
    """``await inventory(job)``: what this node holds of the job, with the steps complete in the bucket.

    The bucket's steps are cached for a few seconds per job (``forget_bucket`` drops a job's entry
    after a backup); a bucket that cannot be listed makes its steps unknown, not the inventory fail. A
    listing runs in the background, one per job at a time, and an inventory waits for it at most
    ``_GCS_WAIT_SECONDS``, then answers with the steps it knew: a node cut off from the bucket (whose
    listing retries for minutes) still shows its peers and the operator what its ramdisk holds.
    """

    def __init__(
        self,
        scanner: InventoryScanner,
        backup: BackupPort = NO_BACKUP,
        *,
        replication: ReplicationManager | None = None,
        restoring: Mapping[str, Mapping[int, RestoreState]] | None = None,
    ) -> None:
        self.scanner, self.backup, self.replication = scanner, backup, replication
        """``replication``: the loop's view (redundancy, replica groups, quota refusals), once it runs."""
        self.restoring: Mapping[str, Mapping[int, RestoreState]] = restoring if restoring is not None else {}
        """Job -> rank -> state of this node's restore staging (the stager's ``states``)."""
        self._cache: dict[str, tuple[float, dict[int, int]]] = {}
        self._listing: dict[str, asyncio.Task[dict[int, int] | None]] = {}

    async def __call__(self, job: str) -> NodeInventory:
        bucket, known = await self._bucket(job)
        inv = self.scanner.inventory(job, gcs=tuple(bucket))
        # a step known only from the bucket still needs its world size, or nobody knows its ranks
        world_sizes = {**{s: ws for s, ws in bucket.items() if ws > 0}, **inv.world_sizes}
        restoring = {r: s.value for r, s in self.restoring.get(job, {}).items()}
        inv = dataclasses.replace(inv, world_sizes=world_sizes, restoring=restoring, gcs_pending=not known)
        replication = self.replication
        if replication is not None:
            inv = dataclasses.replace(
                inv,
                redundancy=replication.redundancy.get(job),
                over_quota=replication.over_quota(job),
                diverged=replication.groups.diverged(job),
                step_bytes=step_bytes(replication.groups.step_bytes(job), self.backup, job),
            )
        return inv

    async def bucket_steps(self, job: str) -> dict[int, int]:
        """Step -> world size of every step complete in the bucket (cached a few seconds)."""
        return (await self._bucket(job))[0]

    async def _bucket(self, job: str) -> tuple[dict[int, int], bool]:
        """``bucket_steps``, and whether they are known: False when the listing did not answer within
        ``_GCS_WAIT_SECONDS`` (or failed) and no earlier one is cached (the steps are then unknown)."""
        cached = self._cache.get(job)
        if cached and time.monotonic() - cached[0] < _GCS_CACHE_SECONDS:
            return cached[1], True
        listing = self._listing.get(job)
        if listing is None or listing.done():
            listing = self._listing[job] = asyncio.create_task(self._list(job), name=f"bucket-steps-{job}")
        if await done_within(listing, _GCS_WAIT_SECONDS):  # (the listing goes on for the next call)
            listed = listing.result()
            if listed is not None:
                return listed, True
        else:
            log.info("job %s: the bucket is slow to list; answering with the steps known before", job)
        cached = self._cache.get(job)
        return (cached[1], True) if cached else ({}, False)

    async def _list(self, job: str) -> dict[int, int] | None:
        """The bucket's complete steps; None if it cannot be listed (they are unknown, not fatal)."""
        try:
            steps = await self.backup.complete_world_sizes(job)
        except Exception as exc:
            log.warning("job %s: cannot list complete steps in the bucket: %s", job, exc)
            return None
        self._cache[job] = (time.monotonic(), steps)
        return steps

    def forget_bucket(self, job: str) -> None:
        self._cache.pop(job, None)
        self._listing.pop(job, None)


@dataclasses.dataclass
class NodeControls:
    """The operations of the control API (``tierckpt_replicator.api.routes.Controls``) on this node."""

    settings: Settings
    auth: Authorizer
    metrics: Metrics
    started_at: float
    backup: BackupPort
    assignments: AssignmentStore
    policies: PolicyStore
    scanner: InventoryScanner
    local_inventory: LocalInventory
    supervisor: WorkerSupervisor
    watcher: CommitWatcher
    replication: ReplicationManager
    uploads: NewSteps
    """The backup's subscription to the commit feed (a purged job's steps are new again)."""
    stager: Stager
    requests: FetchRequests | None = None
    orbax: OrbaxJobs | None = None

    async def inventory(self, job: str) -> NodeInventory:
        return await self.local_inventory(job)

    async def put_peers(self, assignment: PeerAssignment) -> tuple[bool, PeerAssignment]:
        before = self.assignments.get(assignment.job)
        stored, current = self.assignments.put(assignment)
        if stored:
            self.watcher.kick()
            node = self.settings.node_name
            old_rank = before.node_ranks.get(node) if before is not None else None
            if node in current.node_ranks and current.node_ranks[node] != old_rank:
                log.info(
                    "job %s: this node now has node rank %d; staging its ranks",
                    current.job,
                    current.node_ranks[node],
                )
                self.stager.start_for_assignment(current.job, current)
        return stored, current

    async def put_plan(self, plan: RestorePlan) -> tuple[bool, RestorePlan]:
        try:
            current = read_control(self.settings.root, plan.job, RestorePlan.FILE, RestorePlan)
        except FormatError:
            current = None
        if isinstance(current, RestorePlan):
            if current.generation > plan.generation:
                return False, current
            if current == plan and (self.stager.running(plan.job) or plan.job in self.stager.plans):
                return True, current  # the same plan again: staging already under way or done
        write_control(self.settings.root, plan.job, RestorePlan.FILE, plan)
        self.stager.start_for_plan(plan.job, plan)
        return True, plan

    async def put_policy(self, policy: JobPolicy) -> tuple[bool, JobPolicy]:
        """Store the job's policy (newer generation only); backups follow it from the next step on, its
        replication factor from the next replication pass (started now: a new factor heals at once)."""
        accepted, current = self.policies.put(policy)
        if accepted:
            self.watcher.kick()
        return accepted, current

    async def put_orbax_session(self, session: OrbaxSession) -> tuple[bool, OrbaxSession]:
        """Store this node's Orbax session of the job (newer generation only); the next pass of the loop
        writes its ``jax-init-info.txt`` (see ``tierckpt_replicator.orbax``)."""
        if self.orbax is None:
            raise LookupError("this replicator runs no Orbax mode")
        return await self.orbax.put_session(session)

    async def backup_now(self, job: str) -> int | None:
        try:
            step = await self.backup.backup_now(job, holders=self._placements(job))
        except LookupError:
            self.metrics.backups.labels("unconfigured").inc()
            raise
        except Exception:
            self.metrics.backups.labels("failed").inc()
            raise
        self.metrics.backups.labels("ok").inc()
        self.local_inventory.forget_bucket(job)
        return step

    def _placements(self, job: str) -> dict[int, tuple[str, ...]]:
        """Where the copies of this node's primaries are, for the newest step they all share: here,
        and on the peers that confirmed a replica (which may not be the ones ``peers.json`` names)."""
        holdings = self.scanner.holdings(job)
        step = newest_common_step(h.local for h in holdings.ranks.values() if h.local)
        if step is None:
            return {}
        here = self.settings.node_name
        return {
            r: (here, *sorted(self.replication.confirmed.get((job, r, step), ())))
            for r, s in holdings.newest_local().items()
            if s == step
        }

    async def restore(self, job: str) -> None:
        self.stager.start(job)

    async def purge(self, job: str, *, bucket: bool = False) -> bool:
        await self.stager.forget(job)
        if self.requests is not None:
            await self.requests.forget(job)
        if self.orbax is not None:
            await self.orbax.forget(job)
        async with self._fenced(job):
            if bucket:  # first: the job's policy on disk names its bucket
                await self.backup.delete_backups(job)
                log.info("job %s: purged its backups from the bucket", job)
            root = self.settings.root
            existed = os.path.lexists(root / check_job_id(job)) or state_dir(root, job).exists()
            if existed:
                await asyncio.to_thread(remove_job_tree, root, job)
                log.info("job %s: purged from this node's ramdisk", job)
            self.replication.forget(job)
            self.uploads.forget(job)
            self.assignments.forget(job)
            self.policies.forget(job)
            self.scanner.forget(job)
        return existed

    @contextlib.asynccontextmanager
    async def _fenced(self, job: str) -> AsyncIterator[None]:
        """While the block deletes the job: no backup, upload, replica send or retirement of it starts on
        this node, and those under way have finished; no transfer of it arrives (those arriving are
        aborted), so nothing re-creates the job's directory. A backup call queued meanwhile is refused,
        also once the fence is lifted."""
        await self.backup.fence(job)
        await self.replication.fence(job)
        try:
            yield
        finally:
            await self.replication.unfence(job)
            self.backup.unfence(job)

    async def status(self) -> NodeStatus:
        jobs = []
        for job in list_jobs(self.settings.root):
            h = self.scanner.holdings(job)
            a = self.assignments.get(job)
            newest = h.newest_local()
            plan = self.stager.plans.get(job)
            jobs.append(
                JobStatus(
                    job=job,
                    generation=a.generation if a else -1,
                    node_rank=a.node_ranks.get(self.settings.node_name) if a else None,
                    local={r: x.local for r, x in h.ranks.items() if x.local},
                    replicas={r: x.replica for r, x in h.ranks.items() if x.replica},
                    replicated_to={
                        r: tuple(
                            sorted(
                                {*self.replication.confirmed.get((job, r, s), ())}
                                | {*self.replication.placed.get((job, r, s), {})}
                            )
                        )
                        for r, s in newest.items()
                    },
                    backed_up=tuple(sorted(await self.local_inventory.bucket_steps(job))),
                    local_bytes=h.local_bytes,
                    replica_bytes=h.replica_bytes,
                    lag_seconds=self.replication.lag(job, h),
                    last_replication_at=self.replication.last_replication.get(job, 0.0),
                    restore_step=plan.step if plan else None,
                    restore={r: s.value for r, s in self.stager.states.get(job, {}).items()},
                    backup_error=_last_error(self.backup, job),
                    redundancy=self.replication.redundancy.get(job),
                    groups=self.replication.groups.groups(job),
                    diverged=self.replication.groups.diverged(job),
                    step_bytes=step_bytes(self.replication.groups.step_bytes(job), self.backup, job),
                    over_quota=self.replication.over_quota(job),
                )
            )
        ok, why = self.ready()
        st = os.statvfs(self.settings.root)
        return NodeStatus(
            node=self.settings.node_name,
            domain=self.settings.domain,
            endpoint=self.settings.api_endpoint,
            software_version=tierckpt_replicator.__version__,
            started_at=self.started_at,
            healthy=ok,
            problems=(why,) if why else (),
            worker_up=self.supervisor.alive,
            worker_restarts=self.supervisor.restarts,
            replicas_k=self.settings.replicas,
            ramdisk_free_bytes=free_bytes(self.settings.root),
            ramdisk_total_bytes=st.f_blocks * st.f_frsize,
            jobs=tuple(jobs),
        )

    def ready(self) -> tuple[bool, str]:
        if not self.supervisor.alive:
            return False, "the replication worker is not running"
        if not os.access(self.settings.root, os.W_OK):
            return False, f"ramdisk root {self.settings.root} is not writable"
        problem = self.auth.problem()
        return (False, problem) if problem else (True, "")


def remove_job_tree(root: Path, job: str) -> None:
    """Delete a job's steps (each COMMIT first, so nothing half-deleted looks committed), then the rest,
    then the replicator's state of the job. Only what lies beneath the job's own directory is removed:
    a symlink in it (to another job's rank, say) is unlinked, never followed."""
    try:
        tree = open_job(root, job)
    except (FileNotFoundError, NotADirectoryError):
        tree = None
    except UnsafePathError:  # the job entry itself is a link: remove the link, nothing it points at
        (root / check_job_id(job)).unlink()
        tree = None
    if tree is not None:
        with tree:
            for copy in ("primary", "replica"):
                for parent in rank_trees(tree, copy).values():
                    for name in step_names(parent).values():
                        with contextlib.suppress(OSError, FormatError):
                            discard_step(parent.at(name))
            for name in tree.listdir():  # the directory itself may be a mount point: it stays
                with contextlib.suppress(OSError):
                    tree.remove_tree(name)
        with contextlib.suppress(OSError):
            os.rmdir(root / job)
    shutil.rmtree(state_dir(root, job), ignore_errors=True)


def step_bytes(replicated: StepBytes | None, backup: BackupPort, job: str) -> StepBytes | None:
    """The newest step's bytes against no-dedup: written and replicated (the replication loop's) and,
    for the same step, uploaded (the backup service's); the uploads alone when they are of a step the
    loop no longer accounts for."""
    status = backup.status(job)
    if status is None or status.last_uploaded is None:
        return replicated
    up = {"uploaded": status.uploaded_bytes, "uploaded_logical": status.uploaded_logical}
    if replicated is None or replicated.step != status.last_uploaded:
        return StepBytes(step=status.last_uploaded, **up) if replicated is None else replicated
    return dataclasses.replace(replicated, **up)


def _last_error(backup: BackupPort, job: str) -> str:
    """The backup service's last error for ``job`` ('' when backups are off or the last one worked)."""
    status = backup.status(job)
    return status.last_error if status is not None else ""
