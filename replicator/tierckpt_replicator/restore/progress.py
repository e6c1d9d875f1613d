"""Restore progress for the client: ``control/restore-rank-NNNNN.json`` (a ``control.RestoreStatus``).

``ProgressReporter`` rewrites the file when the state changes, at most every ``min_interval`` seconds
while bytes move, and every ``heartbeat`` seconds regardless (``updated_at`` keeps moving while a
source is retried), so the client waits on progress, not on a fixed timeout. The file is in the job
directory (the client reads it), so it is written through the job's confined tree: exclusive temporary
file, no symlink followed (``control.write_restore_status``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from tierckpt.protocol.control import RestoreState, RestoreStatus, Tier, write_restore_status
from tierckpt.protocol.errors import FormatError
from tierckpt_replicator.stepio import open_job

__all__ = ["ProgressReporter"]

log = logging.getLogger(__name__)


class ProgressReporter:
    def __init__(
        self,
        root: Path,
        job: str,
        rank: int,
        *,
        heartbeat: float = 1.0,
        min_interval: float = 0.25,
    ) -> None:
        self.root, self.job, self.rank = root, job, rank
        self.heartbeat, self.min_interval = heartbeat, min_interval
        self.status = RestoreStatus(
            job=job,
            rank=rank,
            state=RestoreState.PENDING,
            step=None,
            source=None,
            bytes_done=0,
            bytes_total=0,
            updated_at=time.time(),
        )
        self._written = 0.0
        self._beat: asyncio.Task[None] | None = None

    def update(self, *, force: bool = False, **changes: Any) -> None:
        """Change fields of the status (``RestoreStatus`` field names); write it if due."""
        state_changed = "state" in changes and changes["state"] != self.status.state
        self.status = dataclasses.replace(self.status, **changes, updated_at=time.time())
        if force or state_changed or time.monotonic() - self._written >= self.min_interval:
            self._write()

    def progress(self, done: int, total: int) -> None:
        self.update(bytes_done=done, bytes_total=total)

    def finish(self, state: RestoreState, *, source: Tier | None = None, message: str = "") -> None:
        self.update(force=True, state=state, source=source, message=message)

    def _write(self) -> None:
        try:
            with open_job(self.root, self.job, create=True) as tree:
                write_restore_status(tree, self.status)
            self._written = time.monotonic()
        except (OSError, FormatError) as exc:  # a full ramdisk (or a planted link) must not stop staging
            log.warning("cannot write restore status of %s rank %d: %s", self.job, self.rank, exc)

    def start(self) -> None:
        """Write the status every ``heartbeat`` seconds from now on (until ``stop``)."""
        if self._beat is None:
            self._beat = asyncio.create_task(self._heartbeat())

    async def stop(self) -> None:
        beat, self._beat = self._beat, None
        if beat is not None:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat

    async def __aenter__(self) -> ProgressReporter:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            self.update(force=True)
