"""``BackupSettings``: every knob of tier 3 in one frozen dataclass.

    settings = BackupSettings(bucket="my-ckpts", interval_steps=500, keep_last=3, keep_every=10_000)
    service = BackupService.for_bucket(settings, node="node-a", root=Path("/run/tierckpt"))

``BackupService.for_bucket`` is the production path: a ``GcsStore`` (``store()``) from the bucket
fields. Tests (and anything with another store) call
``BackupService(settings, node=..., root=..., store=...)`` directly, with a store against
fake-gcs-server or a fake at the ``ObjectStore`` boundary. The daemon derives its settings from its
flags and each job's policy (``backup.jobs``).

Each field says its unit, default and why; ``docs/bucket-layout.md`` has the same table.
"""

from __future__ import annotations

import dataclasses
from typing import get_args

from tierckpt_replicator.backup.chunkcodec import Compression
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore, RetryPolicy
from tierckpt_replicator.backup.policy import BackupPolicy

__all__ = ["BackupSettings"]

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class BackupSettings:
    """Where backups go, when, what is kept, and how transfers run. Frozen and hashable: the daemon keeps
    one service per distinct settings."""

    # --- the bucket (used by ``store()``; a service handed a store ignores them)
    bucket: str = ""
    """GCS bucket name; empty disables backups."""
    prefix: str = "tierckpt"
    """Key prefix inside the bucket (``BucketLayout``): several clusters or teams can share a bucket."""
    endpoint: str = ""
    """API endpoint override, ``http://host:port`` (an emulator or a proxy); empty: ``$STORAGE_EMULATOR_HOST``
    if set, else the real service."""
    project: str | None = None
    """Billing project of the client; None: from the credentials."""

    # --- schedule and retention (``BackupPolicy``)
    interval_steps: int = 0
    """Steps. Back up a committed step once this many steps passed since the newest complete backup;
    0 [default]: no step schedule."""
    interval_seconds: float = 1800.0
    """Seconds [1800]. Back up a committed step once this long passed since the newest complete backup
    completed; 0: no time schedule (both 0: on demand only)."""
    keep_last: int = 3
    """Steps [3]. Newest complete backups kept (at least 1: the newest is always kept)."""
    keep_every: int = 0
    """Steps [0: off]. Also keep the oldest complete step of every window of this many steps (long-lived
    checkpoints, e.g. every 10 000 steps)."""
    stale_after: float = 3600.0
    """Seconds [3600]. A started backup still incomplete after this long no longer holds new ones back
    (its uploaders are presumed dead), even if it could still complete. One that cannot (no node is
    uploading it and this node holds none of its missing ranks) is given up ``takeover_after`` after
    it began."""

    # --- transfers
    parallelism: int = 8
    """Transfers [8]. Object uploads/downloads in flight per node (one thread pool, shared by every rank and
    file); at least 1. More hides per-request latency; each in-flight upload buffers one ``chunk_size``."""
    chunk_size: int = 64 * MiB
    """Bytes [64 MiB], a multiple of 256 KiB. Bytes per resumable-upload request: an interrupted request
    resends at most this much; memory is ``parallelism x chunk_size`` at most."""
    slice_size: int = 256 * MiB
    """Bytes [256 MiB]. Files larger than this go up as parallel slices (at most 32) composed server side,
    so one big shard uses several connections; 0: never slice."""
    range_size: int = 64 * MiB
    """Bytes [64 MiB]. Restore downloads each file in byte ranges of this size, in parallel, written
    into the ramdisk file at their offsets; 0: one request per file."""
    max_manifest_bytes: int = 64 * MiB
    """Bytes [64 MiB]. Largest manifest read from the ramdisk or the bucket (bounded memory on bad
    input)."""

    # --- what goes to the bucket (docs/bucket-layout.md, "Chunks (layout 3)")
    chunks: bool = True
    """[True] Upload data files as content-addressed chunks (bucket layout 3): chunks the bucket holds
    from the rank's previous complete step are not sent again. False: whole objects (layout 2), for a
    job whose nodes include one that reads no layout 3 (``--no-backup-chunks``; docs/bucket-layout.md,
    "Layout versions")."""
    compression: Compression = "off"
    """[off] How chunks are stored: ``off`` (raw), ``zstd`` (zstd level 1) or ``grouped`` (bytes
    grouped by element size, then zstd). Off by default: on the 2-vCPU nodes measured, no codec
    outruns the upload link (docs/benchmarks.md, "Bucket codecs")."""

    # --- coordination between the nodes of a job
    takeover_after: float = 120.0
    """Seconds [120]. After a step's backup began, a holder also uploads ranks assigned to another node
    that are still missing (that node may be gone, or hold no copy)."""
    group_wait: float = 60.0
    """Seconds [60]. How long a replica group member's upload waits for its group's data rank to be
    committed in the bucket before it uploads its own data files instead of referring to those."""
    incomplete_grace: float = 3600.0
    """Seconds [3600]. An incomplete step older than the newest complete one is deleted once untouched
    this long (an abandoned attempt; a slow uploader gets this long to finish)."""
    catalog_max_age: float = 600.0
    """Seconds [600]. A node reuses its view of the job's catalog (complete and started steps) while
    ``catalog.json`` keeps its generation, one request a look; at least this often it reads the whole
    catalog again (a change whose announcement was lost, or written by an older version)."""
    peers_hold_copies: bool = True
    """Whether a node's peers in ``peers.json`` hold copies of its ranks (replicas) that they can upload;
    False for an erasure-coded job, whose peers hold fragments: each rank is uploaded by its primary."""
    lease_ttl: float = 60.0
    """Seconds [60]. Lifetime of the leases (renewed in the background) that keep the client's retention
    off a step being uploaded; a dead uploader's lease lapses after this long."""
    writer_ttl: float = 30.0
    """Seconds [30]. Lifetime of the bucket leases a node holds while it writes a step's objects
    (``writers/``, renewed every fifth of it): a purge of the job waits for live writers, and takes a
    writer that has not renewed its lease for this long for gone. Its writes stop once it cannot renew
    within half of it."""

    # --- transient errors (``RetryPolicy``) and HTTP timeouts
    retry_initial: float = 1.0
    """Seconds [1]. First backoff after a transient GCS error (5xx, 408, 429, timeout, reset)."""
    retry_max: float = 32.0
    """Seconds [32]. Longest backoff between attempts (the backoff doubles up to this)."""
    retry_deadline: float = 300.0
    """Seconds [300]. Give up retrying a request this long after its first attempt
    (``TransientStoreError``)."""
    connect_timeout: float = 10.0
    """Seconds [10]. Per HTTP request: establishing the connection."""
    read_timeout: float = 120.0
    """Seconds [120]. Per HTTP request: silence while waiting for the server's bytes."""

    def __post_init__(self) -> None:
        if self.parallelism < 1:
            raise ValueError("parallelism must be at least 1")
        for name in (
            "slice_size",
            "range_size",
            "takeover_after",
            "incomplete_grace",
            "group_wait",
            "catalog_max_age",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative")
        if self.compression not in get_args(Compression):
            raise ValueError(f"compression must be one of {', '.join(get_args(Compression))}")
        if self.lease_ttl <= 0 or self.writer_ttl <= 0 or self.max_manifest_bytes <= 0:
            raise ValueError("lease_ttl, writer_ttl and max_manifest_bytes must be positive")
        self.policy()  # the schedule and retention fields are valid

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
            takeover_after=self.takeover_after,
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
