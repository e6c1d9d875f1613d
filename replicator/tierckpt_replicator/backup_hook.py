"""The seam to the GCS backup service (``tierckpt_replicator.backup``, owned by its own module).

The daemon talks to it only through ``BackupPort``. ``load_backup_service`` gives it a ``JobBackups``:
each job is backed up by the ``BackupService`` of its *effective* settings, the node's flags
(``--gcs-*``, ``--backup-*``) overridden by the job's ``control/policy.json`` (``JobPolicy``, sent by
the operator from the CheckpointConfiguration). Services are built on first use, one per distinct
bucket, prefix, schedule and retention, importing the backup module (and so google-cloud-storage)
only then; a job whose policy names no bucket on a node without ``--gcs-bucket`` is not backed up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry

from tierckpt.protocol.control import JobPolicy
from tierckpt.protocol.errors import MissingCheckpointError
from tierckpt_replicator.policies import PolicyStore
from tierckpt_replicator.settings import Settings

if TYPE_CHECKING:
    from tierckpt_replicator.backup.metrics import BackupMetrics
    from tierckpt_replicator.backup.service import BackupService
    from tierckpt_replicator.backup.settings import BackupSettings

__all__ = [
    "BackupPort",
    "JobBackups",
    "bucket_world_sizes",
    "effective_settings",
    "load_backup_service",
    "node_backup_settings",
]

log = logging.getLogger(__name__)


class BackupPort(Protocol):
    """What the daemon uses of ``BackupService`` (see its docstrings for the full contract), except
    ``purge_job``: here it stops the job's backups *and deletes them from the bucket*."""

    async def on_step_committed(
        self, job: str, step: int, ranks_here: Sequence[int], holders: Mapping[int, Sequence[str]]
    ) -> None: ...

    async def backup_now(
        self, job: str, *, holders: Mapping[int, Sequence[str]] | None = None, all_local: bool = False
    ) -> int | None: ...

    async def poll(self, job: str) -> None: ...

    async def complete_steps(self, job: str) -> tuple[int, ...]: ...

    async def fetch_rank(
        self,
        job: str,
        step: int,
        rank: int,
        dest_rank_dir: Path,
        progress: Callable[[int], None] | None = None,
    ) -> None: ...

    async def purge_job(self, job: str) -> None: ...

    def status(self, job: str) -> Any: ...

    async def close(self) -> None: ...


def effective_settings(node: BackupSettings, policy: JobPolicy | None) -> BackupSettings | None:
    """The node's backup settings with the job's policy applied; None if no bucket is named anywhere.

    A policy always sets the schedule and retention; its bucket (with its prefix) replaces the node's
    when it names one, else the node's bucket and prefix stay.
    """
    if policy is None:
        return node if node.enabled else None
    settings = dataclasses.replace(
        node,
        interval_steps=policy.backup_interval_steps,
        interval_seconds=policy.backup_interval_minutes * 60.0,
        keep_last=policy.keep_last,
        keep_every=policy.keep_every,
    )
    if policy.bucket:
        settings = dataclasses.replace(settings, bucket=policy.bucket, prefix=policy.prefix)
    return settings if settings.enabled else None


