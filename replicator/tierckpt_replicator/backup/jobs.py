"""Backups per job: the daemon's one door to tier 3 (``BackupPort``) and its implementation
(``JobBackups``).

Each job is backed up by the ``BackupService`` of its *effective* settings: the node's flags
(``--gcs-*``, ``--backup-*``, ``node_backup_settings``) overridden by the job's ``policy.json``
(``JobPolicy``, sent by the operator from the CheckpointConfiguration; ``effective_settings``), and for
an Orbax-mode job the backup interval its ``replicator.yaml`` asked for (``orbax_state.OrbaxStore``).
Services are built on first use, one per distinct settings (bucket, prefix, schedule, retention), which
is when google-cloud-storage is first imported: this module imports no other part of the backup
package at load time, so a node without ``--gcs-bucket`` whose jobs name no bucket never loads it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, cast

from prometheus_client import CollectorRegistry

from tierckpt.protocol.control import JobPolicy
from tierckpt.protocol.errors import MissingCheckpointError
from tierckpt.protocol.format import Dir
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.orbax_state import OrbaxStore
from tierckpt_replicator.settings import Settings
from tierckpt_replicator.stores import NodeStores

if TYPE_CHECKING:
    from tierckpt_replicator.backup.chunkcodec import Compression
    from tierckpt_replicator.backup.metrics import BackupMetrics
    from tierckpt_replicator.backup.service import BackupService, BackupStatus
    from tierckpt_replicator.backup.settings import BackupSettings

__all__ = [
    "NO_BACKUP",
    "BackupPort",
    "JobBackups",
    "NoBackup",
    "effective_settings",
    "load_job_backups",
    "node_backup_settings",
]

log = logging.getLogger(__name__)


class BackupPort(Protocol):
    """What the daemon (and restore staging) use of tier 3. The methods mean what ``BackupService``'s
    of the same name mean (see there), whichever service the job's settings route it to."""

    async def on_step_committed(
        self, job: str, step: int, ranks_here: Sequence[int], holders: Mapping[int, Sequence[str]]
    ) -> None: ...

    async def backup_now(
        self, job: str, *, holders: Mapping[int, Sequence[str]] | None = None, all_local: bool = False
    ) -> int | None: ...

    async def poll(self, job: str) -> None: ...

    async def complete_steps(self, job: str) -> tuple[int, ...]: ...

    async def complete_world_sizes(self, job: str) -> dict[int, int]:
        """Step -> world size of each step complete in the job's bucket (empty without a bucket)."""
        ...

    async def fetch_rank(
        self,
        job: str,
        step: int,
        rank: int,
        dest_rank_dir: Dir,
        progress: Callable[[int], None] | None = None,
        seed: Beneath | None = None,
    ) -> None: ...

    async def data_source(self, job: str, step: int, rank: int) -> int | None:
        """The rank whose bucket objects hold ``rank``'s data files (None: its own)."""
        ...

    async def fence(self, job: str) -> None:
        """No backup or upload of the job starts on this node until ``unfence``; the one running has
        stopped when this returns (a purge calls it before it deletes anything)."""
        ...

    def unfence(self, job: str) -> None:
        """Lift the fence and forget the job's backup state on this node (it was purged)."""
        ...

    async def delete_backups(self, job: str) -> None:
        """Delete the job's backups from its bucket, also while other nodes still upload some
        (irreversible)."""
        ...

    def status(self, job: str) -> BackupStatus | None:
        """This node's view of the job's backups; None while no service has handled the job."""
        ...

    async def close(self) -> None: ...


class NoBackup:
    """The ``BackupPort`` of a node without tier 3 (tests and tools that build a daemon without one):
    nothing is uploaded, the bucket holds nothing, an on-demand backup is refused as unconfigured."""

    async def on_step_committed(
        self, job: str, step: int, ranks_here: Sequence[int], holders: Mapping[int, Sequence[str]]
    ) -> None:
        return None

    async def backup_now(
        self, job: str, *, holders: Mapping[int, Sequence[str]] | None = None, all_local: bool = False
    ) -> int | None:
        raise LookupError("GCS backup is not configured on this node (--gcs-bucket)")

    async def poll(self, job: str) -> None:
        return None

    async def complete_steps(self, job: str) -> tuple[int, ...]:
        return ()

    async def complete_world_sizes(self, job: str) -> dict[int, int]:
        return {}

    async def fetch_rank(
        self,
        job: str,
        step: int,
        rank: int,
        dest_rank_dir: Dir,
        progress: Callable[[int], None] | None = None,
        seed: Beneath | None = None,
    ) -> None:
        raise MissingCheckpointError(f"job {job} has no bucket to restore step {step} from")

    async def data_source(self, job: str, step: int, rank: int) -> int | None:
        return None

    async def fence(self, job: str) -> None:
        return None

    def unfence(self, job: str) -> None:
        return None

    async def delete_backups(self, job: str) -> None:
        return None

    def status(self, job: str) -> BackupStatus | None:
        return None

    async def close(self) -> None:
        return None


