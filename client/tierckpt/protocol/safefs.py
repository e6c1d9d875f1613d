"""File access confined beneath one directory, that no path inside it can redirect.

A training pod can write anything into its job's directory, symlinks included. A daemon (running as
root) that follows such a link would read, write or delete another job's files. ``Beneath`` opens
every path relative to a directory descriptor with ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)``:
a symlink anywhere on the path, an absolute path or a ``..`` that climbs out fails with
``UnsafePathError``, atomically (no check-then-use race). Kernels before 5.6 lack ``openat2``; there
each component is opened with ``O_NOFOLLOW`` relative to the previous one, which is just as strict.

Everything a daemon does inside a job tree goes through one ``Beneath`` of that job's directory:
reading and writing small files, listing, creating, renaming and removing.
"""

from __future__ import annotations

import _ctypes
import contextlib
import ctypes
import errno
import functools
import os
import shutil
import stat
import sys
from collections.abc import Iterator

from tierckpt.protocol.errors import FormatError, UnsafePathError

__all__ = ["Beneath", "UnsafePathError"]

_SYS_OPENAT2 = 437  # the same number on every architecture with the generic syscall table (x86-64, arm64)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_TMP_SUFFIX = ".tmp"


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


@functools.cache
def _syscall() -> _ctypes.CFuncPtr | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


@functools.cache
def _has_openat2() -> bool:
    fn = _syscall()
    if fn is None:
        return False
    how = _OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, _RESOLVE_BENEATH)
    fd = fn(_SYS_OPENAT2, ctypes.c_int(-100), b"/", ctypes.byref(how), ctypes.sizeof(how))
    if fd >= 0:
        os.close(fd)
        return True
    return ctypes.get_errno() != errno.ENOSYS


def _parts(rel: str | os.PathLike[str]) -> list[str]:
    text = os.fspath(rel)
    if text.startswith("/"):
        raise UnsafePathError(f"{text!r} is absolute; paths here are relative to their tree")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise UnsafePathError(f"{text!r} climbs out of its tree")
    return parts


def _openat(dirfd: int, rel: str, flags: int, mode: int) -> int:
    """``openat`` of ``rel`` beneath ``dirfd``, following no symlink (``UnsafePathError`` if one is met)."""
    flags |= os.O_CLOEXEC
    parts = _parts(rel)
    if not parts:
        return os.open(".", flags, mode, dir_fd=dirfd)
    if _has_openat2():
        fn = _syscall()
        assert fn is not None
        how = _OpenHow(flags, mode if flags & os.O_CREAT else 0, _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS)
        path = "/".join(parts).encode()
        fd = fn(_SYS_OPENAT2, ctypes.c_int(dirfd), path, ctypes.byref(how), ctypes.sizeof(how))
        if fd < 0:
            err = ctypes.get_errno()
            if err in (errno.ELOOP, errno.EXDEV):
                raise UnsafePathError(f"{rel!r} passes through a symlink or leaves its tree")
            raise OSError(err, os.strerror(err), rel)
        return int(fd)
    fd = os.dup(dirfd)
    try:
        for part in parts[:-1]:
            nxt = _open_component(fd, part, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, rel)
            os.close(fd)
            fd = nxt
        return _open_component(fd, parts[-1], flags, mode, rel)
    finally:
        os.close(fd)


def _open_component(dirfd: int, name: str, flags: int, mode: int, rel: str) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW, mode, dir_fd=dirfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and _is_link(dirfd, name)):
            raise UnsafePathError(f"{rel!r} passes through a symlink") from exc
        raise


