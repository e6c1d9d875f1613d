"""Real tmpfs ramdisks for the local cluster, the tests and the benchmarks (root only).

``mount_tmpfs`` mounts a tmpfs of a given size at a directory; ``unmount`` detaches it, lazily if it is
busy. ``tmpfs`` is both in one context manager. A full tmpfs fails writes with ENOSPC at exactly its
size, which is what the "ramdisk full" paths are tested against.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["can_mount", "mount_tmpfs", "tmpfs", "unmount"]


def can_mount() -> bool:
    """Whether this process may mount filesystems (root)."""
    return os.geteuid() == 0


def mount_tmpfs(path: str | os.PathLike[str], size: str, *, name: str = "", mode: str = "0755") -> Path:
    """Mount a tmpfs of ``size`` (``mount -o size=``: ``64m``, ``1g``) at ``path``, creating it."""
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    source = name or f"tierckpt-{uuid.uuid4().hex[:8]}"
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode={mode}", source, str(target)],
        check=True,
        capture_output=True,
        text=True,
    )
    return target


def unmount(path: str | os.PathLike[str]) -> None:
    """Unmount ``path``; a busy mount is detached lazily (it goes once its last user closes it)."""
    if subprocess.run(["umount", str(path)], check=False, capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@contextlib.contextmanager
def tmpfs(path: str | os.PathLike[str], size: str, *, name: str = "", mode: str = "0755") -> Iterator[Path]:
    """A tmpfs mounted at ``path`` for the duration of the block."""
    target = mount_tmpfs(path, size, name=name, mode=mode)
    try:
        yield target
    finally:
        unmount(target)
