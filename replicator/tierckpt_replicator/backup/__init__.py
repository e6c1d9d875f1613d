"""Tier 3: backups of committed steps to GCS, and restores from it (spec: docs/bucket-layout.md).

* ``jobs``: what the daemon talks to. ``BackupPort`` (its one door to tier 3) and ``JobBackups``, which
  routes each job to the ``BackupService`` of its effective settings (node flags + the job's policy).
* ``service.BackupService``: one bucket's backups on this node (on_step_committed, backup_now, poll,
  complete_steps, fetch_rank, fence, unfence, delete_backups).
* ``settings.BackupSettings``: every knob; ``BackupService.for_bucket(settings, node=, root=)`` makes
  the service on its bucket.
* ``policy``: when a backup is due, which steps retention keeps (pure).
* ``spread``: which holder uploads which rank (pure).
* ``store``: the ``ObjectStore`` boundary; ``gcs``: its google-cloud-storage implementation (the only
  module importing google.cloud).
* ``catalog`` (completion protocol, deletion), ``uploader``, ``restorer``: the blocking work.
* ``fence``: purging a job while nodes may still write it (the local fence, the bucket's purge fence,
  the writers' leases).
* ``metrics``: Prometheus metrics.

This package module imports nothing, so importing ``backup.jobs`` does not load google-cloud-storage:
import each name from its module.
"""
