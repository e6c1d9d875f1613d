"""Time bounds on a data connection: one deadline for the handshake, a minimum rate for a transfer.

A timeout per ``recv`` bounds nothing: a peer that sends one byte every few seconds never trips it.
So the handshake (the TLS handshake, then the request frame) runs under ONE monotonic ``Deadline``,
and a transfer must move at least ``RateFloor.min_rate`` bytes per second over every window of
``window`` seconds (the socket's own timeout is the window, so a peer that sends nothing at all is
caught by it). Both raise ``TimeoutError`` (an ``OSError``: the connection is closed, nothing is
committed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["Deadline", "RateFloor", "Timed"]


class Timed(Protocol):
    """Anything with a socket's timeout: a socket, a TLS socket, a ``channel.SealedChannel``."""

    def settimeout(self, value: float | None, /) -> None: ...


class Deadline:
    """A monotonic point in time; ``arm(sock)`` gives a blocking call on ``sock`` only what is left."""

    def __init__(self, seconds: float, what: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds, self.what, self._clock = seconds, what, clock
        self.at = clock() + seconds

    def left(self) -> float:
        return self.at - self._clock()

    def arm(self, sock: Timed) -> None:
        left = self.left()
        if left <= 0:
            raise TimeoutError(f"{self.what} not done within {self.seconds:g}s")
        sock.settimeout(left)


class RateFloor:
    """Call with each received byte count; raises ``TimeoutError`` once a window of ``window``
    seconds ends with fewer than ``min_rate * window`` bytes in it. ``min_rate`` 0: no floor."""

    def __init__(
        self, min_rate: float, window: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.min_rate, self.window, self._clock = min_rate, window, clock
        self._start = clock()
        self._bytes = 0

    def __call__(self, n: int) -> None:
        self._bytes += n
        now = self._clock()
        if now - self._start < self.window:
            return
        rate = self._bytes / (now - self._start)
        if rate < self.min_rate:
            raise TimeoutError(
                f"peer sent {self._bytes} bytes in {now - self._start:.1f}s "
                f"({rate:.0f} B/s, below the floor of {self.min_rate:.0f} B/s)"
            )
        self._start, self._bytes = now, 0
