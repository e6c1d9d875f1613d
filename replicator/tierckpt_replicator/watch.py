"""Notice new commits in the ramdisk with almost no overhead: inotify as a wake-up, a rescan as truth.

``CommitWatcher`` watches the root, each job dir, each rank dir and every not-yet-committed step dir
(COMMIT arrives there by rename), and each job's ``requests`` dir (fetch requests of training ranks).
Any event wakes ``wait()``; the caller then rescans the ramdisk, which is the source of truth, and calls
``refresh()`` to watch the directories that appeared. Without inotify (or if it fails) ``wait()`` simply
returns every ``poll_interval`` seconds; it always does anyway, as a safety net. Works on tmpfs.

inotify comes from ``inotify_simple`` (a thin wrapper over the syscalls): its descriptor goes straight
into the event loop (``add_reader``), and each directory gets a narrow mask (entries created, moved in,
deleted, files closed after writing), so the shard bytes a client writes cost no events. A recursive
watcher (``watchfiles``) would also report every write into every shard of the whole tree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from inotify_simple import INotify, flags

from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import read_commit, step_names
from tierckpt_replicator.inventory import list_jobs
from tierckpt_replicator.stepio import open_job, rank_trees
from tierckpt_replicator.waits import done_within

__all__ = ["CommitWatcher"]

log = logging.getLogger(__name__)

_MASK = flags.MOVED_TO | flags.CREATE | flags.DELETE | flags.CLOSE_WRITE | flags.ONLYDIR


class CommitWatcher:
    def __init__(self, root: Path, *, poll_interval: float = 5.0, debounce: float = 0.05) -> None:
        self.root, self.poll_interval, self.debounce = root, poll_interval, debounce
        self._event = asyncio.Event()
        self._inotify: INotify | None = None

    @property
    def uses_inotify(self) -> bool:
        return self._inotify is not None

    def start(self) -> None:
        try:
            self._inotify = INotify(nonblocking=True)
            asyncio.get_running_loop().add_reader(self._inotify.fd, self._on_readable)
        except (OSError, AttributeError) as exc:  # no inotify (or no free instance), or no loop reader
            log.warning("inotify unavailable (%s); polling every %.1fs", exc, self.poll_interval)
            self._inotify = None
        self.refresh()

    def close(self) -> None:
        if self._inotify is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._inotify.fd)
            self._inotify.close()
            self._inotify = None

    def kick(self) -> None:
        """Wake ``wait()`` now (e.g. after a control change)."""
        self._event.set()

    def _on_readable(self) -> None:
        if self._inotify is not None and self._inotify.read(timeout=0):  # drained; the rescan is truth
            self._event.set()

    async def wait(self) -> None:
        """Return after a change (debounced) or after ``poll_interval`` seconds."""
        changed = asyncio.ensure_future(self._event.wait())
        try:
            if await done_within(changed, self.poll_interval):
                await asyncio.sleep(self.debounce)
        finally:
            changed.cancel()
        self._event.clear()

    def refresh(self) -> None:
        """Watch every directory a new commit can appear under (idempotent; cheap)."""
        if self._inotify is None:
            return
        try:
            self._inotify.add_watch(self.root, _MASK)
            for job in list_jobs(self.root):
                self._watch_job(job)
        except OSError as exc:
            log.warning("inotify watch failed (%s); relying on polling", exc)

    def _watch_job(self, job: str) -> None:
        """Watch the job dir, its requests dir, its rank dirs and its uncommitted step dirs, each through
        the descriptor of a confined open (``/proc/self/fd/N`` names exactly the directory opened): a
        directory a pod replaced by a symlink is never watched through the link."""
        assert self._inotify is not None
        try:
            tree = open_job(self.root, job)
        except (FileNotFoundError, NotADirectoryError, FormatError):
            return
        with tree:
            dirs = [tree]
            if tree.is_dir("requests"):
                dirs.append(tree.at("requests"))  # a training rank's fetch request (restore.requests)
            for rank in rank_trees(tree, "primary").values():
                dirs.append(rank)
                for name in step_names(rank).values():
                    with contextlib.suppress(Exception):
                        if read_commit(rank.at(name)) is None:
                            dirs.append(rank.at(name))
            for d in dirs:
                with contextlib.suppress(
                    FileNotFoundError, NotADirectoryError, FormatError
                ):  # gone meanwhile
                    fd = d.open_fd("", os.O_RDONLY | os.O_DIRECTORY)
                    try:
                        self._inotify.add_watch(f"/proc/self/fd/{fd}", _MASK)
                    finally:
                        os.close(fd)
