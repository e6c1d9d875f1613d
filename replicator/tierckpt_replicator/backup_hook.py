"""The seam to the GCS backup service (``tierckpt_replicator.backup.service.BackupService``).

The daemon talks to the backup service only through ``BackupPort``, the interface agreed with its
owner, and builds it only when a bucket is configured (``--gcs-bucket``), importing it lazily.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from tierckpt_replicator.settings import Settings

__all__ = ["BackupPort", "ProgressCallback", "load_backup_service"]

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]


class BackupPort(Protocol):
    """What the daemon needs from the backup service (all async; failures raise ``TierckptError``s)."""

    async def on_step_committed(
        self, job: str, step: int, ranks_here: tuple[int, ...], holders: dict[int, tuple[str, ...]]
    ) -> None:
        """A step is committed locally for ``ranks_here``; back it up if the policy says it is due."""

    async def backup_now(self, job: str) -> int | None:
        """Back up the newest committed step now; returns the step, or None if there is none."""

    async def complete_steps(self, job: str) -> tuple[int, ...]:
        """Steps complete in the bucket (every rank's objects and the completion marker present)."""

    async def fetch_rank(
        self, job: str, step: int, rank: int, dest_rank_dir: Path, progress_cb: ProgressCallback
    ) -> None:
        """Download one rank's step, verified, as a committed step dir under ``dest_rank_dir``."""

    async def purge_job(self, job: str) -> None:
        """Forget the job on this node (cancel its uploads)."""


def load_backup_service(settings: Settings) -> BackupPort | None:
    """The configured backup service, or None without ``--gcs-bucket``."""
    if not settings.gcs_bucket:
        return None
    module = importlib.import_module("tierckpt_replicator.backup.service")
    cls: Any = module.BackupService
    params = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {}
    for name, value in (("settings", settings), ("node", settings.node_name), ("root", settings.root)):
        if name in params:
            kwargs[name] = value
    log.info("GCS backup to gs://%s/%s enabled", settings.gcs_bucket, settings.gcs_prefix)
    return cls(**kwargs)  # type: ignore[no-any-return]