NO_BACKUP: BackupPort = NoBackup()


def effective_settings(
    node: BackupSettings, policy: JobPolicy | None, schedule: tuple[int, float] | None = None
) -> BackupSettings | None:
    """The node's backup settings with the job's policy applied; None if no bucket is named anywhere.

    A policy always sets the schedule and retention; its bucket (with its prefix) replaces the node's
    when it names one, else the node's bucket and prefix stay. ``schedule`` (``(interval_steps,
    interval_seconds)``: the interval an Orbax-mode job asked for in its ``replicator.yaml``) replaces
    the schedule, whatever the policy says.
    """
    settings = _with_policy(node, policy)
    if schedule is not None:
        settings = dataclasses.replace(settings, interval_steps=schedule[0], interval_seconds=schedule[1])
    return settings if settings.enabled else None


def _with_policy(node: BackupSettings, policy: JobPolicy | None) -> BackupSettings:
    if policy is None:
        return node
    settings = dataclasses.replace(
        node,
        interval_steps=policy.backup_interval_steps,
        interval_seconds=policy.backup_interval_minutes * 60.0,
        keep_last=policy.keep_last,
        keep_every=policy.keep_every,
        peers_hold_copies=policy.erasure is None,
    )
    if policy.bucket:
        settings = dataclasses.replace(settings, bucket=policy.bucket, prefix=policy.prefix)
    return settings


def node_backup_settings(settings: Settings) -> BackupSettings:
    """The backup settings the node's own flags give (before any job policy)."""
    from tierckpt_replicator.backup.settings import BackupSettings

    return BackupSettings(
        bucket=settings.gcs_bucket,
        prefix=settings.gcs_prefix,
        endpoint=settings.gcs_endpoint,
        project=settings.gcs_project or None,
        interval_steps=settings.backup_interval_steps,
        interval_seconds=settings.backup_interval,
        keep_last=settings.backup_keep_last,
        keep_every=settings.backup_keep_every,
        parallelism=settings.backup_parallelism,
        takeover_after=settings.backup_takeover_after,
        group_wait=settings.backup_group_wait,
        chunks=settings.backup_chunks,
        compression=cast("Compression", settings.backup_compression),
    )


