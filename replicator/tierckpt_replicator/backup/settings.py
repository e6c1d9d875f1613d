"""``BackupSettings``: every knob of tier 3 in one frozen dataclass the daemon's settings can compose.

    settings = BackupSettings(bucket="my-ckpts", interval_steps=500, keep_last=3, keep_every=10_000)
    service = settings.build(node="node-a", root=Path("/run/tierckpt"))

Fields (defaults in brackets):

* ``bucket``: GCS bucket; empty disables backups. ``prefix`` [``tierckpt``]: key prefix inside it.
* ``endpoint``: API endpoint override (an emulator, ``http://host:port``) [``$STORAGE_EMULATOR_HOST``
  or the real service]. ``project``: billing project [from credentials].
* ``interval_steps`` [0] / ``interval_seconds`` [1800]: back up a step once this many steps / seconds
  have passed since the newest complete backup (0 disables that schedule; both 0: on demand only).
* ``keep_last`` [3]: newest complete steps kept. ``keep_every`` [0]: also keep the oldest complete step
  of every window of this many steps.
* ``parallelism`` [8]: object transfers in flight per node. ``chunk_size`` [64 MiB]: bytes per
  resumable-upload request. ``slice_size`` [256 MiB]: larger files are uploaded as parallel slices and
  composed (0: never). ``range_size`` [64 MiB]: restore downloads byte ranges of this size in parallel.
* ``takeover_after`` [120 s]: then a holder uploads missing ranks assigned to another node.
  ``stale_after`` [3600 s]: a started backup that is still incomplete no longer holds new ones back.
  ``incomplete_grace`` [3600 s]: abandoned incomplete steps are deleted once untouched this long.
* ``retry_initial`` [1 s], ``retry_max`` [32 s], ``retry_deadline`` [300 s]: exponential backoff of
  transient GCS errors (5xx, 429, timeouts, resets). ``connect_timeout`` [10 s], ``read_timeout``
  [120 s]: per HTTP request.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore, RetryPolicy
from tierckpt_replicator.backup.metrics import BackupMetrics
from tierckpt_replicator.backup.policy import BackupPolicy

__all__ = ["BackupSettings"]

if TYPE_CHECKING:
    from tierckpt_replicator.backup.service import BackupService

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BackupSettings:
    bucket: str = ""
    prefix: str = "tierckpt"
    endpoint: str = ""
    project: str | None = None
    interval_steps: int = 0
    interval_seconds: float = 1800.0
    keep_last: int = 3
    keep_every: int = 0
    parallelism: int = 8
    chunk_size: int = 64 * MiB
    slice_size: int = 256 * MiB
    range_size: int = 64 * MiB
    takeover_after: float = 120.0
    stale_after: float = 3600.0
    incomplete_grace: float = 3600.0
    retry_initial: float = 1.0
    retry_max: float = 32.0
    retry_deadline: float = 300.0
    connect_timeout: float = 10.0
    read_timeout: float = 120.0

    @property
    def enabled(self) -> bool:
        return bool(self.bucket)

    def policy(self) -> BackupPolicy:
        return BackupPolicy(
            interval_steps=self.interval_steps,
            interval_seconds=self.interval_seconds,
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            stale_after=self.stale_after,
        )

    def gcs(self) -> GcsSettings:
        return GcsSettings(
            bucket=self.bucket,
            endpoint=self.endpoint,
            project=self.project,
            chunk_size=self.chunk_size,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            pool_size=max(16, 2 * self.parallelism),
            retry=RetryPolicy(self.retry_initial, self.retry_max, deadline=self.retry_deadline),
        )

    def store(self) -> GcsStore:
        if not self.enabled:
            raise ValueError("backups are disabled: no bucket configured")
        return GcsStore(self.gcs())

    def build(self, *, node: str, root: Path, metrics: BackupMetrics | None = None) -> BackupService:
        """The service for this node (raises ``ValueError`` if no bucket is configured)."""
        from tierckpt_replicator.backup.service import BackupService

        return BackupService(settings=self, node=node, root=root, metrics=metrics)

    @classmethod
    def from_object(cls, obj: Any) -> BackupSettings:
        """Settings from any object with ``gcs_<field>`` or ``backup_<field>`` attributes (the daemon's
        ``Settings``: ``gcs_bucket``, ``gcs_prefix``, ``gcs_endpoint``, ...); its ``backup_interval``
        means ``interval_seconds``. A ``BackupSettings`` is returned as is."""
        if isinstance(obj, cls):
            return obj
        values: dict[str, Any] = {}
        if getattr(obj, "backup_interval", None) is not None:
            values["interval_seconds"] = float(obj.backup_interval)
        for f in dataclasses.fields(cls):
            for attr in (f"gcs_{f.name}", f"backup_{f.name}"):
                if getattr(obj, attr, None) is not None:
                    values[f.name] = getattr(obj, attr)
        return cls(**values)
