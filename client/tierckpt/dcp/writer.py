"""``RamdiskWriter``: a DCP ``StorageWriter`` that saves into the tierckpt ramdisk format.

Each rank writes its own step directory ``<root>/<job>/rank-NNNNN/step-NNNNNNNNNNNN/`` (data file,
``manifest.json`` with ``manifest_kind="dcp"``, ``COMMIT``), so the replicator replicates and backs up
DCP checkpoints exactly like native ones. DCP's call order, and what each call does here:

1. (all ranks) ``reset(checkpoint_id)``: the step to write (``checkpoint_id`` names it; see
   ``parse_step_id``), unless the writer was built with ``step=``.
2. (all ranks) ``set_up_storage_writer``: learn the role; resolve rank, world size and node; create the
   rank directory (and the root and job directories above it) if it does not exist yet.
3. (all ranks) ``prepare_local_plan``: refuse an existing committed step unless ``overwrite=True`` or the
   job went back to an older step since it was saved (``_store.went_back_to``);
   tell the coordinator this rank's node and which items it holds.
4. (coordinator) ``prepare_global_plan``: check that all ranks save the same step from distinct ranks;
   give every node a copy of the replicated items DCP left to another node (``copies``); build the
   global metadata from the plans (``tierckpt.dcp.metadata``) and hand it to one rank of every node;
   tell every rank which checkpoints are complete (for retention).
5. (all ranks) ``write_data``: copy every item straight into the rank's mapped data file (pages reused
   from a retired step when possible), crc32c each item in place, write the metadata if this rank
   carries it for its node; a non-coordinator rank then commits its step (complete and
   self-describing on its own) and applies retention.
6. (coordinator) ``finish``: check that DCP's metadata is the one planned and that every copy of an
   item holds the same bytes, then commit its own step last. The coordinator only gets here when every
   rank's ``write_data`` succeeded, so its COMMIT marks the whole DCP checkpoint complete.

A failure removes this rank's partial step; a full ramdisk raises ``RamdiskFullError``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import threading
import time
import uuid
from collections import ChainMap
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt import cuda
from tierckpt.planning.retention import FRESH_START
from tierckpt.protocol import leases
from tierckpt.protocol.errors import FormatError, SaveInProgressError
from tierckpt.protocol.format import (
    DCP_METADATA_NAME,
    FileEntry,
    Manifest,
    TensorEntry,
    commit_step,
    committed_steps,
    discard_step,
    rank_dir,
    read_commit,
    step_dir,
    write_atomic,
)
from tierckpt.protocol.integrity import crc32c
from tierckpt.settings import resolve
from tierckpt.snapshot.commit import checksum_slot
from tierckpt.snapshot.copy import copy_into
from tierckpt.snapshot.layout import LayoutPlan, TensorSpec, plan_layout
from tierckpt.snapshot.pool import Slot
from tierckpt.snapshot.restore_wait import current_status

from ._node import node_identity
from ._paths import parse_step_id, require_step_id
from ._store import RankStore, went_back_to
from .copies import add_node_copies
from .inplace import Staged, Template, stage_into_slot
from .metadata import ItemLocation, encode_metadata, tensor_dtype_name
from .staging import StagingCache

__all__ = ["DCP_FORMAT_VERSION", "RamdiskWriter", "item_key"]

log = logging.getLogger(__name__)

DCP_FORMAT_VERSION = 1
"""Version of the ``extra["dcp"]`` block of DCP manifests."""
_DCP_VERSION = "1.0.0"
"""``Metadata.version`` we record (the DCP checkpoint format version our layout is equivalent to)."""
_OVERLAP_GRACE = 1.0
"""Seconds a new save waits for the previous one's thread to end before calling it an overlap."""
_COPY_BATCH = 256 << 20
"""Resolve and copy items in batches of about this many bytes (DCP asks to resolve lazily)."""
_STAGING_STEP = 10**18 - 1
"""The step directory an async save's slot waits in between staging and ``write_data`` (which moves it
to the real step: the step is not known while staging). Never committed, so no reader sees it."""


def item_key(index: MetadataIndex) -> str:
    """The manifest key of a DCP item: its fqn, plus ``@offsets`` for a tensor chunk."""
    if index.offset is None:
        return index.fqn
    return f"{index.fqn}@{','.join(str(int(o)) for o in index.offset)}"


