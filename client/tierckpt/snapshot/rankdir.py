"""One rank directory as its single writer sees it: step states, the writer lock, crash cleanup, retention.

The writer (a ``Checkpointer``) holds ``<rank dir>/.writer.lock`` for its lifetime, which is what
makes it safe to delete uncommitted step directories: no one else is writing them. The file names the
holder (``format.WriterLock``: pid, host, command line), so that a writer kept waiting can say who. Retention
decisions are pure (``tierckpt.planning.retention``); this module does the I/O, removing COMMIT markers
under the lease lock (``tierckpt.protocol.leases``) and recycling the retired steps' data files through the
slot pool. Besides leased steps, retention keeps the step the replicator stages for the job's restore
(``planning.retention.staged_step`` of the rank's restore status): it may be older than steps the rank holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tierckpt.planning.retention import plan_retention, staged_step
from tierckpt.protocol import leases
from tierckpt.protocol.control import RestoreStatus
from tierckpt.protocol.errors import FormatError, TierckptError
from tierckpt.protocol.format import (
    COMMIT_NAME,
    WRITER_LOCK,
    WRITER_LOCK_LIMIT,
    CommitMarker,
    WriterLock,
    discard_step,
    fsync_dir,
    read_commit,
    step_dir,
    step_dirs,
)
from tierckpt.protocol.text import duration
from tierckpt.snapshot.pool import SlotPool

__all__ = [
    "WRITER_LOCK",
    "StepScan",
    "apply_retention",
    "clean_up_after_crash",
    "lock_writer",
    "make_room",
    "scan_steps",
    "uncommit",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StepScan:
    """The step directories of a rank, by state."""

    committed: dict[int, CommitMarker]
    corrupt: tuple[int, ...]
    """Steps whose COMMIT exists but does not verify."""
    uncommitted: tuple[int, ...]

    @property
    def newest_commit_at(self) -> float | None:
        """When the newest commit happened (by its marker's clock), or None when nothing is committed."""
        return max((m.committed_at for m in self.committed.values()), default=None)


def scan_steps(rank_path: Path) -> StepScan:
    committed, corrupt, uncommitted = {}, [], []
    for step, path in step_dirs(rank_path).items():
        try:
            marker = read_commit(path)
        except FormatError as exc:
            log.error("step %d in %s has a corrupt commit marker: %s", step, rank_path, exc)
            corrupt.append(step)
            continue
        if marker is None:
            uncommitted.append(step)
        elif marker.step != step:
            log.error("%s holds the commit marker of step %d; ignoring it", path, marker.step)
            corrupt.append(step)
        else:
            committed[step] = marker
    return StepScan(committed, tuple(sorted(corrupt)), tuple(sorted(uncommitted)))


def lock_writer(rank_path: Path, timeout: float) -> int:
    """Take ``<rank dir>/.writer.lock`` exclusively, waiting up to ``timeout`` for a previous writer, and
    write this process into it (``format.WriterLock``). A holder that stays past ``timeout`` is named in
    the ``TierckptError`` raised.

    Returns the file descriptor; closing it releases the lock (so does the process dying).
    """
    fd = os.open(rank_path / WRITER_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = _describe_holder(fd)
                os.close(fd)
                raise TierckptError(
                    f"another process still writes {rank_path}: {holder} holds {WRITER_LOCK} (waited "
                    f"{timeout:.0f} s; one Checkpointer per rank). A training process left behind by an "
                    "earlier launch (kill -9 on torchrun leaves its workers running: each has a session of "
                    "its own) must be ended first; the pid is in that host's pid namespace (on Kubernetes, "
                    "the pod's)"
                ) from None
            time.sleep(0.1)
    record = _this_writer().to_bytes()
    os.pwrite(fd, record, 0)  # then cut: a reader never sees an empty file between two holders
    os.ftruncate(fd, len(record))
    return fd


def _this_writer() -> WriterLock:
    """This process as a lock holder, its command line cut to fit ``WRITER_LOCK_LIMIT``."""
    try:
        cmdline = Path("/proc/self/cmdline").read_bytes()
        raw = [a.decode(errors="replace") for a in cmdline.split(b"\0") if a]
    except OSError:
        raw = list(sys.orig_argv)
    command: list[str] = []
    room = WRITER_LOCK_LIMIT // 2  # what the pid, host and time leave, with room for JSON escapes
    for arg in raw:
        arg = arg[:512]
        room -= len(arg) + 3
        if room < 0:
            command.append("...")
            break
        command.append(arg)
    return WriterLock(
        pid=os.getpid(), host=socket.gethostname()[:255], command=tuple(command), since=time.time()
    )


def _describe_holder(fd: int) -> str:
    """The lock holder recorded in the lock file, for an error message (it may be any content)."""
    try:
        body = os.pread(fd, WRITER_LOCK_LIMIT, 0)
    except OSError:
        body = b""
    if body.strip().isdigit():  # written by a client before the record had a format
        return f"pid {int(body)}"
    try:
        holder = WriterLock.from_bytes(body)
    except FormatError:
        return "a process that left no record"
    age = duration(time.time() - holder.since)
    return f"pid {holder.pid} on host {holder.host} ({shlex.join(holder.command)}; since {age} ago)"


def uncommit(rank_path: Path, steps: Sequence[int]) -> None:
    """Remove the COMMIT of each step (caller holds the lease lock): they stop existing at once."""
    for step in steps:
        path = step_dir(rank_path, step)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path / COMMIT_NAME)
            fsync_dir(path)


def _held(rank_path: Path, scan: StepScan, restore: RestoreStatus | None) -> set[int]:
    """Steps retention must keep past ``keep`` (caller holds the lease lock): the leased ones, and the
    one the replicator stages for the job's restore until the rank saved after it."""
    held = leases.leased_steps(rank_path)
    staged = staged_step(restore, scan.newest_commit_at)
    if staged is not None:
        held.add(staged)
    return held


def clean_up_after_crash(
    rank_path: Path, keep: int, pool: SlotPool, restore: RestoreStatus | None = None
) -> None:
    """At writer start: remove uncommitted steps, apply retention, adopt spare data files. ``restore``:
    the rank's restore status (its staged step stays, older than the rank's newest or not)."""
    leases.purge_expired(rank_path)
    with leases.lock(rank_path):
        scan = scan_steps(rank_path)
        plan = plan_retention(
            scan.committed, keep=keep, leased=_held(rank_path, scan, restore), uncommitted=scan.uncommitted
        )
        uncommit(rank_path, plan.retire)
    for step in plan.discard:
        log.warning("removing step %d of %s: never committed (left by a crashed save)", step, rank_path)
        discard_step(step_dir(rank_path, step))
    pool.adopt_spares(committed_count=len(plan.kept) + len(plan.held), committed=(*plan.kept, *plan.held))
    for step in plan.retire:
        pool.recycle(step, step_dir(rank_path, step))


def apply_retention(
    rank_path: Path, keep: int, pool: SlotPool, committed: int, restore: RestoreStatus | None = None
) -> None:
    """After ``committed`` was committed: retire what the policy lets go (recycling its files), the
    steps above it included (saved before training went back to an older step), and drop older corrupt
    steps. ``restore``: the rank's restore status (its staged step stays while the status is newer)."""
    with leases.lock(rank_path):
        scan = scan_steps(rank_path)
        plan = plan_retention(
            scan.committed, keep=keep, leased=_held(rank_path, scan, restore), latest=committed
        )
        uncommit(rank_path, plan.retire)
    superseded = [s for s in plan.retire if s > committed]
    if superseded:
        log.info(
            "retiring steps %s of %s: saved before training went back to an older step (%d was just saved)",
            superseded,
            rank_path,
            committed,
        )
    newest = max(scan.committed, default=-1)
    for step in plan.retire:
        log.debug("retiring step %d", step)
        pool.recycle(step, step_dir(rank_path, step))
    for step in scan.corrupt:
        if step < newest:
            log.warning("removing step %d: its commit marker is corrupt", step)
            discard_step(step_dir(rank_path, step))
    pool.trim()


def make_room(rank_path: Path, step: int, pool: SlotPool) -> str | None:
    """Before saving ``step`` again: retire the existing one. Returns why not, if a reader leases it."""
    path = step_dir(rank_path, step)
    if not path.exists():
        return None
    with leases.lock(rank_path):
        if step in leases.leased_steps(rank_path):
            return f"step {step} already exists and is leased by a reader"
        was_committed = (path / COMMIT_NAME).exists()
        uncommit(rank_path, [step])
    if was_committed:
        log.info("replacing committed step %d", step)
        pool.recycle(step, path)
    else:
        discard_step(path)
    return None
