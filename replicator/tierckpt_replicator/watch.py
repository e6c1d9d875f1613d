"""Notice new commits in the ramdisk with almost no overhead: inotify as a wake-up, a rescan as truth.

``CommitWatcher`` watches the root, each job dir, each rank dir and every not-yet-committed step dir
(COMMIT arrives there by rename). Any event wakes ``wait()``; the caller then rescans the ramdisk, which
is the source of truth, and calls ``refresh()`` to watch the directories that appeared. Without inotify
(or if it fails) ``wait()`` simply returns every ``poll_interval`` seconds; it always does anyway, as a
safety net. Works on tmpfs.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import logging
import os
import struct
from pathlib import Path

from tierckpt.protocol.format import job_dir, rank_dir, ranks_in, read_commit, step_dirs
from tierckpt_replicator.inventory import list_jobs

__all__ = ["CommitWatcher"]

log = logging.getLogger(__name__)

IN_MODIFY, IN_CLOSE_WRITE, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x2, 0x8, 0x80, 0x100, 0x200
IN_ONLYDIR, IN_NONBLOCK, IN_CLOEXEC = 0x01000000, 0o4000, 0o2000000
_MASK = IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_CLOSE_WRITE | IN_ONLYDIR
_EVENT = struct.Struct("iIII")


class _Inotify:
    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        self.fd = fd

    def add(self, path: Path) -> None:
        if self._add(self.fd, os.fsencode(path), _MASK) < 0:
            err = ctypes.get_errno()
            if err not in (2, 20):  # ENOENT, ENOTDIR: it went away meanwhile
                raise OSError(err, f"inotify_add_watch({path}) failed")

    def drain(self) -> int:
        """Read and discard pending events; returns how many bytes were read."""
        total = 0
        with contextlib.suppress(BlockingIOError):
            while chunk := os.read(self.fd, 64 * 1024):
                total += len(chunk)
        return total

    def close(self) -> None:
        os.close(self.fd)


class CommitWatcher:
    def __init__(self, root: Path, *, poll_interval: float = 5.0, debounce: float = 0.05) -> None:
        self.root, self.poll_interval, self.debounce = root, poll_interval, debounce
        self._event = asyncio.Event()
        self._inotify: _Inotify | None = None

    @property
    def uses_inotify(self) -> bool:
        return self._inotify is not None

    def start(self) -> None:
        try:
            self._inotify = _Inotify()
            asyncio.get_running_loop().add_reader(self._inotify.fd, self._on_readable)
        except (OSError, AttributeError) as exc:
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
        if self._inotify is not None and self._inotify.drain():
            self._event.set()

    async def wait(self) -> None:
        """Return after a change (debounced) or after ``poll_interval`` seconds."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._event.wait(), self.poll_interval)
            await asyncio.sleep(self.debounce)
        self._event.clear()

    def refresh(self) -> None:
        """Watch every directory a new commit can appear under (idempotent; cheap)."""
        if self._inotify is None:
            return
        try:
            for path in self._watch_list():
                self._inotify.add(path)
        except OSError as exc:
            log.warning("inotify watch failed (%s); relying on polling", exc)

    def _watch_list(self) -> list[Path]:
        paths = [self.root]
        for job in list_jobs(self.root):
            base = job_dir(self.root, job)
            paths.append(base)
            for rank in ranks_in(base):
                rd = rank_dir(self.root, job, rank)
                paths.append(rd)
                for path in step_dirs(rd).values():
                    with contextlib.suppress(Exception):
                        if read_commit(path) is None:
                            paths.append(path)
        return [p for p in paths if p.is_dir()]
