"""The commit feed: what this node's ramdisk holds of each job, scanned once per pass of the daemon's
loop and handed to every subscriber.

``CommitFeed.run_pass`` scans each job's holdings (``inventory.InventoryScanner``, the source of
truth; ``watch.CommitWatcher`` only says when to look) and gives them to its subscribers in order. Two
subscribe: replication (``ReplicationManager.on_holdings``: the sends of each rank's newest step) and
backup (``NewSteps``: once per newest step every local rank committed, in the background, since an
upload may take minutes). Neither knows of the other; the daemon subscribes both.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from tierckpt_replicator.inventory import Holdings, InventoryScanner, list_jobs

__all__ = ["CommitFeed", "NewSteps", "StepCommitted", "Subscriber"]

log = logging.getLogger(__name__)

Subscriber = Callable[[str, Holdings], Awaitable[None]]
"""``await subscriber(job, holdings)``: one job's holdings as this pass scanned them."""


@dataclasses.dataclass(frozen=True)
class StepCommitted:
    """Every local rank of ``job`` has committed ``step`` (its newest such step); ``ranks``: those."""

    job: str
    step: int
    ranks: tuple[int, ...]


class CommitFeed:
    """Scans every job under the scanner's root once per ``run_pass`` for all its subscribers."""

    def __init__(self, scanner: InventoryScanner) -> None:
        self.scanner = scanner
        self._subscribers: list[tuple[str, Subscriber]] = []

    def subscribe(self, name: str, subscriber: Subscriber) -> None:
        """``name``: who it is, in the log when it fails."""
        self._subscribers.append((name, subscriber))

    async def run_pass(self) -> None:
        """One scan of every job, handed to each subscriber (one's failure stops neither the others nor
        the other jobs: it is logged)."""
        for job in list_jobs(self.scanner.root):
            holdings = self.scanner.holdings(job)
            for name, subscriber in self._subscribers:
                try:
                    await subscriber(job, holdings)
                except Exception:
                    log.exception("job %s: %s failed on the pass's holdings", job, name)


class NewSteps:
    """A subscriber that calls ``on_step`` once per job's newest step committed by every local rank,
    in the background (``close`` cancels those still running); ``forget(job)`` after a purge, so the
    job's steps count as new again."""

    def __init__(self, on_step: Callable[[StepCommitted], Awaitable[None]]) -> None:
        self.on_step = on_step
        self._told: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, job: str, holdings: Holdings) -> None:
        step = holdings.newest_common()  # of the ranks it runs now (not those of a world it left)
        if step is None or self._told.get(job, -1) >= step:
            return
        self._told[job] = step
        ranks = tuple(sorted(r for r, h in holdings.ranks.items() if step in h.local))
        task = asyncio.create_task(self._tell(StepCommitted(job, step, ranks)), name=f"committed-{job}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tell(self, committed: StepCommitted) -> None:
        try:
            await self.on_step(committed)
        except Exception:
            log.exception("job %s: handling committed step %d failed", committed.job, committed.step)

    def forget(self, job: str) -> None:
        self._told.pop(job, None)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