class JobBackups:
    """A ``BackupPort`` that routes each job to the ``BackupService`` of its effective settings."""

    def __init__(
        self, settings: Settings, *, policies: PolicyStore, registry: CollectorRegistry | None = None
    ) -> None:
        self.settings, self.policies, self.registry = settings, policies, registry
        self._node: BackupSettings | None = None
        self._metrics: BackupMetrics | None = None
        self._services: dict[BackupSettings, BackupService] = {}
        self._bound: dict[str, BackupSettings] = {}
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def node_settings(self) -> BackupSettings:
        """The node's own backup settings, from its flags (importing the backup module on first use)."""
        if self._node is None:
            self._node = node_backup_settings(self.settings)
        return self._node

    def service(self, job: str) -> BackupService | None:
        """The job's service under its current policy (built on first use), or None without a bucket."""
        policy = self.policies.get(job)
        named = self.settings.gcs_bucket or (policy is not None and policy.bucket)
        settings = effective_settings(self.node_settings, policy) if named else None
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
            svc = settings.build(node=self.settings.node_name, root=self.settings.root, metrics=self.metrics)
            self._services[settings] = svc
        return svc

    @property
    def metrics(self) -> BackupMetrics:
        if self._metrics is None:
            from tierckpt_replicator.backup.metrics import BackupMetrics

            self._metrics = (
                BackupMetrics(self.registry) if self.registry is not None else BackupMetrics.default()
            )
        return self._metrics

    # ------------------------------------------------------------------ BackupPort

    async def on_step_committed(
        self, job: str, step: int, ranks_here: Sequence[int], holders: Mapping[int, Sequence[str]]
    ) -> None:
        if (svc := self._service_or_log(job)) is not None:
            await svc.on_step_committed(job, step, ranks_here, holders)

    async def backup_now(
        self, job: str, *, holders: Mapping[int, Sequence[str]] | None = None, all_local: bool = False
    ) -> int | None:
        svc = self.service(job)
        if svc is None:
            raise LookupError(
                f"GCS backup is not configured for job {job}: no --gcs-bucket, no policy bucket"
            )
        return await svc.backup_now(job, holders=holders, all_local=all_local)

    async def poll(self, job: str) -> None:
        if (svc := self._service_or_log(job)) is not None:
            await svc.poll(job)

    async def complete_steps(self, job: str) -> tuple[int, ...]:
        svc = self.service(job)
        return await svc.complete_steps(job) if svc is not None else ()

    async def fetch_rank(
        self,
        job: str,
        step: int,
        rank: int,
        dest_rank_dir: Path,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        svc = self.service(job)
        if svc is None:
            raise MissingCheckpointError(f"job {job} has no bucket to restore step {step} from")
        await svc.fetch_rank(job, step, rank, dest_rank_dir, progress)

    async def purge_job(self, job: str) -> None:
        """Stop the job's uploads and delete its backups from its bucket (irreversible)."""
        svc = self.service(job)
        if svc is None:
            return
        await svc.purge_job(job)
        await svc.delete_backups(job)
        self._unbind(job)

    def status(self, job: str) -> Any:
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


async def bucket_world_sizes(backup: BackupPort, job: str) -> dict[int, int]:
    """Step -> world size of each step complete in the bucket (0 where the service cannot say).

    The world size comes from each step's completion object, read through the service's catalog; it
    lets a cluster that lost every in-memory copy still compute which ranks each node restores.
    """
    target: Any = backup.service(job) if isinstance(backup, JobBackups) else backup
    if target is None:
        return {}
    catalog = getattr(target, "catalog", None)
    if catalog is not None and hasattr(catalog, "complete_steps"):
        done = await asyncio.to_thread(catalog.complete_steps, job)
        return {int(step): int(getattr(info, "world_size", 0)) for step, info in done.items()}
    return dict.fromkeys(await target.complete_steps(job), 0)


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
    )


def load_backup_service(
    settings: Settings, registry: CollectorRegistry, policies: PolicyStore | None = None
) -> JobBackups:
    """Backups of this node's jobs (metrics on ``registry``): to ``--gcs-bucket`` and to the buckets
    the jobs' policies name. Without ``--gcs-bucket`` the backup module (and google-cloud-storage) is
    imported only once a job's policy names a bucket."""
    backups = JobBackups(settings, policies=policies or PolicyStore(settings.root), registry=registry)
    if settings.gcs_bucket:
        _ = backups.node_settings, backups.metrics  # fail fast on bad flags; metrics exported from the start
        log.info(
            "GCS backup to gs://%s/%s enabled (job policies may name other buckets)",
            settings.gcs_bucket,
            settings.gcs_prefix,
        )
    return backups