@dataclasses.dataclass(frozen=True)
class _LocalPlanData:
    """``SavePlan.storage_data`` of a rank's local plan: what the coordinator checks and plans with."""

    rank: int
    step: int
    node: str
    items: list[WriteItem]
    """The plan's own item list (the same object, so pickling sends it once): what the rank holds
    before DCP's deduplication."""


@dataclasses.dataclass(frozen=True)
class _GlobalPlanData:
    """``SavePlan.storage_data`` the coordinator sends back."""

    step: int
    complete: tuple[int, ...]
    """Checkpoints complete before this save (for retention)."""
    save_id: str
    """The coordinator's id of this save, recorded in every rank's manifest."""
    metadata: bytes | None = None
    """The encoded ``DcpMetadata``, for the one rank of each node that writes it into its step."""


@dataclasses.dataclass
class _Save:
    """One save in flight on this rank."""

    step: int
    rank: int
    world_size: int
    is_coordinator: bool
    path: Path
    node: str
    owner: threading.Thread = dataclasses.field(default_factory=threading.current_thread)
    slot: Slot | None = None
    files: list[FileEntry] = dataclasses.field(default_factory=list)
    tensors: list[TensorEntry] = dataclasses.field(default_factory=list)
    objects: list[int] = dataclasses.field(default_factory=list)
    save_id: str = ""
    """The coordinator's save id (from the global plan)."""
    has_metadata: bool = False
    planned: tuple[Metadata, dict[MetadataIndex, tuple[int, ...]]] | None = None
    """Coordinator: the metadata built while planning and each item's holders, which ``finish`` checks
    DCP's metadata and the write results against."""


