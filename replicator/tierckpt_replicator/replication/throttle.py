"""A thread-safe token bucket that caps the bytes per second of every outgoing transfer together."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["TokenBucket"]


class TokenBucket:
    """``take(n)`` blocks until ``n`` bytes may be sent. A rate of 0 means unlimited.

    The bucket holds at most ``burst`` bytes (default: a quarter second of the rate, at least 1 MiB),
    so an idle period never turns into a long burst over the cap.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        burst: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate = float(rate_bytes_per_s)
        self.burst = float(burst if burst is not None else max(self.rate / 4, 1 << 20))
        self._clock, self._sleep = clock, sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    @property
    def unlimited(self) -> bool:
        return self.rate <= 0

    def take(self, n: int) -> None:
        if self.unlimited or n <= 0:
            return
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n  # may go negative: the debt is slept off below, outside the lock
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
