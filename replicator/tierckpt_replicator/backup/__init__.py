"""Tier 3: backups of committed steps to GCS, and restores from it (spec: docs/bucket-layout.md).

* ``service.BackupService``: what the daemon calls (on_step_committed, backup_now, poll,
  complete_steps, fetch_rank, purge_job).
* ``settings.BackupSettings``: every knob; ``BackupSettings.build(node=, root=)`` makes the service.
* ``policy``: when a backup is due, which steps retention keeps (pure).
* ``spread``: which holder uploads which rank (pure).
* ``store``: the ``ObjectStore`` boundary; ``gcs``: its google-cloud-storage implementation (the only
  module importing google.cloud).
* ``catalog`` (completion protocol, deletion), ``uploader``, ``restorer``: the blocking work.
* ``metrics``: Prometheus metrics.
"""

from tierckpt_replicator.backup.policy import BackupPolicy
from tierckpt_replicator.backup.service import BackupService, BackupStatus
from tierckpt_replicator.backup.settings import BackupSettings
from tierckpt_replicator.backup.store import ObjectStore

__all__ = ["BackupPolicy", "BackupService", "BackupSettings", "BackupStatus", "ObjectStore"]
