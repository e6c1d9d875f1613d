"""Turning filled data files into a committed step: checksums, sync, objects.pkl, manifest, COMMIT.

Order (docs/format.md, "Commit protocol"): every data file is msync'ed and fsync'ed, objects.pkl is
written atomically, then ``format.commit_step`` writes the manifest and, last, the COMMIT marker.
A crash anywhere before the COMMIT rename leaves a step directory that readers ignore.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tierckpt.protocol.format import (
    OBJECTS_NAME,
    CommitMarker,
    FileEntry,
    Manifest,
    ManifestKind,
    TensorEntry,
    commit_step,
    write_atomic,
)
from tierckpt.protocol.integrity import crc32c
from tierckpt.protocol.replica import ReplicaRecord
from tierckpt.snapshot.checksum import crc_threads
from tierckpt.snapshot.copy import file_crc, region_crcs
from tierckpt.snapshot.layout import LayoutPlan
from tierckpt.snapshot.shardfile import MappedFile

__all__ = ["CommittedStep", "RecordFor", "StepIdentity", "checksum_slot", "commit_files", "seal_step"]

RecordFor = Callable[[tuple[FileEntry, ...], tuple[TensorEntry, ...], int], ReplicaRecord]
"""``(files, tensors, bytes linked from another member) -> the step's replica record``."""


class StepIdentity:
    """Who a step belongs to: job, rank, world size, step."""

    __slots__ = ("job", "rank", "step", "world_size")

    def __init__(self, job: str, rank: int, world_size: int, step: int) -> None:
        self.job, self.rank, self.world_size, self.step = job, rank, world_size, step


@dataclasses.dataclass(frozen=True)
class CommittedStep:
    marker: CommitMarker
    manifest: Manifest


def checksum_slot(
    plan: LayoutPlan, files: Sequence[MappedFile], *, workers: int | None = None
) -> tuple[list[int], list[FileEntry]]:
    """Per-tensor crc32c and per-file entries (size, crc) of data files filled according to ``plan``."""
    regions = [(files[p.file].address + p.offset, p.length) for p in plan.placements]
    tensor_crcs = region_crcs(regions, workers=workers or min(8, max(1, crc_threads() // 2)))
    entries = []
    for i, (fp, f) in enumerate(zip(plan.files, files, strict=True)):
        parts = sorted(
            (p.offset, p.length, c) for p, c in zip(plan.placements, tensor_crcs, strict=True) if p.file == i
        )
        entries.append(FileEntry(name=fp.name, size=fp.size, crc32c=file_crc(f.address, fp.size, parts)))
    return tensor_crcs, entries


def commit_files(
    step_path: Path,
    who: StepIdentity,
    plan: LayoutPlan,
    files: Sequence[MappedFile],
    *,
    tree: Any = None,
    objects: bytes | None = None,
    object_count: int = 0,
    manifest_kind: ManifestKind = "state_dict",
    extra: dict[str, Any] | None = None,
    workers: int | None = None,
    replica: RecordFor | None = None,
) -> CommittedStep:
    """Checksum, sync and commit a step whose data files hold ``plan``'s tensors (``replica``: the
    record of the rank's replica group, built from the finished file and tensor tables)."""
    tensor_crcs, file_entries = checksum_slot(plan, files, workers=workers)
    for f in files:
        f.sync()
    tensors = tuple(
        TensorEntry(
            key=spec.key,
            dtype=spec.dtype,
            shape=spec.shape,
            file=plan.files[p.file].name,
            offset=p.offset,
            length=p.length,
            crc32c=c,
        )
        for spec, p, c in zip(plan.specs, plan.placements, tensor_crcs, strict=True)
    )
    return seal_step(
        step_path,
        who,
        file_entries,
        tensors,
        tree=tree,
        objects=objects,
        object_count=object_count,
        manifest_kind=manifest_kind,
        extra=extra,
        replica=replica,
    )


def seal_step(
    step_path: Path,
    who: StepIdentity,
    data_files: Sequence[FileEntry],
    tensors: tuple[TensorEntry, ...],
    *,
    tree: Any,
    objects: bytes | None,
    object_count: int,
    manifest_kind: ManifestKind = "state_dict",
    extra: dict[str, Any] | None = None,
    replica: RecordFor | None = None,
    linked: int = 0,
) -> CommittedStep:
    """The last part of every commit, once the data files are durable: objects.pkl (atomically), then
    the manifest and, last, COMMIT. ``linked``: bytes of ``data_files`` hard-linked from another member."""
    files = list(data_files)
    if objects is not None:
        write_atomic(step_path / OBJECTS_NAME, objects)
        files.append(FileEntry(name=OBJECTS_NAME, size=len(objects), crc32c=crc32c(objects)))
    file_table = tuple(files)
    manifest = Manifest(
        job=who.job,
        rank=who.rank,
        world_size=who.world_size,
        step=who.step,
        created_at=time.time(),
        files=file_table,
        tensors=tensors,
        tree=tree,
        object_count=object_count,
        manifest_kind=manifest_kind,
        extra=extra or {},
        replica=None if replica is None else replica(file_table, tensors, linked),
    )
    return CommittedStep(commit_step(step_path, manifest), manifest)