class JobBackups:
    """The ``BackupPort``: routes each job to the ``BackupService`` of its effective settings."""

    def __init__(
        self,
        settings: Settings,
        *,
        stores: NodeStores,
        registry: CollectorRegistry | None = None,
        orbax: OrbaxStore | None = None,
    ) -> None:
        self.settings, self.registry = settings, registry
        self.policies, self.quotas, self.assignments = stores.policies, stores.quotas, stores.assignments
        self.plans = stores.plans
        """The node's stores (the daemon's): the policies route each job, the assignments spread its
        uploads, the restore plans the daemon's stager keeps there say which steps it never uploads."""
        self.orbax = orbax or OrbaxStore(settings.root)
        """Orbax-mode jobs' state: the backup interval each asked for replaces its policy's schedule."""
        self._node: BackupSettings | None = None
        self._metrics: BackupMetrics | None = None
        self._services: dict[BackupSettings, BackupService] = {}
        self._bound: dict[str, BackupSettings] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._fenced: set[str] = set()

    @property
    def node_settings(self) -> BackupSettings:
        """The node's own backup settings, from its flags (importing the backup module on first use)."""
        if self._node is None:
            self._node = node_backup_settings(self.settings)
        return self._node

    @property
    def metrics(self) -> BackupMetrics:
        if self._metrics is None:
            from tierckpt_replicator.backup.metrics import BackupMetrics

            self._metrics = (
                BackupMetrics(self.registry) if self.registry is not None else BackupMetrics.default()
            )
        return self._metrics

    def service(self, job: str) -> BackupService | None:
        """The job's service under its current policy (built on first use), or None without a bucket."""
        policy = self.policies.get(job)
        named = self.settings.gcs_bucket or (policy is not None and policy.bucket)
        settings = effective_settings(self.node_settings, policy, self.orbax.schedule(job)) if named else None
        before = self._bound.get(job)
        if settings is None:
            self._unbind(job)
            return None
        if settings != before:
            self._bound[job] = settings
            log.info(
                "job %s: backups to gs://%s/%s every %d steps / %gs, keeping %d newest + every %d steps",
                job,
                settings.bucket,
                settings.prefix,
                settings.interval_steps,
                settings.interval_seconds,
                settings.keep_last,
                settings.keep_every,
            )
            if before is not None:
                self._retire(before)
        svc = self._services.get(settings)
        if svc is None:
            from tierckpt_replicator.backup.service import BackupService

            svc = BackupService.for_bucket(
                settings,
                node=self.settings.node_name,
                root=self.settings.root,
                metrics=self.metrics,
                quotas=self.quotas,
                assignments=self.assignments,
                plan_of=self.plans.get,
            )
            self._services[settings] = svc
        return svc

    # ------------------------------------------------------------------ BackupPort

    async def on_step_committed(
        self, job: str, step: int, ranks_here: Sequence[int], holders: Mapping[int, Sequence[str]]
    ) -> None:
        if job not in self._fenced and (svc := self._service_or_log(job)) is not None:
            await svc.on_step_committed(job, step, ranks_here, holders)

    async def backup_now(
        self, job: str, *, holders: Mapping[int, Sequence[str]] | None = None, all_local: bool = False
    ) -> int | None:
        if job in self._fenced:
            from tierckpt_replicator.backup.fence import JobFenced

            raise JobFenced(f"job {job} is being purged: no backup of it starts")
        svc = self.service(job)
        if svc is None:
            raise LookupError(
                f"GCS backup is not configured for job {job}: no --gcs-bucket, no policy bucket"
            )
        return await svc.backup_now(job, holders=holders, all_local=all_local)

    async def poll(self, job: str) -> None:
        if job not in self._fenced and (svc := self._service_or_log(job)) is not None:
            await svc.poll(job)

    async def complete_steps(self, job: str) -> tuple[int, ...]:
        svc = self.service(job)
        return await svc.complete_steps(job) if svc is not None else ()

    async def complete_world_sizes(self, job: str) -> dict[int, int]:
        svc = self.service(job)
        return await svc.complete_world_sizes(job) if svc is not None else {}

    async def fetch_rank(
        self,
        job: str,
        step: int,
        rank: int,
        dest_rank_dir: Dir,
        progress: Callable[[int], None] | None = None,
        seed: Beneath | None = None,
    ) -> None:
        svc = self.service(job)
        if svc is None:
            raise MissingCheckpointError(f"job {job} has no bucket to restore step {step} from")
        await svc.fetch_rank(job, step, rank, dest_rank_dir, progress, seed)

    async def data_source(self, job: str, step: int, rank: int) -> int | None:
        svc = self.service(job)
        return await svc.data_source(job, step, rank) if svc is not None else None

    async def fence(self, job: str) -> None:
        self._fenced.add(job)  # no call reaches a service now, not even one built meanwhile
        await asyncio.gather(*(svc.fence(job) for svc in self._services.values()))

    def unfence(self, job: str) -> None:
        self._fenced.discard(job)
        for svc in self._services.values():
            svc.unfence(job)
        self._unbind(job)

    async def delete_backups(self, job: str) -> None:
        svc = self.service(job)
        if svc is not None:
            await svc.delete_backups(job)

    def status(self, job: str) -> BackupStatus | None:
        settings = self._bound.get(job)
        svc = self._services.get(settings) if settings is not None else None
        return svc.status(job) if svc is not None else None

    async def close(self) -> None:
        services, self._services = list(self._services.values()), {}
        await asyncio.gather(*self._closing, *(s.close() for s in services), return_exceptions=True)

    # ------------------------------------------------------------------ plumbing

    def _service_or_log(self, job: str) -> BackupService | None:
        try:
            return self.service(job)
        except Exception as exc:  # a bad bucket or credentials: the next step tries again
            log.error("job %s: cannot set up its backup service: %s", job, exc)
            return None

    def _unbind(self, job: str) -> None:
        before = self._bound.pop(job, None)
        if before is not None:
            self._retire(before)

    def _retire(self, settings: BackupSettings) -> None:
        """Close a service no job uses any more (its running pass finishes first)."""
        if settings in self._bound.values() or settings == self._node:
            return
        svc = self._services.pop(settings, None)
        if svc is not None:
            task = asyncio.ensure_future(svc.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


def load_job_backups(
    settings: Settings, registry: CollectorRegistry, stores: NodeStores | None = None
) -> JobBackups:
    """Backups of this node's jobs (metrics on ``registry``): to ``--gcs-bucket`` and to the buckets
    the jobs' policies name. Without ``--gcs-bucket`` the rest of the backup package (and
    google-cloud-storage) is imported only once a job's policy names a bucket."""
    backups = JobBackups(settings, stores=stores or NodeStores.open(settings), registry=registry)
    if settings.gcs_bucket:
        _ = backups.node_settings, backups.metrics  # fail fast on bad flags; metrics exported from the start
        log.info(
            "GCS backup to gs://%s/%s enabled (job policies may name other buckets)",
            settings.gcs_bucket,
            settings.gcs_prefix,
        )
    return backups
