"""Per-job policies: ``policy.json`` in each job's state directory (``format.state_dir``, out of every
pod's reach; ``tierckpt.protocol.control.JobPolicy``), newest generation wins.

The operator sends one with ``PUT /v1/jobs/{job}/policy`` whenever a job's CheckpointConfiguration
is first resolved or edited. The file is the only state: every reader (the API, the backup router)
reads it through a ``PolicyStore`` that caches it by modification time.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from tierckpt.protocol.control import JobPolicy, read_control, write_control
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import state_dir

__all__ = ["PolicyStore"]

log = logging.getLogger(__name__)


class PolicyStore:
    """Reads and writes each job's ``policy.json``; ``put`` refuses generations not newer than stored."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[int, JobPolicy]] = {}

    def get(self, job: str) -> JobPolicy | None:
        """The job's policy, or None without one (an unreadable file is logged and counts as none)."""
        path = state_dir(self.root, job) / JobPolicy.FILE
        try:
            stamp = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            self._cache.pop(job, None)
            return None
        cached = self._cache.get(job)
        if cached and cached[0] == stamp:
            return cached[1]
        try:
            got = read_control(self.root, job, JobPolicy.FILE, JobPolicy)
        except (FormatError, OSError) as exc:
            log.error("job %s: unreadable %s, using the node's own backup settings: %s", job, path, exc)
            return None
        if not isinstance(got, JobPolicy):
            return None
        self._cache[job] = (stamp, got)
        return got

    def put(self, policy: JobPolicy) -> tuple[bool, JobPolicy]:
        """Store ``policy`` (atomically) if its generation is newer, or accept it unchanged if it is the
        stored one; returns (accepted, the policy in force)."""
        with self._lock:
            current = self.get(policy.job)
            if current == policy:
                return True, current  # the same policy again (a retried PUT): nothing to write
            if current is not None and current.generation >= policy.generation:
                return False, current
            write_control(self.root, policy.job, JobPolicy.FILE, policy)
            self._cache.pop(policy.job, None)
        log.info(
            "job %s: policy generation %d stored (gs://%s/%s, every %d steps / %g min, keep %d + every %d)",
            policy.job,
            policy.generation,
            policy.bucket or "<node bucket>",
            policy.prefix,
            policy.backup_interval_steps,
            policy.backup_interval_minutes,
            policy.keep_last,
            policy.keep_every,
        )
        return True, policy

    def replication_factor(self, job: str, default: int) -> int:
        """Peers each node copies the job's ranks to: its policy's factor, else ``default`` (the node's
        ``--replicas``)."""
        policy = self.get(job)
        return policy.replication_factor if policy is not None else default

    def erasure(self, job: str) -> tuple[int, int] | None:
        """The job's erasure code ``(k, m)`` when its policy asks for one instead of replicas."""
        policy = self.get(job)
        return policy.erasure if policy is not None else None

    def forget(self, job: str) -> None:
        self._cache.pop(job, None)
