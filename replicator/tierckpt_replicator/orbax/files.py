"""The files of Orbax's ramdisk protocol in a job directory: read what Orbax wrote, write the answers.

Everything goes through the job's confined tree (``safefs.Beneath``): ``replicator.yaml`` is read only as
a regular file of at most ``MAX_YAML_BYTES`` (a symlink, a FIFO or a directory by that name is refused
and removed), every answer is written to a fresh, exclusively created temporary file renamed into place
(``Beneath.write_atomic``), and anything a pod planted where an answer goes is removed, never followed.
Orbax itself reads ``jax-init-info.txt``, the error files and the restore markers by name, so those
keep the names it expects.

Blocking file I/O: callers run these in a thread.
"""

from __future__ import annotations

import contextlib
import os
import stat

from tierckpt.protocol.errors import FormatError, UnsafePathError
from tierckpt.protocol.orbax import (
    ERRORS,
    FAILED,
    JAX_INIT_INFO,
    MAX_YAML_BYTES,
    PRERESTORE,
    REPLICATOR_YAML,
    is_restore_marker,
    prerestore,
    step_of,
)
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.orbax.steps import RESTORE_PREFIX

__all__ = [
    "clear_for_handshake",
    "hand_over_nothing",
    "hand_over_step",
    "read_yaml",
    "remove",
    "report",
    "step_dirs",
    "write_jax_init_info",
]

_REPORT_LIMIT = 64 << 10
"""The most an error file holds (its newest lines): Orbax reads it whole."""
_INFO_LIMIT = 4096


def read_yaml(job: Beneath) -> bytes | None:
    """The bytes of ``replicator.yaml`` (None: there is none). ``UnsafePathError`` if it is not a regular
    file, ``FormatError`` if it is larger than ``MAX_YAML_BYTES``."""
    try:
        return job.read_bytes(REPLICATOR_YAML, limit=MAX_YAML_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        return None


def remove(job: Beneath, name: str) -> None:
    """Remove ``name`` whatever it is (a file, a link, a directory tree: never followed)."""
    job.remove_tree(name)


def step_dirs(job: Beneath) -> dict[int, str]:
    """Step -> name of every entry of ``job`` that is named like a committed Orbax step and is a directory
    itself (a symlink by such a name is not one)."""
    out = {}
    for name, st in job.entries():
        step = step_of(name)
        if step is not None and stat.S_ISDIR(st.st_mode):
            out[step] = name
    return out


def write_jax_init_info(job: Beneath, content: bytes) -> bool:
    """Make ``jax-init-info.txt`` hold ``content`` (replacing whatever is there); False if it already did."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        try:
            if job.read_bytes(JAX_INIT_INFO, limit=_INFO_LIMIT) == content:
                return False
        except FormatError:  # not a regular file (UnsafePathError), or too large: replaced
            remove(job, JAX_INIT_INFO)
    job.write_atomic(JAX_INIT_INFO, content)
    return True


def report(job: Beneath, name: str, line: str) -> None:
    """Append ``line`` to ``replicator.errors`` or ``replicator.failed`` (kept to its newest 64 KiB)."""
    if name not in (ERRORS, FAILED):
        raise ValueError(f"not an error file: {name}")
    old = b""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        try:
            old = job.read_bytes(name, limit=_REPORT_LIMIT)
        except FormatError:  # planted: not a regular file, or too large
            remove(job, name)
    text = old + line.replace("\n", " ").encode("utf-8", "replace") + b"\n"
    job.write_atomic(name, text[-_REPORT_LIMIT:])


def clear_for_handshake(job: Beneath) -> list[str]:
    """Before Orbax is released: remove every restore marker, step directory (committed ones must have
    been adopted first), restore layout, pre-restore note and error file of an earlier run, and the
    consumed ``jax-init-info.txt``; Orbax takes the newest marker or numeric entry it finds for its
    restore, and an old error file would fail the new run. Returns the names removed."""
    removed = []
    for name in sorted(job.listdir()):
        stale = (
            is_restore_marker(name)
            or step_of(name) is not None
            or name.startswith(RESTORE_PREFIX)
            or name in (PRERESTORE, ERRORS, FAILED, JAX_INIT_INFO)
        )
        if stale:
            with contextlib.suppress(FileNotFoundError):
                remove(job, name)
                removed.append(name)
    return removed


def hand_over_step(job: Beneath, layout: str, marker: str, step: int) -> None:
    """Say which step is coming (``replicator.prerestore``), then rename the laid-out step directory
    ``layout`` to its restore ``marker``: Orbax takes it as its step directory."""
    job.write_atomic(PRERESTORE, prerestore(step))
    job.rename(layout, marker)


def hand_over_nothing(job: Beneath, marker: str) -> None:
    """Nothing to restore: ``replicator.prerestore`` says so, and the marker is an empty regular file."""
    job.write_atomic(PRERESTORE, prerestore(None))
    with contextlib.suppress(FileNotFoundError):
        remove(job, marker)
    try:
        fd = job.open_fd(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError as exc:  # planted between the two calls
        raise UnsafePathError(f"{job.where}/{marker} appeared meanwhile") from exc
    os.close(fd)
