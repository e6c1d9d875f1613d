"""What the signing endpoint may cost the API server (``tierckpt_operator.issuer``).

Anyone who reaches the endpoint can send a bearer string, and checking one costs a TokenReview (then a
pod read): unbounded, a few pods could turn the endpoint into load on the API server. So:

* ``SourceRate``: requests per source address, a token bucket each (``--issuer-rate`` sustained,
  ``--issuer-burst`` at once); over it, 429 with when to come back. A replicator asks once at start
  and at each renewal, retrying with backoff; a flood from one pod is cut to the rate.
* ``ReviewCache``: a TokenReview's answer is reused for the same token for ``--review-cache-seconds``,
  whatever it was (a replicator's retries, or a pod repeating one string, cost one review). Entries are
  keyed by the token's SHA-256 (the token itself is never kept) and bounded in number.
* ``InFlight``: at most ``--issuer-api-calls`` requests checking with the API server at once; more get
  503 at once (no queue builds up), so many sources together cannot pile up calls either.

Both tables are bounded: a flood from many addresses evicts the oldest entries, it does not grow them.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

__all__ = ["InFlight", "ReviewCache", "SourceRate"]

_MAX_SOURCES = 4096
_MAX_REVIEWS = 4096


class SourceRate:
    """``wait(source)``: 0 and one request counted, or the seconds until ``source`` may ask again."""

    def __init__(
        self,
        rate: float,
        burst: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        size: int = _MAX_SOURCES,
    ) -> None:
        self.rate, self.burst, self.size, self._clock = rate, burst, size, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # source -> (tokens, at)

    def wait(self, source: str) -> float:
        now = self._clock()
        tokens, at = self._buckets.pop(source, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - at) * self.rate)
        if tokens >= 1:
            tokens -= 1
            wait = 0.0
        else:
            wait = (1 - tokens) / self.rate
        self._buckets[source] = (tokens, now)  # the most recent last
        while len(self._buckets) > self.size:  # the source heard from longest ago goes (full by now)
            self._buckets.popitem(last=False)
        return wait


class ReviewCache:
    """``review(token, ask)``: ``ask()``'s answer for ``token`` (a TokenReview's status), reused for
    ``ttl`` seconds. Errors are not kept: the next request asks again."""

    def __init__(
        self, ttl: float, *, clock: Callable[[], float] = time.monotonic, size: int = _MAX_REVIEWS
    ) -> None:
        self.ttl, self.size, self._clock = ttl, size, clock
        self._answers: OrderedDict[bytes, tuple[float, dict[str, Any]]] = OrderedDict()

    async def review(self, token: str, ask: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        key = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        kept = self._answers.get(key)
        if kept is not None and kept[0] > now:
            return kept[1]
        answer = await ask()
        if self.ttl > 0:
            self._answers.pop(key, None)
            self._answers[key] = (self._clock() + self.ttl, answer)
            while len(self._answers) > self.size or next(iter(self._answers.values()))[0] <= now:
                self._answers.popitem(last=False)  # the oldest: expired first, then past the size
        return answer


class InFlight:
    """``with slot() as held``: one of ``limit`` slots held for the block (``held`` False: all were
    taken, none is held)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.taken = limit, 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[bool]:
        if self.taken >= self.limit:
            yield False
            return
        self.taken += 1
        try:
            yield True
        finally:
            self.taken -= 1
