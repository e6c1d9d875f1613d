"""Prometheus metrics of the backup service (``tierckpt_backup_*``).

``BackupMetrics(registry)`` registers them on ``registry`` (a fresh ``CollectorRegistry`` in tests);
``BackupMetrics.default()`` is the process-wide instance on prometheus-client's default registry, which
the replicator's ``/metrics`` endpoint serves.
"""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["BackupMetrics"]

_SECONDS_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


class BackupMetrics:
    _default: BackupMetrics | None = None
    _lock = threading.Lock()

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.bytes_uploaded = Counter(
            "tierckpt_backup_uploaded_bytes",
            "Shard bytes uploaded to the bucket by this node.",
            registry=registry,
        )
        self.bytes_downloaded = Counter(
            "tierckpt_backup_downloaded_bytes",
            "Shard bytes restored from the bucket by this node.",
            registry=registry,
        )
        self.upload_seconds = Histogram(
            "tierckpt_backup_upload_seconds",
            "Time to upload this node's share of one step.",
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.restore_seconds = Histogram(
            "tierckpt_backup_restore_seconds",
            "Time to restore one rank of one step from the bucket.",
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.failures = Counter(
            "tierckpt_backup_failures", "Failed backup operations, by operation.", ["op"], registry=registry
        )
        self.ranks_uploaded = Counter(
            "tierckpt_backup_ranks_uploaded",
            "Rank steps this node uploaded and committed.",
            registry=registry,
        )
        self.steps_completed = Counter(
            "tierckpt_backup_steps_completed",
            "Steps this node marked complete in the bucket.",
            registry=registry,
        )
        self.steps_deleted = Counter(
            "tierckpt_backup_steps_deleted",
            "Steps deleted from the bucket by retention or purge.",
            registry=registry,
        )
        self.chunk_bytes_reused = Counter(
            "tierckpt_backup_chunk_reused_bytes",
            "Raw bytes of chunks not uploaded because the bucket held them from the previous step.",
            registry=registry,
        )
        self.chunks_deleted = Counter(
            "tierckpt_backup_chunks_deleted",
            "Chunks deleted by this node's sweeps (no step in the bucket referred to them).",
            registry=registry,
        )
        self.last_step = Gauge(
            "tierckpt_backup_last_complete_step",
            "Newest complete step in the bucket.",
            ["job"],
            registry=registry,
        )
        self.last_success = Gauge(
            "tierckpt_backup_last_success_timestamp_seconds",
            "When this node last finished uploading its share of a step, per job.",
            ["job"],
            registry=registry,
        )

    @classmethod
    def default(cls) -> BackupMetrics:
        with cls._lock:
            if cls._default is None:
                cls._default = cls()
            return cls._default