def _is_link(dirfd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _rmtree_at(dirfd: int, name: str) -> None:
    """Remove directory ``name`` of ``dirfd`` and its contents; links inside are unlinked, never followed."""
    if sys.version_info >= (3, 11):
        shutil.rmtree(name, dir_fd=dirfd)  # an fd-based walk, safe against links (3.11 has dir_fd)
        return
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
    try:
        for entry in os.listdir(fd):
            st = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _rmtree_at(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dirfd)


class Beneath:
    """A directory, and every path beneath it, reachable without following a symlink.

    Open with ``Beneath.open(trusted_root, "job")``: ``trusted_root`` is the caller's own directory
    (followed as given); ``"job"`` and every later path are resolved strictly beneath it. ``at(rel)``
    is a view of a directory beneath, sharing this one's descriptor (no file is opened for it): every
    path given to the view is resolved beneath the tree's own directory, ``rel`` included.
    """

    def __init__(self, fd: int, where: str, *, prefix: str = "", owner: bool = True) -> None:
        self._fd = fd
        self._prefix = prefix
        self._owner = owner
        self.where = where
        """A readable name of the directory, for messages."""

    @classmethod
    def open(cls, root: str | os.PathLike[str], rel: str = "", *, create: bool = False) -> Beneath:
        """``root/rel`` as a confined directory (``create``: make the missing directories of ``rel``)."""
        rootfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            top = cls(rootfd, os.fspath(root), owner=False)
            return top.sub(rel, create=create) if rel else cls(os.dup(rootfd), top.where)
        finally:
            os.close(rootfd)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close the directory (a view closes nothing: its tree owns the descriptor)."""
        if self._owner and self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"Beneath({self.where!r})"

    def fileno(self) -> int:
        return self._fd

    def _rel(self, rel: str | os.PathLike[str]) -> str:
        """``rel`` as a path relative to the descriptor (refusing absolute and climbing paths)."""
        parts = _parts(rel)
        return "/".join([self._prefix, *parts] if self._prefix else parts)

    def _name(self, rel: str) -> str:
        return f"{self.where}/{rel}" if rel else self.where

    # ------------------------------------------------------------------ directories

    def at(self, rel: str) -> Beneath:
        """A view of directory ``rel`` beneath this one (valid while this tree is open). Nothing is
        opened or checked now: each use of the view resolves its path, confined, as every call does."""
        return Beneath(self._fd, self._name(rel), prefix=self._rel(rel), owner=False)

    def sub(self, rel: str, *, create: bool = False) -> Beneath:
        """The directory ``rel`` beneath this one, with a descriptor of its own, itself confined."""
        if create:
            self.makedirs(rel)
        fd = _openat(self._fd, self._rel(rel), os.O_RDONLY | os.O_DIRECTORY, 0)
        return Beneath(fd, self._name(rel))

    def makedirs(self, rel: str = "", mode: int = 0o755) -> None:
        """Create ``rel`` and its missing parents, refusing to pass through a symlink."""
        parts = _parts(self._rel(rel))
        for i in range(1, len(parts) + 1):
            head = "/".join(parts[:i])
            try:
                os.close(_openat(self._fd, head, os.O_RDONLY | os.O_DIRECTORY, 0))
                continue
            except FileNotFoundError:
                pass
            parent = "/".join(parts[: i - 1])
            pfd = _openat(self._fd, parent, os.O_RDONLY | os.O_DIRECTORY, 0)
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(parts[i - 1], mode, dir_fd=pfd)
            finally:
                os.close(pfd)
            os.close(_openat(self._fd, head, os.O_RDONLY | os.O_DIRECTORY, 0))  # not a link planted meanwhile

    def mkdir(self, rel: str, mode: int = 0o755) -> None:
        """Create directory ``rel`` (its parent must exist); ``FileExistsError`` if anything is there."""
        pfd, name = self._parent(rel)
        try:
            os.mkdir(name, mode, dir_fd=pfd)
        finally:
            os.close(pfd)

    def listdir(self, rel: str = "") -> list[str]:
        """Names in directory ``rel`` ([] if it does not exist)."""
        try:
            fd = _openat(self._fd, self._rel(rel), os.O_RDONLY | os.O_DIRECTORY, 0)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def entries(self, rel: str = "") -> Iterator[tuple[str, os.stat_result]]:
        """``(name, lstat)`` of every entry of directory ``rel``; symlinks show as symlinks."""
        try:
            fd = _openat(self._fd, self._rel(rel), os.O_RDONLY | os.O_DIRECTORY, 0)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            for name in os.listdir(fd):
                with contextlib.suppress(FileNotFoundError):
                    yield name, os.stat(name, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ files

    def _parent(self, rel: str) -> tuple[int, str]:
        """A descriptor of ``rel``'s parent directory (the caller closes it) and ``rel``'s last name."""
        full = self._rel(rel)
        parent, _, name = full.rpartition("/")
        if not name:
            raise UnsafePathError(f"{self._name(rel)} names the tree's own directory")
        return _openat(self._fd, parent, os.O_RDONLY | os.O_DIRECTORY, 0), name

    def open_fd(self, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
        """A descriptor of ``rel``: a regular file (created with ``os.O_CREAT`` in ``flags``, never
        through a link), or a directory when ``flags`` say ``os.O_DIRECTORY``."""
        # O_NONBLOCK: opening a planted FIFO must not hang; it is refused below (no effect on files)
        fd = _openat(self._fd, self._rel(rel), flags | os.O_NONBLOCK, mode)
        if not flags & os.O_DIRECTORY and not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UnsafePathError(f"{self._name(rel)} is not a regular file")
        os.set_blocking(fd, True)
        return fd

    def stat(self, rel: str = "") -> os.stat_result:
        """``lstat`` of ``rel``; the directories on the way are confined like every open."""
        full = self._rel(rel)
        if not full:
            return os.fstat(self._fd)
        pfd, name = self._parent(rel)
        try:
            return os.stat(name, dir_fd=pfd, follow_symlinks=False)
        finally:
            os.close(pfd)

    def is_dir(self, rel: str = "") -> bool:
        """Whether ``rel`` is a directory itself (a symlink to one is not)."""
        try:
            return stat.S_ISDIR(self.stat(rel).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def exists(self, rel: str = "") -> bool:
        try:
            self.stat(rel)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return True

    def read_bytes(self, rel: str, *, limit: int) -> bytes:
        """The whole regular file ``rel``; larger than ``limit`` bytes raises ``FormatError``."""
        fd = self.open_fd(rel)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise FormatError(f"{self._name(rel)}: {size} bytes exceeds the limit of {limit}")
            chunks, got = [], 0
            while got <= limit:
                chunk = os.read(fd, min(1 << 20, limit + 1 - got))
                if not chunk:
                    break
                chunks.append(chunk)
                got += len(chunk)
            if got > limit:
                raise FormatError(f"{self._name(rel)}: grew past the limit of {limit} bytes")
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write_atomic(self, rel: str, data: bytes, mode: int = 0o644) -> None:
        """Write ``data`` to a fresh temporary file, fsync it, rename it over ``rel``, fsync the directory.

        The temporary file is created exclusively and never through a link, so nothing planted in the
        directory can redirect the write.
        """
        pfd, name = self._parent(rel)
        tmp = f"{name}{_TMP_SUFFIX}"
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=pfd)  # a leftover (or a planted link): gone, never followed
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=pfd
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
            os.fsync(pfd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=pfd)
            raise
        finally:
            os.close(pfd)

    def link_to(self, rel: str, dest: Beneath, dest_rel: str) -> None:
        """Hard-link the regular file ``rel`` here as ``dest_rel`` under ``dest`` (a new name there).

        Neither side follows a link: a symlink at ``rel`` is refused (``UnsafePathError``), so is
        anything that is not a regular file."""
        spfd, sname = self._parent(rel)
        try:
            st = os.stat(sname, dir_fd=spfd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafePathError(f"{self.where}/{rel}: not a regular file, not linked")
            dpfd, dname = dest._parent(dest_rel)
            try:
                os.link(sname, dname, src_dir_fd=spfd, dst_dir_fd=dpfd, follow_symlinks=False)
                if not stat.S_ISREG(os.stat(dname, dir_fd=dpfd, follow_symlinks=False).st_mode):
                    os.unlink(dname, dir_fd=dpfd)  # swapped for something else meanwhile
                    raise UnsafePathError(f"{self.where}/{rel}: changed while linked, not linked")
            finally:
                os.close(dpfd)
        finally:
            os.close(spfd)

    def unlink(self, rel: str, *, missing_ok: bool = True) -> None:
        """Remove the file (or link) ``rel``."""
        try:
            pfd, name = self._parent(rel)
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        try:
            os.unlink(name, dir_fd=pfd)
        except FileNotFoundError:
            if not missing_ok:
                raise
        finally:
            os.close(pfd)

    def rename(self, src: str, dst: str) -> None:
        """Rename ``src`` to ``dst``, both beneath this directory (a link at ``src`` moves as a link)."""
        sfd, sname = self._parent(src)
        try:
            dfd, dname = self._parent(dst)
            try:
                os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)
                os.fsync(dfd)
            finally:
                os.close(dfd)
        finally:
            os.close(sfd)

    def remove_tree(self, rel: str = "") -> None:
        """Remove ``rel`` (for a view, ``""`` is the view's own directory) and everything below it; a
        symlink is removed itself, never followed. Nothing there: nothing to do."""
        try:
            pfd, name = self._parent(rel)
        except FileNotFoundError:
            return
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _rmtree_at(pfd, name)
            else:
                os.unlink(name, dir_fd=pfd)
        except FileNotFoundError:
            return
        finally:
            os.close(pfd)

    def fsync(self, rel: str = "") -> None:
        fd = _openat(self._fd, self._rel(rel), os.O_RDONLY | os.O_DIRECTORY, 0)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
