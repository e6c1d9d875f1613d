"""``RamdiskWriter``: a DCP ``StorageWriter`` that saves into the tierckpt ramdisk format.

Each rank writes its own step directory ``<root>/<job>/rank-NNNNN/step-NNNNNNNNNNNN/`` (data files,
``manifest.json`` with ``manifest_kind="dcp"``, ``COMMIT``), so the replicator replicates and backs up
DCP checkpoints exactly like native ones. DCP's call order, and what each call does here:

1. (all ranks) ``reset(checkpoint_id)``: the step to write (``checkpoint_id`` names it; see
   ``parse_step_id``), unless the writer was built with ``step=``.
2. (all ranks) ``set_up_storage_writer``: learn the role; resolve rank and world size.
3. (all ranks) ``prepare_local_plan``: refuse an existing committed step unless ``overwrite=True``.
4. (coordinator) ``prepare_global_plan``: check that all ranks save the same step from distinct ranks.
5. (all ranks) ``write_data``: write every item's bytes to the data files, crc32c each; a non-coordinator
   rank then commits its step (its step is complete and self-describing on its own).
6. (coordinator) ``finish``: write the global metadata as typed JSON (``dcp-metadata.json``, see
   ``tierckpt.dcp.metadata``), then commit its own step last. The coordinator only gets here when every
   rank's ``write_data`` succeeded, so its COMMIT marks the whole DCP checkpoint complete.

A failure removes this rank's partial step; ``ENOSPC`` raises ``RamdiskFullError``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt.format import (
    DCP_METADATA_NAME,
    FileEntry,
    Manifest,
    TensorEntry,
    commit_step,
    data_file_name,
    discard_step,
    rank_dir,
    read_commit,
    step_dir,
    write_atomic,
)
from tierckpt.integrity import crc32c
from tierckpt.settings import resolve

from ._io import Payload, as_bytes, write_files
from ._layout import RankLayout, Slot, file_crc32c, plan_layout
from ._paths import parse_step_id, require_step_id
from .metadata import ItemLocation, encode_metadata, tensor_dtype_name

__all__ = ["DCP_FORMAT_VERSION", "RamdiskWriter", "item_key"]

log = logging.getLogger(__name__)

DCP_FORMAT_VERSION = 1
"""Version of the ``extra["dcp"]`` block of DCP manifests."""
_DCP_VERSION = "1.0.0"
"""``Metadata.version`` we record (the DCP checkpoint format version our layout is equivalent to)."""


def item_key(item_index: Any) -> str:
    """The manifest key of a DCP item: its fqn, plus ``@offsets`` for a tensor chunk."""
    if item_index.offset is None:
        return item_index.fqn
    return f"{item_index.fqn}@{','.join(str(int(o)) for o in item_index.offset)}"


@dataclasses.dataclass(frozen=True)
class _LocalPlanData:
    """``SavePlan.storage_data`` of a rank's local plan: what the coordinator checks."""

    rank: int
    step: int


@dataclasses.dataclass
class _Save:
    """One save in flight on this rank."""

    step: int
    rank: int
    world_size: int
    is_coordinator: bool
    path: Path
    files: list[FileEntry] = dataclasses.field(default_factory=list)
    tensors: list[TensorEntry] = dataclasses.field(default_factory=list)
    objects: list[int] = dataclasses.field(default_factory=list)


