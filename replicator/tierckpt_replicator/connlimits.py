"""Open connections, bounded per source address and in total, with room kept for authenticated callers
(the data port and the HTTP servers).

A connection is admitted before anything is read from it, and stays *pending* until it is
authenticated (its TLS handshake done with a certificate of the CA; without TLS, its first request
complete or authorized): whatever a client sends before that is untrusted, and whoever sends it must
not be able to keep anyone else out.

* **Per source**: at most ``per_source`` connections from one address (pending or not, kept well below
  the total); more are refused at once.
* **In total**: at most ``total``. When they are all open, a new connection takes the place of the
  oldest pending connection of the source holding the most pending ones (the newcomer's own source
  included), which is closed. An authenticated connection is never closed for a newcomer; only when
  no connection is pending is a newcomer refused.
* **Under pressure** (over half of the total open), a new connection gets a quarter of the usual
  deadline for its handshake (at least ``_MIN_DEADLINE``): attackers that hold connections by
  trickling are dropped sooner, while a real handshake takes milliseconds.

So however many pods trickle handshakes, and from however many addresses, a caller from another
address gets in at once: its connection displaces one of theirs, and could itself be displaced only
once no source holds more pending connections than its own (every pending connection from a source of
its own). Refusals and sheds are logged at most once every few seconds per server, so a flood cannot
flood the log as well.
"""

from __future__ import annotations

import contextlib
import logging
import math
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Literal

__all__ = ["Admission", "ConnectionLimits", "close_now"]

log = logging.getLogger(__name__)

_WARN_EVERY = 10.0
_PRESSURE = 0.5
"""The share of the total open from which new connections get the short deadline."""
_SHORT_SHARE = 0.25
_MIN_DEADLINE = 1.0

_State = Literal["pending", "authenticated", "shed", "released"]


class _Tally:
    """Events counted, and logged at most once every ``_WARN_EVERY`` seconds (under the caller's lock)."""

    def __init__(self) -> None:
        self.total = self._since = 0
        self._logged = -math.inf

    def add(self) -> int | None:
        """Count one; the count to log now (since the last time), or None."""
        self.total += 1
        self._since += 1
        now = time.monotonic()
        if now - self._logged < _WARN_EVERY:
            return None
        self._logged, since, self._since = now, self._since, 0
        return since


class Admission:
    """One admitted connection: ``authenticated()`` once its client is, ``release()`` when it closes
    (both idempotent). ``deadline``: the seconds its handshake may take (short under pressure)."""

    __slots__ = ("_limits", "_shed", "deadline", "seq", "source", "state")

    def __init__(
        self, limits: ConnectionLimits, source: str, seq: int, deadline: float, shed: Callable[[], None]
    ) -> None:
        self._limits, self.source, self.seq, self.deadline, self._shed = limits, source, seq, deadline, shed
        self.state: _State = "pending"

    def authenticated(self) -> None:
        self._limits._authenticated(self)

    def release(self) -> None:
        self._limits._release(self)

    @property
    def was_shed(self) -> bool:
        """Whether it was closed to make room for a newcomer (its end is then no news worth a log line)."""
        return self.state == "shed"


class ConnectionLimits:
    """``admit(source, shed)`` -> an ``Admission`` for a new connection from ``source``, or None (close it
    at once). ``shed`` closes the connection when a newcomer takes its place; it is called on the
    admitting thread, outside the lock, after the connection was already counted out. Thread-safe (the
    data server's threads and an event loop alike). ``deadline``: the usual handshake deadline."""

    def __init__(self, name: str, *, total: int, per_source: int, deadline: float) -> None:
        if total < 1 or per_source < 1:
            raise ValueError("connection limits must be at least 1")
        self.name, self.total, self.per_source, self.deadline = name, total, per_source, deadline
        self._open: dict[str, int] = {}
        self._pending: dict[str, dict[Admission, None]] = {}
        """Per source, its pending connections, oldest first."""
        self._count = self._seq = 0
        self._lock = threading.Lock()
        self._refused, self._shed = _Tally(), _Tally()

    def admit(self, source: str, shed: Callable[[], None]) -> Admission | None:
        victim = admitted = None
        refused = closed = None
        with self._lock:
            if self._open.get(source, 0) >= self.per_source:
                why = "its source's share is open"
            elif self._count >= self.total and (victim := self._victim()) is None:
                why = "every connection is authenticated"
            else:
                why = ""
                if victim is not None:
                    self._forget(victim)
                    victim.state = "shed"
                    closed = self._shed.add()
                deadline = self.deadline
                if self._count >= self.total * _PRESSURE:
                    deadline = min(deadline, max(_MIN_DEADLINE, deadline * _SHORT_SHARE))
                self._seq += 1
                admitted = Admission(self, source, self._seq, deadline, shed)
                self._open[source] = self._open.get(source, 0) + 1
                self._pending.setdefault(source, {})[admitted] = None
                self._count += 1
            if admitted is None:
                refused = self._refused.add()
            count = self._count
        if victim is not None:
            try:
                victim._shed()
            except Exception:  # counted out anyway; its deadline ends it
                log.exception("%s: could not close a connection from %s", self.name, victim.source)
        if refused is not None:
            log.warning(
                "%s: refused %d connection(s) in the last %.0fs (the last from %s: %s; at most %d per "
                "source, %d in total, %d open)",
                self.name,
                refused,
                _WARN_EVERY,
                source,
                why,
                self.per_source,
                self.total,
                count,
            )
        if closed is not None and victim is not None:
            log.warning(
                "%s: closed %d pending connection(s) in the last %.0fs to make room for newcomers (the "
                "last from %s, the source with the most pending ones; all %d open)",
                self.name,
                closed,
                _WARN_EVERY,
                victim.source,
                count,
            )
        return admitted

    def _victim(self) -> Admission | None:
        """The oldest pending connection of the source with the most pending ones (ties: the oldest)."""
        best: dict[Admission, None] | None = None
        for pending in self._pending.values():
            if best is None or (len(pending), -next(iter(pending)).seq) > (len(best), -next(iter(best)).seq):
                best = pending
        return None if best is None else next(iter(best))

    def _forget(self, admission: Admission) -> None:
        """Count ``admission`` out (under the lock)."""
        source = admission.source
        pending = self._pending.get(source)
        if pending is not None:
            pending.pop(admission, None)
            if not pending:
                del self._pending[source]
        self._open[source] -= 1
        if not self._open[source]:
            del self._open[source]
        self._count -= 1

    def _authenticated(self, admission: Admission) -> None:
        with self._lock:
            if admission.state != "pending":
                return
            admission.state = "authenticated"
            pending = self._pending[admission.source]
            del pending[admission]
            if not pending:
                del self._pending[admission.source]

    def _release(self, admission: Admission) -> None:
        with self._lock:
            if admission.state in ("pending", "authenticated"):
                self._forget(admission)
            if admission.state != "shed":
                admission.state = "released"

    def open_from(self, source: str) -> int:
        with self._lock:
            return self._open.get(source, 0)

    @property
    def open(self) -> int:
        with self._lock:
            return self._count

    @property
    def refused(self) -> int:
        """Connections refused so far."""
        return self._refused.total

    @property
    def shed(self) -> int:
        """Pending connections closed so far to make room."""
        return self._shed.total

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(len(p) for p in self._pending.values())


def close_now(sock: socket.socket) -> None:
    """Close a connection refused at admission at once, with a reset (no TIME_WAIT kept for it, no
    lingering over what the client sent)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
