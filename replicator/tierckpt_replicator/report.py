"""``GET /v1/status``: what this node holds and how replication, backup and restore are doing."""

from __future__ import annotations

import dataclasses

from tierckpt._codec import Message

__all__ = ["JobStatus", "NodeStatus"]


@dataclasses.dataclass(frozen=True)
class JobStatus:
    job: str
    generation: int
    """Generation of the peer assignment in force (-1: none)."""
    node_rank: int | None
    local: dict[int, tuple[int, ...]]
    """Rank -> committed primary steps on this node."""
    replicas: dict[int, tuple[int, ...]]
    """Rank -> committed replica steps held for other nodes."""
    replicated_to: dict[int, tuple[str, ...]]
    """Rank -> peers known to hold its newest local step."""
    backed_up: tuple[int, ...]
    local_bytes: int
    replica_bytes: int
    lag_seconds: float
    """Age of the oldest newest-local step still short of its K replicas (0: all replicated)."""
    last_replication_at: float
    restore_step: int | None
    restore: dict[int, str]
    """Rank -> restore state of the last staging run on this node."""
    backup_error: str = ""
    """The backup service's last error for this job ('' if the last attempt succeeded)."""


@dataclasses.dataclass(frozen=True)
class NodeStatus(Message):
    KIND = "tierckpt.replicator-status"
    VERSION = 1

    node: str
    domain: str
    endpoint: str
    software_version: str
    started_at: float
    healthy: bool
    problems: tuple[str, ...]
    worker_up: bool
    worker_restarts: int
    replicas_k: int
    ramdisk_free_bytes: int
    ramdisk_total_bytes: int
    jobs: tuple[JobStatus, ...]
