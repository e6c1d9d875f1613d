"""The node ramdisk: one tmpfs on a host path, mounted once and reused across driver restarts.

The tmpfs lives in the host's mount namespace (the DaemonSet mounts the host directory with Bidirectional
propagation), not in the driver pod, so restarting or upgrading the driver keeps every job's data. On
start the driver looks the path up in /proc/self/mountinfo: a tmpfs already there is adopted (and resized
to the configured size when that differs and the kernel allows it); otherwise a new one is mounted.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from pathlib import Path

from tierckpt.protocol.quantity import format_bytes
from tierckpt_csi.mounts import (
    MS_NODEV,
    MS_NOEXEC,
    MS_NOSUID,
    MS_REMOUNT,
    mount,
    mount_at,
)

__all__ = ["RAMDISK_SOURCE", "Ramdisk", "RamdiskUsage", "ensure_ramdisk", "tree_bytes"]

log = logging.getLogger(__name__)

RAMDISK_SOURCE = "tierckpt-ramdisk"
"""The tmpfs's source name, as shown by mount(8) and mountinfo."""
_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass(frozen=True)
class RamdiskUsage:
    size: int
    used: int

    @property
    def free(self) -> int:
        return max(self.size - self.used, 0)


@dataclasses.dataclass(frozen=True)
class Ramdisk:
    """The mounted node ramdisk: its path and the ``major:minor`` that its bind mounts share."""

    path: Path
    device: str
    adopted: bool
    """True when an existing tmpfs was reused (a driver restart), False when this process mounted it."""

    def usage(self) -> RamdiskUsage:
        st = os.statvfs(self.path)
        return RamdiskUsage(size=st.f_blocks * st.f_frsize, used=(st.f_blocks - st.f_bfree) * st.f_frsize)

    def job_path(self, job: str) -> Path:
        return self.path / job

    def is_mounted(self) -> bool:
        entry = mount_at(self.path)
        return entry is not None and entry.device == self.device


def _options(size: int, huge: str) -> str:
    return f"size={size},mode=0755" + (f",huge={huge}" if huge and huge != "never" else "")


def _mount_new(path: Path, size: int, huge: str) -> None:
    try:
        mount(RAMDISK_SOURCE, path, "tmpfs", _FLAGS, _options(size, huge))
    except OSError as exc:
        if exc.errno != errno.EINVAL or huge in ("", "never"):
            raise
        log.warning("tmpfs rejected huge=%s (%s); mounting without huge pages", huge, exc.strerror)
        mount(RAMDISK_SOURCE, path, "tmpfs", _FLAGS, _options(size, "never"))


def _resize(path: Path, size: int) -> None:
    current = os.statvfs(path)
    if current.f_blocks * current.f_frsize == size:
        return
    try:
        mount(None, path, None, MS_REMOUNT | _FLAGS, f"size={size}")
        log.info("resized the ramdisk at %s to %s", path, format_bytes(size))
    except OSError as exc:
        old = current.f_blocks * current.f_frsize
        log.warning(
            "kept the ramdisk at %s at %s: resizing to %s failed (%s; the kernel refuses to shrink "
            "a tmpfs below the bytes in use)",
            path,
            format_bytes(old),
            format_bytes(size),
            exc.strerror,
        )


def ensure_ramdisk(path: str | os.PathLike[str], size: int, *, huge: str = "within_size") -> Ramdisk:
    """Mount a ``size``-byte tmpfs at ``path`` unless one is already there; return it.

    Raises ``RuntimeError`` if something other than a tmpfs is mounted at ``path``.
    """
    if size <= 0:
        raise ValueError(f"ramdisk size must be positive, got {size}")
    size = -(-size // _PAGE) * _PAGE  # the kernel rounds a tmpfs size up to whole pages
    target = Path(os.path.realpath(path))
    target.mkdir(parents=True, exist_ok=True)
    entry = mount_at(target)
    adopted = entry is not None
    if entry is None:
        _mount_new(target, size, huge)
        log.info("mounted a %s tmpfs ramdisk at %s", format_bytes(size), target)
        entry = mount_at(target)
        assert entry is not None, f"{target} not in mountinfo right after mounting it"
    elif entry.fstype != "tmpfs":
        raise RuntimeError(
            f"{target} already has a {entry.fstype} mount ({entry.source}); refusing to "
            "stack a ramdisk on it: unmount it or choose another ramdisk path"
        )
    else:
        log.info("reusing the tmpfs ramdisk already mounted at %s (driver restart: its data is kept)", target)
        _resize(target, size)
    return Ramdisk(path=target, device=entry.device, adopted=adopted)


def tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of memory the files under ``path`` occupy (allocated blocks, so sparse holes count as 0)."""
    total = 0
    stack = [os.fspath(path)]
    while stack:
        try:
            it = os.scandir(stack.pop())
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            continue
        with it:
            for e in it:
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    else:
                        total += e.stat(follow_symlinks=False).st_blocks * 512
                except FileNotFoundError:
                    continue
    return total
