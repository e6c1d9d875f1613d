"""Waiting at most so long for a future, without losing a cancellation of the waiter.

``asyncio.wait_for`` before Python 3.12 (the daemon's image runs 3.11) loses the cancellation of the
task that waits when the awaited future completes in the same turn of the loop: it returns the result
and the task goes on as if never cancelled (CPython gh-86296). A loop waiting on a wake-up that comes
often (``watch.CommitWatcher``) then survives the daemon's shutdown, which waits for it forever.
``done_within`` waits through ``asyncio.wait``, which raises the waiter's cancellation whatever the
future did meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["done_within"]


async def done_within(future: asyncio.Future[Any], timeout: float) -> bool:
    """Whether ``future`` is done within ``timeout`` seconds (it is neither cancelled nor awaited: the
    caller reads or cancels it). A cancellation of the caller always propagates."""
    done, _ = await asyncio.wait({future}, timeout=timeout)
    return bool(done)
