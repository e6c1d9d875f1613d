"""Leases: a reader's claim on a committed step, so retention never deletes files under it.

The file protocol (docs/format.md, "Leases"): ``<rank dir>/leases/<step:012d>.<holder>.json`` holds a
``format.Lease``. Holders renew by rewriting it with a later ``expires_at`` and release by deleting it;
an expired lease counts for nothing and anyone may delete it.

Acquiring and retiring are serialised by an exclusive ``flock`` on ``<rank dir>/leases/.lock``:
retention removes a step's COMMIT only while holding it and after checking the leases, and
``acquire`` writes the lease and re-checks the COMMIT while holding it. So a reader either gets a
lease on a step that stays, or learns at once that the step is gone; it never sees files vanish.

A rank directory is a ``format.Dir``: the client passes its path, a daemon the ``Beneath`` view of a
rank in a job tree, so no lease file, lock or temporary file is ever reached through a symlink.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Generic, TypeVar

from tierckpt.protocol.errors import FormatError, MissingCheckpointError
from tierckpt.protocol.format import Dir, Lease, as_tree, check_holder, lease_dir, read_commit
from tierckpt.protocol.safefs import Beneath

__all__ = [
    "LOCK_NAME",
    "LeaseHolder",
    "LeaseSet",
    "acquire",
    "active",
    "hold",
    "hold_all",
    "lease_path",
    "leased_steps",
    "lock",
    "purge_expired",
    "release",
    "renew",
]

log = logging.getLogger(__name__)

K = TypeVar("K")

LOCK_NAME = ".lock"
LEASES = "leases"
DEFAULT_TTL = 60.0
_LEASE_LIMIT = 4096
"""The largest lease file read (one is ~150 bytes)."""


def lease_path(rank_path: str | os.PathLike[str], step: int, holder: str) -> Path:
    return lease_dir(rank_path) / _lease_name(step, holder)


def _lease_name(step: int, holder: str) -> str:
    return f"{step:012d}.{check_holder(holder)}.json"


@contextlib.contextmanager
def lock(rank_path: Dir) -> Iterator[None]:
    """Hold the rank directory's lease lock (exclusive ``flock``) for the ``with`` block."""
    with as_tree(rank_path) as rank:
        rank.makedirs(LEASES)
        fd = rank.open_fd(f"{LEASES}/{LOCK_NAME}", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the flock


def _write(rank: Beneath, step: int, holder: str, ttl: float) -> Lease:
    lease = Lease(
        step=step, holder=holder, pid=os.getpid(), host=socket.gethostname(), expires_at=time.time() + ttl
    )
    rank.write_atomic(f"{LEASES}/{_lease_name(step, holder)}", lease.to_bytes())
    return lease


def _step(rank: Beneath, step: int) -> Beneath:
    return rank.at(f"step-{step:012d}")


def acquire(rank_path: Dir, step: int, holder: str, *, ttl: float = DEFAULT_TTL) -> Lease:
    """Lease a committed step for ``ttl`` seconds; ``MissingCheckpointError`` if it is not committed."""
    try:
        with as_tree(rank_path) as rank:
            if not rank.is_dir():
                raise MissingCheckpointError(f"{rank.where} does not exist")
            with lock(rank):
                if read_commit(_step(rank, step)) is None:
                    raise MissingCheckpointError(f"step {step} is not committed in {rank.where}")
                return _write(rank, step, holder, ttl)
    except FileNotFoundError as exc:
        raise MissingCheckpointError(f"{rank_path} does not exist") from exc


def renew(rank_path: Dir, lease: Lease, *, ttl: float = DEFAULT_TTL) -> Lease:
    """Extend a lease. ``MissingCheckpointError`` if the lease lapsed and the step is gone meanwhile."""
    with as_tree(rank_path) as rank, lock(rank):
        if not rank.exists(f"{LEASES}/{_lease_name(lease.step, lease.holder)}") and (
            read_commit(_step(rank, lease.step)) is None
        ):
            raise MissingCheckpointError(f"lease on step {lease.step} lapsed and the step is gone")
        return _write(rank, lease.step, lease.holder, ttl)


def release(rank_path: Dir, lease: Lease) -> None:
    with contextlib.suppress(FileNotFoundError), as_tree(rank_path) as rank:
        rank.unlink(f"{LEASES}/{_lease_name(lease.step, lease.holder)}")


def _read_all(rank: Beneath) -> Iterator[tuple[str, Lease | None]]:
    """``(name, lease)`` of every lease file; None for one that is malformed or misnamed."""
    for name in sorted(rank.listdir(LEASES)):
        if not name.endswith(".json"):
            continue
        where = f"{rank.where}/{LEASES}/{name}"
        try:
            lease = Lease.from_bytes(rank.read_bytes(f"{LEASES}/{name}", limit=_LEASE_LIMIT))
        except FileNotFoundError:
            continue
        except FormatError as exc:
            log.warning("ignoring malformed lease %s: %s", where, exc)
            yield name, None
            continue
        if name != f"{lease.step:012d}.{lease.holder}.json":
            log.warning(
                "ignoring lease %s: its content names step %s holder %s", where, lease.step, lease.holder
            )
            yield name, None
            continue
        yield name, lease


def active(rank_path: Dir, *, now: float | None = None) -> list[Lease]:
    """Unexpired leases of a rank directory."""
    now = time.time() if now is None else now
    try:
        with as_tree(rank_path) as rank:
            return [lease for _, lease in _read_all(rank) if lease is not None and not lease.expired(now)]
    except FileNotFoundError:
        return []


def leased_steps(rank_path: Dir, *, now: float | None = None) -> set[int]:
    return {lease.step for lease in active(rank_path, now=now)}


def purge_expired(rank_path: Dir, *, now: float | None = None) -> int:
    """Delete expired and malformed lease files; returns how many were removed."""
    now = time.time() if now is None else now
    removed = 0
    try:
        with as_tree(rank_path) as rank:
            for name, lease in list(_read_all(rank)):
                if lease is None or lease.expired(now):
                    with contextlib.suppress(FileNotFoundError):
                        rank.unlink(f"{LEASES}/{name}", missing_ok=False)
                        removed += 1
    except FileNotFoundError:
        return removed
    return removed


class LeaseSet(Generic[K]):
    """Leases on one step of several ranks (``rank_paths``: key -> rank directory), kept alive by one
    background thread until ``release()`` (or the end of a ``with`` block). A rank whose step is not
    committed is not leased: its key is in ``missing``. A lease that cannot be renewed is logged and
    no longer renewed (it lapses; the others go on)."""

    def __init__(self, rank_paths: Mapping[K, Dir], step: int, holder: str, *, ttl: float = DEFAULT_TTL):
        self.step, self.ttl = step, ttl
        self.missing: list[K] = []
        self._held: dict[K, tuple[Dir, Lease]] = {}
        try:
            for key, path in rank_paths.items():
                path = path if isinstance(path, Beneath) else Path(path)
                try:
                    self._held[key] = (path, acquire(path, step, holder, ttl=ttl))
                except MissingCheckpointError:
                    self.missing.append(key)
        except BaseException:
            self._release_all()
            raise
        self._lock = threading.Lock()
        self._given_up: set[K] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name=f"tierckpt-lease-{step}", daemon=True)
        self._thread.start()

    def held(self) -> list[K]:
        return list(self._held)

    def lease_of(self, key: K) -> Lease:
        with self._lock:
            return self._held[key][1]

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            with self._lock:
                held = [(k, v) for k, v in self._held.items() if k not in self._given_up]
            for key, (path, lease) in held:
                try:
                    renewed = renew(path, lease, ttl=self.ttl)
                except (OSError, MissingCheckpointError) as exc:
                    log.error("could not renew the lease on step %s in %s: %s", self.step, path, exc)
                    self._given_up.add(key)
                    continue
                with self._lock:
                    self._held[key] = (path, renewed)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._release_all()

    def _release_all(self) -> None:
        for path, lease in self._held.values():
            release(path, lease)

    def __enter__(self) -> LeaseSet[K]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LeaseHolder(LeaseSet[int]):
    """One lease kept alive by a background thread until ``release()`` (or the end of a ``with``
    block). ``MissingCheckpointError`` if the step is not committed."""

    def __init__(self, rank_path: Dir, step: int, holder: str, *, ttl: float = DEFAULT_TTL):
        super().__init__({0: rank_path}, step, holder, ttl=ttl)
        if self.missing:
            self.release()
            raise MissingCheckpointError(f"step {step} of {rank_path} is not committed: it cannot be leased")

    @property
    def lease(self) -> Lease:
        return self.lease_of(0)

    def __enter__(self) -> LeaseHolder:
        return self


def hold_all(rank_paths: Mapping[K, Dir], step: int, holder: str, *, ttl: float = DEFAULT_TTL) -> LeaseSet[K]:
    """``with leases.hold_all({r: rank_dir, ...}, step, "me") as held:`` lease ``step`` of several
    ranks, renewed by one thread until the block ends (``held.missing``: the ranks not committed)."""
    return LeaseSet(rank_paths, step, holder, ttl=ttl)


def hold(rank_path: Dir, step: int, holder: str, *, ttl: float = DEFAULT_TTL) -> LeaseHolder:
    """``with leases.hold(rank_dir, step, "me"):`` lease a step, renewing it until the block ends."""
    return LeaseHolder(rank_path, step, holder, ttl=ttl)
