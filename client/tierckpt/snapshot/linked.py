"""Committing a step whose data files are hard links to another member's committed step (same node).

A replica group's member that does not write for its node (``replica_group.Membership``) saves by
linking: once the node's writer has committed the same step with the same fingerprint, its data files
are hard-linked into this rank's new step directory (the same pages: no memory, no copy), this rank's
own ``objects.pkl`` is written, and its own manifest (the writer's file and tensor tables, this rank's
identity, tree and replica record) and COMMIT complete it. The rank directory stays self-contained:
replication, backup, restore and retention treat it like any other.

Safety rests on two rules (docs/format.md, "Replica groups"): a committed step is never modified in
place, and a data file with more than one link is never recycled into a new step (``snapshot.pool``).
The COMMIT read before linking must still be there, unchanged, after linking, or the files may belong
to a step being replaced, and the links are made again.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tierckpt.protocol.errors import FormatError, TierckptError
from tierckpt.protocol.format import (
    COMMIT_NAME,
    Manifest,
    discard_step,
    fsync_dir,
    iter_data_files,
    read_manifest,
)
from tierckpt.snapshot.commit import CommittedStep, RecordFor, StepIdentity, seal_step
from tierckpt.snapshot.rankdir import WRITER_LOCK

__all__ = ["LinkAbandoned", "commit_linked", "writer_alive"]

_POLL = (0.001, 0.05)
"""First and longest wait between looks at the source's COMMIT, in seconds."""
_LIVENESS_EVERY = 1.0


class LinkAbandoned(TierckptError):
    """The source member's step never came: it failed, its writer stopped, or the wait timed out."""


def writer_alive(rank_path: Path) -> bool:
    """Whether a process holds ``rank_path``'s writer lock (a ``Checkpointer`` is running there)."""
    try:
        fd = os.open(rank_path / WRITER_LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing drops the shared lock if we got it
    return False


def _read_marker(step_path: Path) -> bytes | None:
    try:
        return (step_path / COMMIT_NAME).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None


def _wait_for_source(
    source_step: Path, fingerprint: str, *, deadline: float, cancelled: threading.Event
) -> tuple[bytes, Manifest]:
    """The source step's COMMIT bytes and manifest, once committed with ``fingerprint``."""
    delay, checked, seen = _POLL[0], time.monotonic(), None
    while True:
        marker = _read_marker(source_step)
        if marker is not None and marker != seen:
            seen = marker  # a COMMIT already looked at (an older copy of the step) is not decoded again
            try:
                manifest = read_manifest(source_step)
            except FormatError:
                manifest = None  # being replaced, or corrupt: look again
            if (
                manifest is not None
                and manifest.replica is not None
                and manifest.replica.fingerprint == fingerprint
            ):
                return marker, manifest
        now = time.monotonic()
        if cancelled.is_set():
            raise LinkAbandoned(f"{source_step}: the source member reported that this save failed")
        if now >= deadline:
            raise LinkAbandoned(f"{source_step}: not committed with fingerprint {fingerprint} in time")
        if now - checked >= _LIVENESS_EVERY:
            checked = now
            if not writer_alive(source_step.parent):
                raise LinkAbandoned(f"{source_step.parent}: its writer stopped before committing the step")
        cancelled.wait(delay)
        delay = min(delay * 2, _POLL[1])


def _link_files(source_step: Path, step_path: Path, manifest: Manifest) -> int:
    """Hard-link the source's data files into ``step_path``; returns their total size."""
    total = 0
    for entry in iter_data_files(manifest):
        dest = step_path / entry.name
        os.link(source_step / entry.name, dest)
        size = os.stat(dest).st_size
        if size != entry.size:
            raise FormatError(f"{source_step / entry.name}: {size} bytes, its manifest says {entry.size}")
        total += size
    return total


def commit_linked(
    step_path: Path,
    who: StepIdentity,
    source_step: Path,
    *,
    fingerprint: str,
    keys: Sequence[str],
    tree: Any,
    objects: bytes | None,
    object_count: int,
    record: RecordFor,
    timeout: float,
    cancelled: threading.Event,
) -> CommittedStep:
    """Wait for ``source_step`` (another member's step of this node) to commit with ``fingerprint``, link
    its data files into ``step_path`` and commit this rank's step. ``LinkAbandoned`` if it never comes."""
    deadline = time.monotonic() + timeout
    while True:
        marker, source = _wait_for_source(source_step, fingerprint, deadline=deadline, cancelled=cancelled)
        if [t.key for t in source.tensors] != list(keys):
            raise FormatError(
                f"{source_step}: its tensors are not this rank's (same fingerprint, other keys)"
            )
        discard_step(step_path)
        step_path.mkdir(parents=True)
        try:
            linked = _link_files(source_step, step_path, source)
        except FileNotFoundError:
            linked = -1  # the source step moved on meanwhile
        if linked >= 0 and _read_marker(source_step) == marker:
            break
        if time.monotonic() >= deadline:
            raise LinkAbandoned(f"{source_step}: kept changing while being linked")
    fsync_dir(step_path)
    data_files = [f for f in source.files if f.name.startswith("data-")]
    try:
        return seal_step(
            step_path,
            who,
            data_files,
            tuple(source.tensors),
            tree=tree,
            objects=objects,
            object_count=object_count,
            replica=record,
            linked=linked,
        )
    except BaseException:
        with contextlib.suppress(Exception):
            discard_step(step_path)
        raise
