"""Leases: a reader's claim on a committed step, so retention never deletes files under it.

The file protocol (docs/format.md, "Leases"): ``<rank dir>/leases/<step:012d>.<holder>.json`` holds a
``format.Lease``. Holders renew by rewriting it with a later ``expires_at`` and release by deleting it;
an expired lease counts for nothing and anyone may delete it.

Acquiring and retiring are serialised by an exclusive ``flock`` on ``<rank dir>/leases/.lock``:
retention removes a step's COMMIT only while holding it and after checking the leases, and
``acquire`` writes the lease and re-checks the COMMIT while holding it. So a reader either gets a
lease on a step that stays, or learns at once that the step is gone; it never sees files vanish.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tierckpt.protocol.errors import FormatError, MissingCheckpointError
from tierckpt.protocol.format import Lease, check_holder, lease_dir, read_commit, step_dir, write_atomic

__all__ = [
    "LOCK_NAME",
    "LeaseHolder",
    "acquire",
    "active",
    "hold",
    "lease_path",
    "leased_steps",
    "lock",
    "purge_expired",
    "release",
    "renew",
]

log = logging.getLogger(__name__)

LOCK_NAME = ".lock"
DEFAULT_TTL = 60.0


def lease_path(rank_path: str | os.PathLike[str], step: int, holder: str) -> Path:
    return lease_dir(rank_path) / f"{step:012d}.{check_holder(holder)}.json"


@contextlib.contextmanager
def lock(rank_path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold the rank directory's lease lock (exclusive ``flock``) for the ``with`` block."""
    d = lease_dir(rank_path)
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def _write(rank_path: str | os.PathLike[str], step: int, holder: str, ttl: float) -> Lease:
    lease = Lease(
        step=step, holder=holder, pid=os.getpid(), host=socket.gethostname(), expires_at=time.time() + ttl
    )
    write_atomic(lease_path(rank_path, step, holder), lease.to_bytes())
    return lease


def acquire(rank_path: str | os.PathLike[str], step: int, holder: str, *, ttl: float = DEFAULT_TTL) -> Lease:
    """Lease a committed step for ``ttl`` seconds; ``MissingCheckpointError`` if it is not committed."""
    if not Path(rank_path).is_dir():
        raise MissingCheckpointError(f"{rank_path} does not exist")
    with lock(rank_path):
        if read_commit(step_dir(rank_path, step)) is None:
            raise MissingCheckpointError(f"step {step} is not committed in {rank_path}")
        return _write(rank_path, step, holder, ttl)


def renew(rank_path: str | os.PathLike[str], lease: Lease, *, ttl: float = DEFAULT_TTL) -> Lease:
    """Extend a lease. ``MissingCheckpointError`` if the lease lapsed and the step is gone meanwhile."""
    with lock(rank_path):
        if not lease_path(rank_path, lease.step, lease.holder).exists() and (
            read_commit(step_dir(rank_path, lease.step)) is None
        ):
            raise MissingCheckpointError(f"lease on step {lease.step} lapsed and the step is gone")
        return _write(rank_path, lease.step, lease.holder, ttl)


def release(rank_path: str | os.PathLike[str], lease: Lease) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lease_path(rank_path, lease.step, lease.holder))


def _read_all(rank_path: str | os.PathLike[str]) -> Iterator[tuple[Path, Lease | None]]:
    d = lease_dir(rank_path)
    try:
        names = sorted(os.listdir(d))
    except FileNotFoundError:
        return
    for name in names:
        if not name.endswith(".json"):
            continue
        path = d / name
        try:
            lease = Lease.from_bytes(path.read_bytes())
        except FileNotFoundError:
            continue
        except FormatError as exc:
            log.warning("ignoring malformed lease %s: %s", path, exc)
            yield path, None
            continue
        if name != f"{lease.step:012d}.{lease.holder}.json":
            log.warning(
                "ignoring lease %s: its content names step %s holder %s", path, lease.step, lease.holder
            )
            yield path, None
            continue
        yield path, lease


def active(rank_path: str | os.PathLike[str], *, now: float | None = None) -> list[Lease]:
    """Unexpired leases of a rank directory."""
    now = time.time() if now is None else now
    return [lease for _, lease in _read_all(rank_path) if lease is not None and not lease.expired(now)]


def leased_steps(rank_path: str | os.PathLike[str], *, now: float | None = None) -> set[int]:
    return {lease.step for lease in active(rank_path, now=now)}


def purge_expired(rank_path: str | os.PathLike[str], *, now: float | None = None) -> int:
    """Delete expired and malformed lease files; returns how many were removed."""
    now = time.time() if now is None else now
    removed = 0
    for path, lease in _read_all(rank_path):
        if lease is None or lease.expired(now):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
    return removed


class LeaseHolder:
    """A lease kept alive by a background thread until ``release()`` (or the end of a ``with`` block)."""

    def __init__(
        self, rank_path: str | os.PathLike[str], step: int, holder: str, *, ttl: float = DEFAULT_TTL
    ):
        self.rank_path = Path(rank_path)
        self.ttl = ttl
        self.lease = acquire(rank_path, step, holder, ttl=ttl)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"tierckpt-lease-{step}", daemon=True)
        self._thread.start()

    @property
    def step(self) -> int:
        return self.lease.step

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.lease = renew(self.rank_path, self.lease, ttl=self.ttl)
            except (OSError, MissingCheckpointError) as exc:
                log.error("could not renew the lease on step %s in %s: %s", self.step, self.rank_path, exc)
                return

    def release(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        release(self.rank_path, self.lease)

    def __enter__(self) -> LeaseHolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold(
    rank_path: str | os.PathLike[str], step: int, holder: str, *, ttl: float = DEFAULT_TTL
) -> LeaseHolder:
    """``with leases.hold(rank_dir, step, "me"):`` lease a step, renewing it until the block ends."""
    return LeaseHolder(rank_path, step, holder, ttl=ttl)
