"""The worker's side of a purge: ``JobFences``, the jobs being purged on this node and the work of each
under way in the worker process (a connection served by the data endpoint, a fetch or rebuild task).

A purge fences the job here before it deletes anything (``ipc.FenceJob``, sent by the daemon's
replication manager): from then on no connection or task of the job starts, those under way are
aborted (a connection is shut down: its receive aborts, nothing of it is committed) and waited for,
so nothing re-creates the job's directory once the purge deletes it. Found by the chaos soak: the data
server checked a sender's membership when a transfer started, and a replica still arriving committed
after the purge. The fence is lifted once the job is gone (its assignment with it, so its senders are
no longer members).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator

from tierckpt.protocol.errors import TierckptError

__all__ = ["JobFences", "JobPurging"]

log = logging.getLogger(__name__)


class JobPurging(TierckptError):
    """The job is being purged on this node: nothing of it starts."""


def _wait_only() -> None:
    pass


class JobFences:
    """``working(job, abort)`` around any work on a job's files; ``fence(job)`` / ``lift(job)`` by the
    purge. Thread-safe (the data server's connection threads, the task pool, the daemon's channel)."""

    def __init__(self, fenced: tuple[str, ...] = ()) -> None:
        self._cond = threading.Condition()
        self._fenced: set[str] = set(fenced)
        self._working: dict[str, dict[int, Callable[[], None]]] = {}
        self._ids = itertools.count()

    def fenced(self, job: str) -> bool:
        with self._cond:
            return job in self._fenced

    @contextlib.contextmanager
    def working(self, job: str, abort: Callable[[], None] = _wait_only) -> Iterator[None]:
        """Work on ``job`` for the block; ``JobPurging`` (before the block) while it is fenced. A fence
        set meanwhile calls ``abort`` (from another thread: it must make the block end soon, e.g. by
        shutting its connection down) and waits for the block to end."""
        with self._cond:
            if job in self._fenced:
                raise JobPurging(f"job {job} is being purged on this node")
            key = next(self._ids)
            self._working.setdefault(job, {})[key] = abort
        try:
            yield
        finally:
            with self._cond:
                working = self._working.get(job, {})
                working.pop(key, None)
                if not working:
                    self._working.pop(job, None)
                self._cond.notify_all()

    def fence(self, job: str, timeout: float | None = None) -> bool:
        """No work on ``job`` starts from now on; the work under way is aborted and waited for (at most
        ``timeout``). True once none is left."""
        with self._cond:
            self._fenced.add(job)
            aborts = list(self._working.get(job, {}).values())
        if aborts:
            log.info("job %s: being purged; aborting %d transfer(s) of it under way", job, len(aborts))
        for abort in aborts:
            with contextlib.suppress(OSError):
                abort()
        with self._cond:
            return self._cond.wait_for(lambda: job not in self._working, timeout)

    def lift(self, job: str) -> None:
        """The job was purged: its work may start again (a sender must be a member of it anew)."""
        with self._cond:
            self._fenced.discard(job)
