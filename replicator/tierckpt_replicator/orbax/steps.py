"""Orbax step directories to and from tierckpt's committed steps, by hard links within the ramdisk.

``adopt``: a committed Orbax step ``<job>/<S>/`` (Orbax commits it by renaming it into place) becomes
the committed primary ``<job>/rank-<P>/step-<S>/`` of process ``P``: every file of the tree is
hard-linked into a staging directory as ``data-00000.bin``, ``data-00001.bin``, ... (no byte is copied),
its crc32c is computed, a manifest of kind ``orbax`` records where each file and directory goes back
(``tierckpt.protocol.orbax.OrbaxLayout``), COMMIT is written last and the staging directory is renamed
into place; then the Orbax directory is removed (the step's files live on under their new names). From
there replication, backups and restore staging handle it like any step.

``materialize``: the reverse, for a restore: a committed step of kind ``orbax`` (staged from this node,
a peer or the bucket) is laid out again as an Orbax step directory under a hidden name in the job
directory, every file hard-linked from the step after its size and crc32c were checked, ready to be
renamed to its restore marker.

Both run inside the job's confined tree (``safefs.Beneath``): the Orbax directory is the pod's, so a
symlink, a FIFO or a device anywhere in it makes the step unadoptable (``UnsafePathError``), never
followed; its size is bounded (``MAX_ENTRIES`` files and directories, ``MAX_DEPTH`` levels). Paths
read back from a manifest (which a peer, the bucket or the pod may have written) are checked
(``check_relative_path``) and created beneath the new directory only.

Blocking file I/O: callers run these in a thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import stat
import time
from collections.abc import Collection

from tierckpt.planning.retention import plan_retention
from tierckpt.protocol import leases
from tierckpt.protocol.errors import FormatError, RetryableError, UnsafePathError
from tierckpt.protocol.format import (
    FileEntry,
    Manifest,
    commit_step,
    committed_steps,
    data_file_name,
    discard_step,
    read_manifest,
    step_names,
)
from tierckpt.protocol.integrity import crc32c_file
from tierckpt.protocol.orbax import MAX_ENTRIES, OrbaxLayout, check_relative_path, step_of
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.stepio import INCOMING_PREFIX, rank_tree, step_name

__all__ = ["COMMIT_SIGNAL", "RESTORE_PREFIX", "Adopted", "adopt", "apply_retention", "materialize", "walk"]

log = logging.getLogger(__name__)

COMMIT_SIGNAL = "_CHECKPOINT_METADATA"
"""Every step Orbax commits holds this file (written before the step is renamed into place)."""
RESTORE_PREFIX = ".orbax-restore-"
"""A step being laid out for a restore (hidden: Orbax lists only numeric names and ``*.restore``)."""


@dataclasses.dataclass(frozen=True)
class Adopted:
    step: int
    files: int
    bytes: int
    replaced: bool
    """A committed step of the same number was replaced (the same step saved again)."""


def walk(tree: Beneath) -> OrbaxLayout:
    """Every file and directory beneath ``tree`` (an Orbax step), parents before children, in name order.

    ``UnsafePathError`` for anything that is neither a regular file nor a directory (a symlink is never
    followed); ``FormatError`` past ``MAX_ENTRIES`` entries, or for a path that is unsafe or too deep
    (``check_relative_path``)."""
    files: list[str] = []
    dirs: list[str] = []
    pending = [""]
    while pending:
        rel = pending.pop(0)
        children = []
        for name, st in sorted(tree.entries(rel)):
            path = f"{rel}/{name}" if rel else name
            check_relative_path(path)
            if stat.S_ISDIR(st.st_mode):
                dirs.append(path)
                children.append(path)
            elif stat.S_ISREG(st.st_mode):
                files.append(path)
            else:
                raise UnsafePathError(f"{tree.where}/{path}: a symlink or special file (never followed)")
            if len(files) > MAX_ENTRIES or len(dirs) > MAX_ENTRIES:
                raise FormatError(f"{tree.where}: more than {MAX_ENTRIES} files or directories")
        pending[:0] = children  # depth first: a directory's children come right after it
    return OrbaxLayout(tuple(files), tuple(dirs))


def adopt(job: Beneath, name: str, *, job_id: str, rank: int, world_size: int) -> Adopted:
    """Make the committed Orbax step directory ``name`` of ``job`` the committed primary of ``rank``, then
    remove the Orbax directory. ``RetryableError`` if a reader leases the step it would replace (the next
    pass tries again); ``UnsafePathError``/``FormatError`` if the directory cannot be adopted (it stays)."""
    step = step_of(name)
    if step is None:
        raise FormatError(f"{name!r} is not an Orbax step directory")
    if not stat.S_ISDIR(job.stat(name).st_mode):
        raise UnsafePathError(f"{job.where}/{name}: a symlink or not a directory (never followed)")
    src = job.at(name)
    layout = walk(src)
    if COMMIT_SIGNAL not in layout.files:
        raise FormatError(f"{src.where}: no {COMMIT_SIGNAL}, not a step Orbax committed")
    parent = rank_tree(job, "primary", rank)
    parent.makedirs()
    staging = f"{INCOMING_PREFIX}{step:012d}-{secrets.token_hex(4)}"
    parent.mkdir(staging)
    stage = parent.at(staging)
    try:
        entries = []
        for i, path in enumerate(layout.files):
            target = data_file_name(i)
            src.link_to(path, stage, target)
            fd = stage.open_fd(target)
            try:
                entries.append(FileEntry(target, os.fstat(fd).st_size, crc32c_file(fd)))
            finally:
                os.close(fd)
        manifest = Manifest(
            job=job_id,
            rank=rank,
            world_size=world_size,
            step=step,
            created_at=time.time(),
            files=tuple(entries),
            tensors=(),
            manifest_kind="orbax",
            extra=layout.extra(),
        )
        commit_step(stage, manifest)
        replaced = _put_in_place(parent, staging, step)
    except BaseException:
        parent.remove_tree(staging)
        raise
    job.remove_tree(name)
    return Adopted(step, len(entries), manifest.total_bytes, replaced)


def _put_in_place(parent: Beneath, staging: str, step: int) -> bool:
    """Rename the committed ``staging`` directory to the step's name, replacing a step of the same number
    unless a reader leases it (the lease lock keeps a reader from leasing it meanwhile)."""
    final = step_name(step)
    with leases.lock(parent):
        replaced = parent.exists(final)
        if replaced:
            if step in leases.leased_steps(parent):
                raise RetryableError(f"step {step} is saved again while a reader leases the copy it replaces")
            discard_step(parent.at(final))
        parent.rename(staging, final)
    return replaced


def apply_retention(
    parent: Beneath, *, keep: int, latest: int, protect: Collection[int] = ()
) -> tuple[int, ...]:
    """After ``latest`` was adopted into rank directory ``parent``: keep the newest ``keep`` steps, the
    leased ones and ``protect``; retire the rest, the steps above ``latest`` included (saved before
    training went back to an older step), and step directories left uncommitted. Returns the retired
    steps."""
    leases.purge_expired(parent)
    with leases.lock(parent):
        committed = committed_steps(parent)
        present = step_names(parent)
        plan = plan_retention(
            committed,
            keep=keep,
            leased=leases.leased_steps(parent) | set(protect),
            uncommitted=[s for s in present if s not in committed],
            latest=latest,
        )
        for step in (*plan.retire, *plan.discard):
            discard_step(parent.at(present[step]))
    superseded = [s for s in plan.retire if s > latest]
    if superseded:
        log.info(
            "%s: retired steps %s, saved before training went back to step %d",
            parent.where,
            superseded,
            latest,
        )
    return plan.retire


def materialize(job: Beneath, rank: int, step: int, *, job_id: str, limit: int) -> str:
    """Lay out ``rank``'s committed ``step`` (an adopted Orbax step) as an Orbax step directory under a
    hidden name in ``job``; returns that name. Every file is checked against the manifest (size and
    crc32c) and hard-linked; ``FormatError`` (or ``UnsafePathError``) if anything does not match, and
    nothing is left behind."""
    src = rank_tree(job, "primary", rank).at(step_name(step))
    manifest = read_manifest(src, limit=limit)
    if (manifest.job, manifest.rank, manifest.step) != (job_id, rank, step):
        raise FormatError(f"{src.where}: the manifest names job {manifest.job!r} rank {manifest.rank}")
    layout = OrbaxLayout.of(manifest)
    name = f"{RESTORE_PREFIX}{step}-{secrets.token_hex(4)}"
    job.mkdir(name, 0o755)
    dest = job.at(name)
    try:
        for d in layout.dirs:
            dest.mkdir(d, 0o755)
        for entry, path in zip(manifest.files, layout.files, strict=True):
            fd = src.open_fd(entry.name)
            try:
                size = os.fstat(fd).st_size
                if size != entry.size or crc32c_file(fd) != entry.crc32c:
                    raise FormatError(f"{src.where}/{entry.name} does not match its manifest (corrupt)")
            finally:
                os.close(fd)
            src.link_to(entry.name, dest, path)
    except BaseException:
        job.remove_tree(name)
        raise
    return name
