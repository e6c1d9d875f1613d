"""Open connections, bounded per source address and in total (the data port and the HTTP servers).

A connection is admitted before anything is read from it; one that would exceed either bound is
closed at once. Nothing a client sends before it is authenticated can then hold more than its share:
one source (a pod, a node) never uses up every connection, and all of them together never more than
the total. Refusals are logged at most once every few seconds per server, so a flood cannot flood
the log as well.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

__all__ = ["SourceLimits"]

log = logging.getLogger(__name__)

_WARN_EVERY = 10.0


class SourceLimits:
    """``admit(source)`` -> whether a new connection from ``source`` may stay open; ``release(source)``
    when it closes. Thread-safe (the data server's threads and an event loop alike)."""

    def __init__(self, name: str, *, total: int, per_source: int) -> None:
        if total < 1 or per_source < 1:
            raise ValueError("connection limits must be at least 1")
        self.name, self.total, self.per_source = name, total, per_source
        self._open: Counter[str] = Counter()
        self._count = 0
        self._lock = threading.Lock()
        self._refused = 0
        self._warned = 0.0

    def admit(self, source: str) -> bool:
        with self._lock:
            if self._count < self.total and self._open[source] < self.per_source:
                self._open[source] += 1
                self._count += 1
                return True
            self._refused += 1
            now = time.monotonic()
            if now - self._warned < _WARN_EVERY:
                return False
            self._warned, refused, self._refused = now, self._refused, 0
            from_source, count = self._open[source], self._count
        log.warning(
            "%s: refused %d connection(s) in the last %.0fs (now from %s: %d open of %d per source, "
            "%d of %d in total)",
            self.name,
            refused,
            _WARN_EVERY,
            source,
            from_source,
            self.per_source,
            count,
            self.total,
        )
        return False

    def release(self, source: str) -> None:
        with self._lock:
            if self._open[source] <= 0:
                raise AssertionError(f"{self.name}: released a connection from {source} never admitted")
            self._open[source] -= 1
            self._count -= 1
            if not self._open[source]:
                del self._open[source]

    def open_from(self, source: str) -> int:
        with self._lock:
            return self._open[source]

    @property
    def open(self) -> int:
        with self._lock:
            return self._count
