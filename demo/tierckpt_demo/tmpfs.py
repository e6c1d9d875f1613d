"""Real tmpfs ramdisks for the local cluster, the tests and the benchmarks (root only).

``mount_tmpfs`` mounts a tmpfs of a given size at a directory; ``unmount`` detaches it, lazily if it is
busy. ``tmpfs`` is both in one context manager. A full tmpfs fails writes with ENOSPC at exactly its
size, which is what the "ramdisk full" paths are tested against.

Mounts use transparent huge pages (``huge=within_size``, as the chart's ramdisk does): pre-faulting and
pinning a data file then cost several times less (docs/benchmarks.md, "Huge pages"). A kernel without
shmem huge pages refuses the option; the mount is then made without it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["DEFAULT_HUGE", "can_mount", "mount_tmpfs", "tmpfs", "unmount"]

DEFAULT_HUGE = "within_size"
"""tmpfs ``huge=`` option of the rig's ramdisks (``never``, ``always``, ``within_size``, ``advise``)."""


def can_mount() -> bool:
    """Whether this process may mount filesystems (root)."""
    return os.geteuid() == 0


def mount_tmpfs(
    path: str | os.PathLike[str],
    size: str,
    *,
    name: str = "",
    mode: str = "0755",
    huge: str | None = DEFAULT_HUGE,
) -> Path:
    """Mount a tmpfs of ``size`` (``mount -o size=``: ``64m``, ``1g``) at ``path``, creating it, with
    ``huge=`` pages (None: the kernel's default; refused by the kernel: mounted without)."""
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    source = name or f"tierckpt-{uuid.uuid4().hex[:8]}"
    options = f"size={size},mode={mode}"
    for extra in ([f",huge={huge}"] if huge else []) + [""]:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options + extra, source, str(target)],
            check=False,
            capture_output=True,
            text=True,
        )
        if done.returncode == 0:
            return target
    raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)


def unmount(path: str | os.PathLike[str]) -> None:
    """Unmount ``path``; a busy mount is detached lazily (it goes once its last user closes it)."""
    if subprocess.run(["umount", str(path)], check=False, capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@contextlib.contextmanager
def tmpfs(
    path: str | os.PathLike[str],
    size: str,
    *,
    name: str = "",
    mode: str = "0755",
    huge: str | None = DEFAULT_HUGE,
) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` for the duration of the block."""
    target = mount_tmpfs(path, size, name=name, mode=mode, huge=huge)
    try:
        yield target
    finally:
        unmount(target)
