"""Orbax-mode jobs' state: ``orbax-session.json`` and ``orbax-run.json`` in each job's state directory
(``format.state_dir``, out of every pod's reach; ``tierckpt.protocol.orbax``).

The session is what the operator sent (``PUT /v1/jobs/{job}/orbax-session``: this node's process id and
the JAX coordinator for a restart attempt; newest generation wins); a job with one is in Orbax mode on
this node. The run is the replicator's record of the handshake with Orbax: which attempt's
``replicator.yaml`` it consumed, the backup interval the job asked for there (which the backup router
applies over the job's policy, ``schedule``), and the step it handed over for restore. Files are the
only state; reads are cached by modification time, as ``policies.PolicyStore`` does.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import TypeVar

from tierckpt.protocol.codec import Message
from tierckpt.protocol.control import read_control, write_control
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import STATE_DIR_NAME, check_job_id, state_dir
from tierckpt.protocol.orbax import OrbaxRun, OrbaxSession

__all__ = ["OrbaxStore"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class OrbaxStore:
    """Reads and writes each Orbax-mode job's session and run (thread-safe: the handshake runs in threads)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock = threading.Lock()
        self._cache: dict[tuple[str, str], tuple[int, Message]] = {}

    def _get(self, job: str, cls: type[M], name: str) -> M | None:
        path = state_dir(self.root, job) / name
        try:
            stamp = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            self._cache.pop((job, name), None)
            return None
        cached = self._cache.get((job, name))
        if cached is not None and cached[0] == stamp and isinstance(cached[1], cls):
            return cached[1]
        try:
            got = read_control(self.root, job, name, cls)
        except (FormatError, OSError) as exc:
            log.error("job %s: unreadable %s, ignored: %s", job, path, exc)
            return None
        if not isinstance(got, cls):
            return None
        self._cache[(job, name)] = (stamp, got)
        return got

    def session(self, job: str) -> OrbaxSession | None:
        """The job's session on this node; None: the job is not in Orbax mode here."""
        return self._get(job, OrbaxSession, OrbaxSession.FILE)

    def put_session(self, session: OrbaxSession) -> tuple[bool, OrbaxSession]:
        """Store ``session`` if its generation is newer, or accept it unchanged if it is the stored one;
        returns (accepted, the session in force)."""
        with self._lock:
            current = self.session(session.job)
            if current == session:
                return True, current
            if current is not None and current.generation >= session.generation:
                return False, current
            write_control(self.root, session.job, OrbaxSession.FILE, session)
            self._cache.pop((session.job, OrbaxSession.FILE), None)
        return True, session

    def run(self, job: str) -> OrbaxRun:
        """The job's handshake record (a fresh one before the first handshake)."""
        return self._get(job, OrbaxRun, OrbaxRun.FILE) or OrbaxRun(job=job)

    def put_run(self, run: OrbaxRun) -> None:
        with self._lock:
            write_control(self.root, run.job, OrbaxRun.FILE, run)
            self._cache.pop((run.job, OrbaxRun.FILE), None)

    def schedule(self, job: str) -> tuple[int, float] | None:
        """``(interval_steps, interval_seconds)`` the job's Orbax asked for (None: the policy's stands)."""
        if self.session(job) is None:
            return None
        return self.run(job).schedule

    def jobs(self) -> list[str]:
        """The jobs with a session on this node."""
        out = []
        try:
            names = os.listdir(self.root / STATE_DIR_NAME / "jobs")
        except (FileNotFoundError, NotADirectoryError):
            return []
        for name in sorted(names):
            try:
                check_job_id(name)
            except FormatError:
                continue
            if (state_dir(self.root, name) / OrbaxSession.FILE).is_file():
                out.append(name)
        return out

    def forget(self, job: str) -> None:
        for key in [k for k in self._cache if k[0] == job]:
            self._cache.pop(key, None)
