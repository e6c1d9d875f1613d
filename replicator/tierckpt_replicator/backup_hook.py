"""The seam to the GCS backup service (``tierckpt_replicator.backup``, owned by its own module).

The daemon talks to it only through ``BackupPort`` and builds it only when a bucket is configured
(``--gcs-bucket``), importing it (and so google-cloud-storage) lazily.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from tierckpt_replicator.settings import Settings

__all__ = ["BackupPort", "bucket_world_sizes", "load_backup_service"]

log = logging.getLogger(__name__)


class BackupPort(Protocol):
    """What the daemon uses of ``BackupService`` (see its docstrings for the full contract)."""

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


async def bucket_world_sizes(backup: BackupPort, job: str) -> dict[int, int]:
    """Step -> world size of each step complete in the bucket (0 where the service cannot say).

    The world size comes from each step's completion object, read through the service's catalog; it
    lets a cluster that lost every in-memory copy still compute which ranks each node restores.
    """
    catalog = getattr(backup, "catalog", None)
    if catalog is not None and hasattr(catalog, "complete_steps"):
        done = await asyncio.to_thread(catalog.complete_steps, job)
        return {int(step): int(getattr(info, "world_size", 0)) for step, info in done.items()}
    return dict.fromkeys(await backup.complete_steps(job), 0)


def load_backup_service(settings: Settings, registry: CollectorRegistry) -> BackupPort | None:
    """The configured backup service (its metrics on ``registry``), or None without ``--gcs-bucket``."""
    if not settings.gcs_bucket:
        return None
    from tierckpt_replicator.backup.metrics import BackupMetrics
    from tierckpt_replicator.backup.settings import BackupSettings

    backup = BackupSettings(
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
    log.info("GCS backup to gs://%s/%s enabled", settings.gcs_bucket, settings.gcs_prefix)
    return backup.build(node=settings.node_name, root=settings.root, metrics=BackupMetrics(registry))
