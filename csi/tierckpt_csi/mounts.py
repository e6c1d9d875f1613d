"""Mount syscalls (through libc, no mount(8) needed) and /proc/self/mountinfo parsing."""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import errno
import os
from pathlib import Path

__all__ = [
    "MS_BIND",
    "MS_NODEV",
    "MS_NOEXEC",
    "MS_NOSUID",
    "MS_RDONLY",
    "MS_REMOUNT",
    "MountEntry",
    "bind_mount",
    "is_under",
    "mount",
    "mount_at",
    "parse_mountinfo",
    "read_mountinfo",
    "unmount",
]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MNT_DETACH = 0x2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


def _b(text: str | os.PathLike[str] | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def mount(
    source: str | None,
    target: str | os.PathLike[str],
    fstype: str | None,
    flags: int,
    data: str | None = None,
) -> None:
    """mount(2); raises ``OSError`` with errno and the arguments on failure."""
    if _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(
            err,
            f"mount({source!r}, {os.fspath(target)!r}, {fstype!r}, {flags:#x}, {data!r}): {os.strerror(err)}",
        )


def bind_mount(source: str | os.PathLike[str], target: str | os.PathLike[str], *, readonly: bool) -> None:
    """Bind ``source`` onto ``target`` with nosuid,nodev,noexec (and ro if asked); undone on failure."""
    mount(os.fspath(source), target, None, MS_BIND)
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | MS_NOEXEC | (MS_RDONLY if readonly else 0)
    try:
        mount(None, target, None, flags)
    except OSError:
        unmount(target)
        raise


def unmount(target: str | os.PathLike[str]) -> None:
    """umount(2); a busy mount is detached lazily (it goes once its last user does)."""
    if _libc.umount2(_b(target), 0) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EBUSY and _libc.umount2(_b(target), MNT_DETACH) == 0:
        return
    err = ctypes.get_errno() if err == errno.EBUSY else err
    raise OSError(err, f"umount({os.fspath(target)!r}): {os.strerror(err)}")


@dataclasses.dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (see proc(5))."""

    mount_id: int
    parent_id: int
    device: str
    """``major:minor`` of the filesystem: equal for a tmpfs and every bind mount of it."""
    root: str
    """The directory of the filesystem mounted here (``/`` for the whole fs, ``/<job>`` for our binds)."""
    mount_point: str
    options: str
    fstype: str
    source: str
    super_options: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    return field.encode().decode("unicode_escape").encode("latin-1").decode() if "\\" in field else field


def parse_mountinfo(text: str) -> list[MountEntry]:
    entries = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        entries.append(
            MountEntry(
                mount_id=int(fields[0]),
                parent_id=int(fields[1]),
                device=fields[2],
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                options=fields[5],
                fstype=fields[sep + 1],
                source=_unescape(fields[sep + 2]),
                super_options=fields[sep + 3] if len(fields) > sep + 3 else "",
            )
        )
    return entries


def read_mountinfo(path: str = "/proc/self/mountinfo") -> list[MountEntry]:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return parse_mountinfo(f.read())


def mount_at(path: str | os.PathLike[str], entries: list[MountEntry] | None = None) -> MountEntry | None:
    """The topmost mount whose mount point is exactly ``path`` (symlinks resolved), or None."""
    want = os.path.realpath(path)
    found = None
    for entry in read_mountinfo() if entries is None else entries:
        if entry.mount_point == want:
            found = entry  # later lines are mounted on top of earlier ones
    return found


def is_under(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    return Path(path) == Path(root) or Path(root) in Path(path).parents