class RamdiskWriter(StorageWriter):
    """Save a DCP checkpoint to the node ramdisk, one committed step directory per rank.

    Args:
        root: the ramdisk root (default ``$TIERCKPT_ROOT``).
        job: the job id (default ``$TIERCKPT_JOB``, else ``"local"``).
        step: the step to save; ``dcp.save(..., checkpoint_id=step)`` sets it per save instead.
        rank, world_size: this process's rank and the job's world size as recorded in manifests
            (default: ``TIERCKPT_RANK``/``TIERCKPT_WORLD_SIZE``, else torch.distributed's).
        keep: complete checkpoints retained per rank (older steps are retired and their pages reused).
        overwrite: replace this rank's committed step of the same number instead of refusing.
        cache_staging: for ``dcp.async_save``, keep the host staging copy and reuse it (the writer is
            DCP's ``AsyncStager``; see ``tierckpt.dcp.staging``). False: allocate it per save.
    """

    _synchronize_after_execute = False  # AsyncStager: staging is blocking, nothing to wait for later

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        job: str | None = None,
        step: int | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        keep: int = 2,
        overwrite: bool = False,
        cache_staging: bool = True,
    ) -> None:
        super().__init__()
        where = resolve(root=root, job=job, rank=rank, world_size=world_size, keep=keep)
        self.root, self.job, self.keep = where.root, where.job, where.keep
        self.step = None if step is None else require_step_id(step)
        self.overwrite = overwrite
        self._rank = rank
        self._world_size = world_size
        self.save_id = str(uuid.uuid4())
        self._save: _Save | None = None
        self._stores: dict[int, RankStore] = {}
        self._staging = StagingCache(reuse=cache_staging)
        self._template: Template | None = None
        """This rank's last write layout: the next async save stages straight into a slot laid out so."""
        self._staged: Staged | None = None
        self._spare: dict[str, torch.Tensor] = {}
        self.staged_in_place = False
        """Whether the last save's staging (``dcp.async_save``) went straight into the slot it committed."""

    def __getstate__(self) -> dict[str, Any]:
        # DCP's process-based async executor pickles the writer: mappings stay in this process.
        return {
            **self.__dict__,
            "_stores": {},
            "_save": None,
            "_staging": StagingCache(reuse=self._staging.reuse),
            "_template": None,
            "_staged": None,
            "_spare": {},
        }

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

    def close(self) -> None:
        """Unmap the data files kept for reuse (files stay; the next writer adopts them), drop staging."""
        self._release_staged()
        for store in self._stores.values():
            store.close()
        self._stores = {}
        self._staging.close()
        self._spare = {}

    # ------------------------------------------------------------------ AsyncStager (dcp.async_save)

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A training-safe copy of ``state_dict`` for ``dcp.async_save``: straight into the ramdisk slot the
        save will commit when the state is laid out like the last save (``tierckpt.dcp.inplace``), else
        into host buffers that are reused."""
        self._wait_for_previous()
        self._release_staged()
        if self._staging.reuse and self._template is not None:
            who = resolve(root=self.root, job=self.job, rank=self._rank, world_size=self._world_size)
            store = self._store_at(rank_dir(self.root, self.job, who.rank), who.rank)
            self._register_cuda(store)
            got = stage_into_slot(
                state_dict, self._template, lambda plan: store.take(_STAGING_STEP, plan), self._spare
            )
            if got is not None:
                staged, self._staged = got
                return staged
            log.info("rank %d: the state changed structure; staging into host buffers this time", who.rank)
        return self._staging.stage(state_dict)

    def _release_staged(self) -> None:
        """Give up a staged slot its save never wrote (the save failed before ``write_data``)."""
        staged, self._staged = self._staged, None
        if staged is not None:
            where = staged.slot.directory
            staged.slot.close(unlink=True)
            with contextlib.suppress(OSError):
                where.rmdir()

    def synchronize_staging(self) -> None:
        """Staging is blocking: nothing to wait for."""

    def __enter__(self) -> RamdiskWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ planning

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValueError("RamdiskWriter needs use_collectives=True (the coordinator writes the metadata)")
        if self.step is None:
            raise ValueError("no step to save: pass checkpoint_id=<step> to dcp.save, or step=")
        self._abandon_unfinished()
        who = resolve(root=self.root, job=self.job, rank=self._rank, world_size=self._world_size)
        path = step_dir(rank_dir(self.root, self.job, who.rank), self.step)
        path.parent.mkdir(parents=True, exist_ok=True)  # root and job too, like Checkpointer
        node = node_identity(path.parent)
        self._save = _Save(self.step, who.rank, who.world_size, bool(is_coordinator), path, node)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        save = self._current()
        if _committed(save.path):
            back = went_back_to(save.path.parent, current_status(self.root, self.job, save.rank), save.step)
            if back is None and not self.overwrite:
                raise FileExistsError(
                    f"rank {save.rank} already has a committed step {save.step} at {save.path}; "
                    "save under a new step, or pass overwrite=True to RamdiskWriter to replace it"
                )
            if save.step in leases.leased_steps(save.path.parent):
                raise FileExistsError(
                    f"step {save.step} of rank {save.rank} is leased (being read or copied): not overwriting"
                )
            if back is not None:
                log.warning(
                    "rank %d: replacing step %d, saved before the job went back to %s",
                    save.rank,
                    save.step,
                    "start afresh" if back == FRESH_START else f"step {back} (its restore)",
                )
        if not plan.usable:
            raise ValueError(_PLAN_CACHING)
        return dataclasses.replace(
            plan, storage_data=_LocalPlanData(save.rank, save.step, save.node, plan.items)
        )

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        save = self._current()
        infos = [p.storage_data for p in plans]
        if not all(p.usable and isinstance(i, _LocalPlanData) for p, i in zip(plans, infos, strict=True)):
            raise ValueError(_PLAN_CACHING)
        locals_ = [i for i in infos if isinstance(i, _LocalPlanData)]
        steps = {i.step for i in locals_}
        if len(steps) > 1:
            raise ValueError(f"ranks disagree on the step to save ({sorted(steps)}); pass one checkpoint_id")
        ranks = [i.rank for i in locals_]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"two processes save as the same rank (ranks {sorted(ranks)}); check rank=")
        nodes = [i.node for i in locals_]
        copies = add_node_copies([p.items for p in plans], [i.items for i in locals_], ranks, nodes)
        _, md = create_default_global_save_plan(plans, rewrite_index_hints=False)
        mappings = [p.planner_data for p in plans]
        if all(isinstance(m, dict) for m in mappings):
            md.planner_data = dict(ChainMap(*mappings))  # what DefaultSavePlanner records
        md.storage_meta = StorageMeta(checkpoint_id=str(save.step), save_id=self.save_id)
        md.version = _DCP_VERSION
        record = encode_metadata(
            md,
            copies.holders,
            job=self.job,
            step=save.step,
            world_size=save.world_size,
            coordinator=save.rank,
            save_id=self.save_id,
        )
        save.planned = (md, copies.holders)
        body = record.to_bytes()
        carrier: dict[str, int] = {}  # the lowest rank of each node writes the metadata there
        for i in sorted(range(len(plans)), key=lambda i: ranks[i]):
            carrier.setdefault(nodes[i], i)
        carriers = set(carrier.values())
        complete = tuple(s for s in committed_steps(save.path.parent) if s != save.step)
        log.debug(
            "DCP step %d: %d ranks on %d node(s); %d bytes of copies so every node holds its replicated "
            "items; %d bytes of metadata",
            save.step,
            len(plans),
            len(carrier),
            copies.added_bytes,
            len(body),
        )
        return [
            dataclasses.replace(
                p,
                items=copies.items[i],
                storage_data=_GlobalPlanData(
                    save.step, complete, self.save_id, body if i in carriers else None
                ),
            )
            for i, p in enumerate(plans)
        ]

    # ------------------------------------------------------------------ writing

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        save = self._current()
        info = plan.storage_data
        if getattr(planner, "_enable_plan_caching", False) or not (
            isinstance(info, _GlobalPlanData) and info.step == save.step
        ):
            raise ValueError(_PLAN_CACHING)
        save.save_id = info.save_id
        store = self._store(save)
        if save.path.exists():  # an uncommitted leftover, or a step we were told to overwrite
            if (stale := store.pool.slot_of(save.step)) is not None:
                store.forget(stale)
            discard_step(save.path)
        try:
            results = self._write_items(save, store, _layout_order(plan.items), planner)
            if info.metadata is not None:
                write_atomic(save.path / DCP_METADATA_NAME, info.metadata)
                save.files.append(FileEntry(DCP_METADATA_NAME, len(info.metadata), crc32c(info.metadata)))
                save.has_metadata = True
            if not save.is_coordinator:
                commit_step(save.path, self._manifest(save))
        except BaseException:
            if save.slot is not None:
                store.forget(save.slot)
            discard_step(save.path)
            raise
        if not save.is_coordinator:
            assert save.slot is not None
            store.committed(save.step, save.slot, info.complete)
            log.info("rank %d committed DCP step %d at %s", save.rank, save.step, save.path)
            self._save = None
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_items(
        self, save: _Save, store: RankStore, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        objects = {
            i: _object_bytes(it, planner.resolve_data(it)) for i, it in enumerate(items) if _is_object(it)
        }
        plan = plan_layout([_spec(it, objects.get(i)) for i, it in enumerate(items)])
        self._register_cuda(store)
        t0 = time.perf_counter()
        staged, self._staged = self._staged, None
        self.staged_in_place = staged is not None and staged.plan == plan
        if staged is not None and staged.plan == plan:  # staged in place: most bytes are there already
            placeholder = staged.slot.directory
            staged.slot.move_to(save.path)
            with contextlib.suppress(OSError):
                placeholder.rmdir()
            save.slot, plan, staged = staged.slot, staged.plan, None
        else:
            save.slot = store.take(save.step, plan)
        views = save.slot.views(plan)
        copied = _copy_items(views, items, planner, objects)
        if staged is not None:  # staged for another layout: its bytes were copied from it, it can go
            self._staged = staged
            self._release_staged()
        crcs, save.files = checksum_slot(plan, save.slot.files)
        for f in save.slot.files:
            f.sync()
        self._record(save, items, plan, crcs)
        self._template = Template(plan, tuple(it.index for it in items))
        log.debug(
            "rank %d wrote %d DCP items (%d bytes, %d copied here) in %.3fs",
            save.rank,
            len(items),
            plan.total_bytes,
            copied,
            time.perf_counter() - t0,
        )
        return [
            WriteResult(
                index=it.index,
                size_in_bytes=p.length,
                storage_data=ItemLocation(save.rank, plan.files[p.file].name, p.offset, p.length, crc),
            )
            for it, p, crc in zip(items, plan.placements, crcs, strict=True)
        ]

    @staticmethod
    def _register_cuda(store: RankStore) -> None:
        if not store.pool.register_cuda and cuda.available() and torch.cuda.is_initialized():
            store.pool.register_cuda = True  # device tensors copy straight into pinned ramdisk pages
            store.pool.register_all()

    def _record(self, save: _Save, items: list[WriteItem], plan: LayoutPlan, crcs: list[int]) -> None:
        save.objects = [i for i, it in enumerate(items) if _is_object(it)]
        save.tensors = [
            TensorEntry(spec.key, spec.dtype, spec.shape, plan.files[p.file].name, p.offset, p.length, crc)
            for spec, p, crc in zip(plan.specs, plan.placements, crcs, strict=True)
        ]

    def _manifest(self, save: _Save) -> Manifest:
        extra: dict[str, Any] = {
            "version": DCP_FORMAT_VERSION,
            "coordinator": save.is_coordinator,
            "save_id": save.save_id,
            "node": save.node,
            "objects": save.objects,
        }
        if save.has_metadata:
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
        metadata.storage_meta = self.storage_meta()
        metadata.version = _DCP_VERSION
        store = self._store(save)
        try:
            _check_finished(save, metadata, results)
            commit_step(save.path, self._manifest(save))
        except BaseException:
            if save.slot is not None:
                store.forget(save.slot)
            discard_step(save.path)
            raise
        assert save.slot is not None
        store.committed(save.step, save.slot, committed_steps(save.path.parent))
        log.info(
            "coordinator rank %d committed DCP step %d (%d entries, %d items from %d ranks) at %s",
            save.rank,
            save.step,
            len(metadata.state_dict_metadata),
            sum(len(r) for r in results),
            len(results),
            save.path,
        )
        self._save = None

    def _store(self, save: _Save) -> RankStore:
        return self._store_at(save.path.parent, save.rank)

    def _store_at(self, rank_path: Path, rank: int) -> RankStore:
        if rank not in self._stores:
            self._stores[rank] = RankStore(rank_path, keep=self.keep)
        return self._stores[rank]

    def _wait_for_previous(self) -> None:
        """Refuse to start while the previous save still runs on another thread (after a short grace)."""
        prev = self._save
        if prev is not None and prev.owner is not threading.current_thread():
            prev.owner.join(timeout=_OVERLAP_GRACE)
            if prev.owner.is_alive():
                raise SaveInProgressError(
                    f"step {prev.step} is still being saved through this writer on thread {prev.owner.name}; "
                    "wait for its async_save future before starting the next save"
                )

    def _abandon_unfinished(self) -> None:
        """Forget the previous save: refuse if it still runs on another thread; if it was the coordinator's
        and never reached ``finish`` (another rank failed), remove its step."""
        self._wait_for_previous()
        prev, self._save = self._save, None
        if prev is not None and prev.is_coordinator and prev.path.exists() and not _committed(prev.path):
            log.warning("removing DCP step %d of rank %d: its save did not finish", prev.step, prev.rank)
            if prev.slot is not None:
                self._store(prev).forget(prev.slot)
            discard_step(prev.path)

    def _current(self) -> _Save:
        if self._save is None:
            raise RuntimeError("RamdiskWriter used outside dcp.save (set_up_storage_writer was not called)")
        return self._save


_PLAN_CACHING = (
    "RamdiskWriter needs a fresh global plan on every save (the coordinator records which node holds "
    "what, and hands the metadata to every node): DefaultSavePlanner(enable_plan_caching=True) is not "
    "supported"
)


def _check_finished(save: _Save, metadata: Metadata, results: list[list[WriteResult]]) -> None:
    """The checkpoint is the one planned: DCP's metadata equals the metadata every node already holds,
    every item was written by exactly its planned holders, and every copy of an item has the same bytes."""
    if save.planned is None:
        raise RuntimeError("finish without a global plan from this coordinator")
    planned, holders = save.planned
    if metadata.state_dict_metadata != planned.state_dict_metadata:
        fqn = next(
            (k for k, v in metadata.state_dict_metadata.items() if planned.state_dict_metadata.get(k) != v),
            "(an entry DCP dropped)",
        )
        raise FormatError(
            f"DCP step {save.step}: DCP's metadata for {fqn!r} differs from the one planned and written on "
            "every node (a planner that changes the metadata after planning is not supported)"
        )
    if metadata.planner_data != planned.planner_data:
        raise FormatError(
            f"DCP step {save.step}: DCP's planner data differs from the one written on every node"
        )
    written: dict[MetadataIndex, list[ItemLocation]] = {}
    for rank_results in results:
        for wr in rank_results:
            written.setdefault(wr.index, []).append(wr.storage_data)
    if written.keys() != holders.keys():
        raise FormatError(f"DCP step {save.step}: the items written are not the items planned")
    for index, locs in written.items():
        if sorted(loc.rank for loc in locs) != sorted(holders[index]):
            raise FormatError(
                f"DCP step {save.step}: {item_key(index)!r} was not written by its planned ranks"
            )
        if len(locs) > 1 and len({loc.crc32c for loc in locs}) > 1:
            ranks = sorted(loc.rank for loc in locs)
            raise FormatError(
                f"DCP step {save.step}: {item_key(index)!r} is held by ranks {ranks} with different bytes. "
                "DCP saves a key held by several ranks once, assuming it is the same everywhere; keep "
                "state that differs between ranks under keys of its own"
            )


def _committed(path: Path) -> bool:
    try:
        return read_commit(path) is not None
    except Exception:  # a corrupt marker is no step: it may be replaced
        return False


def _is_object(item: WriteItem) -> bool:
    return item.type == WriteItemType.BYTE_IO


def _object_bytes(item: WriteItem, data: Any) -> bytes:
    if not isinstance(data, io.BytesIO):
        raise TypeError(f"planner resolved object item {item.index.fqn!r} to a {type(data).__name__}")
    return data.getvalue()


def _spec(item: WriteItem, data: bytes | None) -> TensorSpec:
    if data is not None:
        return TensorSpec(item_key(item.index), "uint8", (len(data),))
    td = item.tensor_data
    if td is None:
        raise ValueError(f"write item {item.index.fqn!r} has no tensor data")
    return TensorSpec(item_key(item.index), tensor_dtype_name(td.properties.dtype), tuple(td.chunk.sizes))


def _tensor_source(item: WriteItem, data: Any) -> torch.Tensor:
    td = item.tensor_data
    assert td is not None
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"planner resolved tensor item {item.index.fqn!r} to a {type(data).__name__}")
    if data.dtype != td.properties.dtype or tuple(data.shape) != tuple(td.chunk.sizes):
        raise ValueError(
            f"planner resolved {item_key(item.index)!r} to {data.dtype} {tuple(data.shape)}, "
            f"planned {td.properties.dtype} {tuple(td.chunk.sizes)}"
        )
    return data.detach()


def _layout_order(items: list[WriteItem]) -> list[WriteItem]:
    """Tensors first, then objects (each group in plan order): an object whose pickled size changes from
    save to save then moves no tensor, and the next async save can stage every tensor in place."""
    return [it for it in items if not _is_object(it)] + [it for it in items if _is_object(it)]


def _copy_items(
    views: list[torch.Tensor], items: list[WriteItem], planner: SavePlanner, objects: dict[int, bytes]
) -> int:
    """Resolve items lazily, in batches, and copy each into its view of the mapped data file, unless it is
    that view already (staged in place). Returns the bytes copied."""
    batch_views: list[torch.Tensor] = []
    batch_srcs: list[torch.Tensor] = []
    batch_bytes = copied = 0
    for i, (view, item) in enumerate(zip(views, items, strict=True)):
        if i in objects:
            src = torch.frombuffer(bytearray(objects.pop(i)), dtype=torch.uint8) if view.numel() else view
        else:
            src = _tensor_source(item, planner.resolve_data(item))
        if not _in_place(src, view):
            batch_views.append(view)
            batch_srcs.append(src)
            batch_bytes += view.numel() * view.element_size()
        if batch_views and (batch_bytes >= _COPY_BATCH or i == len(items) - 1):
            ticket = copy_into(batch_views, batch_srcs)
            if ticket is not None:
                ticket.synchronize()
            copied += batch_bytes
            batch_views, batch_srcs, batch_bytes = [], [], 0
    return copied


def _in_place(src: torch.Tensor, view: torch.Tensor) -> bool:
    return (
        src.device.type == "cpu"
        and src.data_ptr() == view.data_ptr()
        and src.dtype == view.dtype
        and src.shape == view.shape
        and src.is_contiguous()
    )