class RamdiskWriter(StorageWriter):
    """Save a DCP checkpoint to the node ramdisk, one committed step directory per rank.

    Args:
        root: the ramdisk root (default ``$TIERCKPT_ROOT``).
        job: the job id (default ``$TIERCKPT_JOB``, else ``"local"``).
        step: the step to save; ``dcp.save(..., checkpoint_id=step)`` sets it per save instead.
        rank, world_size: this process's rank and the job's world size as recorded in manifests
            (default: torch.distributed's global rank and world size).
        threads: data files (and writer threads) per rank; tmpfs takes one writer per file at a time.
        overwrite: replace this rank's committed step of the same number instead of refusing.
        sync_files: fsync data files (cheap on tmpfs; keeps the commit order on other file systems).
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        job: str | None = None,
        step: int | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        threads: int = 2,
        overwrite: bool = False,
        sync_files: bool = True,
    ) -> None:
        super().__init__()
        where = resolve(root=root, job=job, rank=rank, world_size=world_size)
        self.root, self.job = where.root, where.job
        self.step = None if step is None else require_step_id(step)
        self.threads = max(1, int(threads))
        self.overwrite = overwrite
        self.sync_files = sync_files
        self._rank = rank
        self._world_size = world_size
        self.save_id = str(uuid.uuid4())
        self._save: _Save | None = None

    # ------------------------------------------------------------------ identity

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return parse_step_id(checkpoint_id) is not None

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.step is None else str(self.step)

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        if checkpoint_id is not None:
            self.step = require_step_id(checkpoint_id)
        self.save_id = str(uuid.uuid4())
        self._abandon_unfinished()

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.checkpoint_id, save_id=self.save_id)

    # ------------------------------------------------------------------ planning

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("RamdiskWriter needs use_collectives=True (the coordinator writes the metadata)")
        if self.step is None:
            raise ValueError("no step to save: pass checkpoint_id=<step> to dcp.save, or step=")
        self._abandon_unfinished()
        who = resolve(root=self.root, job=self.job, rank=self._rank, world_size=self._world_size)
        rank, world_size = who.rank, who.world_size
        path = step_dir(rank_dir(self.root, self.job, rank), self.step)
        self._save = _Save(self.step, rank, world_size, bool(is_coordinator), path)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        save = self._current()
        if not self.overwrite and _committed(save.path):
            raise FileExistsError(
                f"rank {save.rank} already has a committed step {save.step} at {save.path}; "
                "save under a new step, or pass overwrite=True to RamdiskWriter to replace it"
            )
        return dataclasses.replace(plan, storage_data=_LocalPlanData(save.rank, save.step))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        infos = [p.storage_data for p in plans if isinstance(p.storage_data, _LocalPlanData)]
        steps = {i.step for i in infos}
        if len(steps) > 1:
            raise ValueError(f"ranks disagree on the step to save ({sorted(steps)}); pass one checkpoint_id")
        ranks = [i.rank for i in infos]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"two processes save as the same rank (ranks {sorted(ranks)}); check rank=")
        return plans

    # ------------------------------------------------------------------ writing

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._current()
        if save.path.exists():
            discard_step(save.path)  # an uncommitted leftover, or a step we were told to overwrite
        save.path.mkdir(parents=True)
        try:
            results = self._write_items(save, plan.items, planner)
        except BaseException:
            discard_step(save.path)
            raise
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_items(self, save: _Save, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        objects = {i: as_bytes(planner.resolve_data(it)) for i, it in enumerate(items) if _is_object(it)}
        lengths = [len(objects[i]) if i in objects else _planned_length(it) for i, it in enumerate(items)]
        layout = plan_layout(lengths, self.threads)

        def resolve(slot: Slot) -> Payload:
            if slot.item in objects:
                return objects.pop(slot.item)
            return _tensor_payload(items[slot.item], planner.resolve_data(items[slot.item]))

        paths = [save.path / data_file_name(f) for f in range(len(layout.file_sizes))]
        slots_per_file = [layout.slots_in(f) for f in range(len(paths))]
        t0 = time.perf_counter()
        crcs = write_files(paths, layout.file_sizes, slots_per_file, resolve, sync=self.sync_files)
        self._record(save, items, layout, crcs)
        manifest_crc = None
        if not save.is_coordinator:
            manifest_crc = commit_step(save.path, self._manifest(save)).manifest_crc32c
            log.info(
                "rank %d committed DCP step %d: %d items, %d bytes in %.3fs at %s",
                save.rank,
                save.step,
                len(items),
                sum(layout.file_sizes),
                time.perf_counter() - t0,
                save.path,
            )
        return [
            WriteResult(
                index=it.index,
                size_in_bytes=slot.length,
                storage_data=ItemLocation(
                    save.rank,
                    data_file_name(slot.file),
                    slot.offset,
                    slot.length,
                    crcs[slot.item],
                    manifest_crc,
                ),
            )
            for it, slot in zip(items, layout.slots, strict=True)
        ]

    def _record(self, save: _Save, items: list[WriteItem], layout: RankLayout, crcs: dict[int, int]) -> None:
        save.files = [
            FileEntry(data_file_name(f), size, file_crc32c(layout.slots_in(f), crcs))
            for f, size in enumerate(layout.file_sizes)
        ]
        save.tensors = []
        save.objects = []
        for it, slot in zip(items, layout.slots, strict=True):
            if _is_object(it):
                save.objects.append(len(save.tensors))
                dtype, shape = "uint8", (slot.length,)
            else:
                td = it.tensor_data
                assert td is not None
                dtype, shape = tensor_dtype_name(td.properties.dtype), tuple(td.chunk.sizes)
            save.tensors.append(
                TensorEntry(
                    item_key(it.index),
                    dtype,
                    shape,
                    data_file_name(slot.file),
                    slot.offset,
                    slot.length,
                    crcs[slot.item],
                )
            )

    def _manifest(self, save: _Save) -> Manifest:
        extra = {
            "version": DCP_FORMAT_VERSION,
            "coordinator": save.is_coordinator,
            "save_id": self.save_id,
            "objects": save.objects,
        }
        if save.is_coordinator:
            extra["metadata"] = DCP_METADATA_NAME
        return Manifest(
            job=self.job,
            rank=save.rank,
            world_size=save.world_size,
            step=save.step,
            created_at=time.time(),
            files=tuple(save.files),
            tensors=tuple(save.tensors),
            manifest_kind="dcp",
            extra={"dcp": extra},
        )

    # ------------------------------------------------------------------ commit

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        save = self._current()
        locations = {wr.index: wr.storage_data for rank_results in results for wr in rank_results}
        metadata.storage_data = locations
        metadata.storage_meta = self.storage_meta()
        metadata.version = _DCP_VERSION
        try:
            record = encode_metadata(
                metadata,
                locations,
                job=self.job,
                step=save.step,
                world_size=save.world_size,
                coordinator=save.rank,
            )
            body = record.to_bytes()
            write_atomic(save.path / DCP_METADATA_NAME, body)
            save.files.append(FileEntry(DCP_METADATA_NAME, len(body), crc32c(body)))
            commit_step(save.path, self._manifest(save))
        except BaseException:
            discard_step(save.path)
            raise
        log.info(
            "coordinator rank %d committed DCP step %d (%d entries, %d items from %d ranks) at %s",
            save.rank,
            save.step,
            len(metadata.state_dict_metadata),
            len(locations),
            len(results),
            save.path,
        )
        self._save = None

    def _abandon_unfinished(self) -> None:
        """The coordinator's previous save never reached ``finish`` (another rank failed): remove it."""
        prev, self._save = self._save, None
        if prev is not None and prev.is_coordinator and prev.path.exists() and not _committed(prev.path):
            log.warning("removing DCP step %d of rank %d: its save did not finish", prev.step, prev.rank)
            discard_step(prev.path)

    def _current(self) -> _Save:
        if self._save is None:
            raise RuntimeError("RamdiskWriter used outside dcp.save (set_up_storage_writer was not called)")
        return self._save


def _committed(path: Path) -> bool:
    try:
        return read_commit(path) is not None
    except Exception:  # a corrupt marker is no step: it may be replaced
        return False


def _is_object(item: WriteItem) -> bool:
    return item.type == WriteItemType.BYTE_IO


def _planned_length(item: WriteItem) -> int:
    td = item.tensor_data
    if td is None:
        raise ValueError(f"write item {item.index.fqn!r} has no tensor data")
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


def _tensor_payload(item: WriteItem, data: Any) -> Payload:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner resolved tensor item {item.index.fqn!r} to a {type(data).__name__}")
    td = item.tensor_data
    assert td is not None
    if data.dtype != td.properties.dtype or tuple(data.shape) != tuple(td.chunk.sizes):
        raise ValueError(
            f"planner resolved {item_key(item.index)!r} to {data.dtype} {tuple(data.shape)}, "
            f"planned {td.properties.dtype} {tuple(td.chunk.sizes)}"
        )
    return as_bytes(data)
