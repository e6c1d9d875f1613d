"""``RamdiskReader``: a DCP ``StorageReader`` over DCP steps in the tierckpt ramdisk format.

DCP's call order, and what each call does here:

1. (all ranks) ``reset(checkpoint_id)``: the step to load (None: the newest complete one found here).
2. (all ranks) ``read_metadata``: find the coordinator's committed step (primary or replica copy), check
   ``dcp-metadata.json`` against its manifest, decode it into DCP's ``Metadata``.
3. (all ranks) ``set_up_storage_reader``; 4./5. planning needs nothing from storage.
6. (all ranks) ``read_data``: for each item, open (and lease) the writing rank's committed step (under
   ``<root>/<job>/rank-NNNNN`` or ``<root>/<job>/replicas/rank-NNNNN``), map the data file, verify the
   item's crc32c, and copy its bytes once into the destination tensor (resharding through DCP's plan).

Any rank's data may be read by any rank: loading under a different world size reads other ranks' chunks.
A crc mismatch raises ``CorruptShardError`` naming the item and the file (DCP wraps it in its
``CheckpointException``; see ``docs/dcp.md``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt.protocol import leases
from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError
from tierckpt.protocol.format import (
    DCP_METADATA_NAME,
    Manifest,
    committed_steps,
    job_dir,
    rank_dir,
    ranks_in,
    read_commit,
    read_manifest,
    replica_rank_dir,
)
from tierckpt.protocol.integrity import crc32c, crc32c_address
from tierckpt.settings import resolve
from tierckpt.snapshot.shardfile import MappedFile

from ._paths import find_rank_step, parse_step_id, require_step_id
from .metadata import DcpMetadata, ItemLocation, decode_metadata
from .writer import item_key

__all__ = ["RamdiskReader", "dcp_steps"]

log = logging.getLogger(__name__)


def _all_rank_dirs(root: Path, job: str) -> list[Path]:
    base = job_dir(root, job)
    primaries = [rank_dir(root, job, r) for r in ranks_in(base)]
    return primaries + [replica_rank_dir(root, job, r) for r in ranks_in(base / "replicas")]


def dcp_steps(root: str | os.PathLike[str], job: str) -> list[int]:
    """Steps (newest first) for which some rank on this root holds a committed step; candidates only."""
    steps: set[int] = set()
    for d in _all_rank_dirs(Path(root), job):
        steps.update(committed_steps(d))
    return sorted(steps, reverse=True)


class _RankStep:
    """One writing rank's committed step, checked against the checkpoint's metadata when opened."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self._checked: set[str] = set()

    def open(self, name: str, *, needed: int) -> MappedFile:
        """Map a data file; fault it all in up front when at least half of it (``needed`` bytes) is read."""
        size = self.manifest.file(name).size
        mapped = MappedFile.open(self.path / name, writable=False, populate=2 * needed >= size)
        if name not in self._checked:
            entry = self.manifest.file(name)
            if mapped.size != entry.size:
                mapped.close()
                raise CorruptShardError(
                    f"{mapped.path}: {mapped.size} bytes on disk, its manifest says {entry.size} (corrupt)",
                    path=str(mapped.path),
                )
            self._checked.add(name)
        return mapped


class RamdiskReader(StorageReader):
    """Load a DCP checkpoint saved by ``RamdiskWriter`` from the node ramdisk.

    Args:
        root: the ramdisk root (default ``$TIERCKPT_ROOT``).
        job: the job id (default ``$TIERCKPT_JOB``, else ``"local"``).
        step: the step to load; ``dcp.load(..., checkpoint_id=step)`` sets it per load. None loads the
            newest step whose metadata and data are all present on this root (on several nodes, pass
            the step explicitly so every rank loads the same one).
    """

    def __init__(
        self, root: str | os.PathLike[str] | None = None, job: str | None = None, step: int | None = None
    ) -> None:
        super().__init__()
        where = resolve(root=root, job=job)
        self.root, self.job = where.root, where.job
        self.requested_step = None if step is None else require_step_id(step)
        """The step asked for (None: the newest complete one); ``step`` is the one the last load resolved."""
        self.step = self.requested_step
        self.load_id = str(uuid.uuid4())
        self._record: DcpMetadata | None = None
        self._storage: dict[MetadataIndex, ItemLocation] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}
        self._steps: dict[int, _RankStep] = {}
        self._manifests: dict[Path, Manifest] = {}

    # ------------------------------------------------------------------ identity

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return parse_step_id(checkpoint_id) is not None

    @property
    def checkpoint_id(self) -> str | None:
        return None if self.requested_step is None else str(self.requested_step)

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        if checkpoint_id is not None:
            self.requested_step = require_step_id(checkpoint_id)
        self.load_id = str(uuid.uuid4())

    # ------------------------------------------------------------------ metadata

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP must not fall back to rank-local metadata
        self._record, self._storage, self._chunks, self._steps, self._manifests = None, {}, {}, {}, {}
        if self.requested_step is not None:
            record = self._load_record(self.requested_step)
        else:
            record = self._newest_complete_record()
        self.step, self._record = record.step, record
        metadata = decode_metadata(record)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _coordinator_step(self, step: int) -> tuple[Path, Manifest]:
        """The committed step (primary or replica) that carries the DCP metadata of ``step``."""
        seen = False
        for d in _all_rank_dirs(self.root, self.job):
            path = d / f"step-{step:012d}"
            try:
                if read_commit(path) is None:
                    continue
                manifest = self._manifest(path)
            except FormatError as exc:
                log.warning("skipping %s while looking for DCP metadata: %s", path, exc)
                continue
            seen = True
            if manifest.manifest_kind == "dcp" and manifest.extra.get("dcp", {}).get("metadata"):
                return path, manifest
        where = job_dir(self.root, self.job)
        if seen:
            raise MissingCheckpointError(
                f"step {step} under {where} has no committed DCP metadata: the coordinator's (rank 0's) step "
                "is not on this node, its save did not finish, or it is not a DCP checkpoint"
            )
        raise MissingCheckpointError(f"no committed step {step} under {where}")

    def _manifest(self, path: Path) -> Manifest:
        """A committed step's manifest, read once per load."""
        if path not in self._manifests:
            self._manifests[path] = read_manifest(path)
        return self._manifests[path]

    def _load_record(self, step: int) -> DcpMetadata:
        path, manifest = self._coordinator_step(step)
        entry = manifest.file(DCP_METADATA_NAME)
        file = path / DCP_METADATA_NAME
        body = file.read_bytes()
        mapped_crc = crc32c(body)
        if len(body) != entry.size or mapped_crc != entry.crc32c:
            raise CorruptShardError(
                f"{file}: {len(body)} bytes with crc32c {mapped_crc:08x}, its manifest says "
                f"{entry.size} bytes with crc32c {entry.crc32c:08x} (corrupt)",
                path=str(file),
            )
        record = DcpMetadata.from_bytes(body)
        if record.step != step or record.job != self.job:
            raise FormatError(
                f"{file}: metadata of job {record.job!r} step {record.step}, not {self.job!r} {step}"
            )
        return record

    def _newest_complete_record(self) -> DcpMetadata:
        for step in dcp_steps(self.root, self.job):
            try:
                record = self._load_record(step)
            except MissingCheckpointError:
                continue
            missing = [
                r for r in record.ranks_with_data if find_rank_step(self.root, self.job, r, step) is None
            ]
            if not missing:
                return record
            log.info("DCP step %d is incomplete here (ranks %s missing); trying older steps", step, missing)
        raise MissingCheckpointError(f"no complete DCP checkpoint under {job_dir(self.root, self.job)}")

    # ------------------------------------------------------------------ planning

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise FormatError("DCP metadata has no storage data: it was not saved by RamdiskWriter")
        self._storage = metadata.storage_data
        self._chunks = {
            (fqn, tuple(c.offsets)): (c.sizes, md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for c in md.chunks
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # ------------------------------------------------------------------ reading

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[tuple[int, str], list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            loc = self._location(req)
            by_file[(loc.rank, loc.file)].append(req)
        with contextlib.ExitStack() as leased:
            held: set[int] = set()
            for (rank, name), reqs in sorted(by_file.items()):
                step = self._rank_step(rank)
                if rank not in held:
                    held.add(rank)
                    _hold_lease(leased, step.path)
                needed = sum(
                    {(loc := self._storage[r.storage_index]).offset: loc.length for r in reqs}.values()
                )
                mapped = step.open(name, needed=needed)
                try:
                    verified: set[MetadataIndex] = set()
                    for req in sorted(reqs, key=lambda r: self._storage[r.storage_index].offset):
                        self._read_item(req, mapped, verified, planner)
                finally:
                    mapped.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _location(self, req: ReadItem) -> ItemLocation:
        try:
            return self._storage[req.storage_index]
        except KeyError:
            raise FormatError(
                f"item {item_key(req.storage_index)!r} is not in the checkpoint's metadata"
            ) from None

    def _rank_step(self, rank: int) -> _RankStep:
        if rank in self._steps:
            return self._steps[rank]
        assert self._record is not None and self.step is not None
        path = find_rank_step(self.root, self.job, rank, self.step)
        if path is None:
            raise MissingCheckpointError(
                f"rank {rank}'s step {self.step} is not on this node (not in "
                f"{rank_dir(self.root, self.job, rank)} nor among replicas): "
                "loading this DCP checkpoint needs that rank's data here (docs/dcp.md)"
            )
        manifest = self._manifest(path)
        want = self._record.ranks.get(rank)
        marker = read_commit(path)
        if manifest.manifest_kind != "dcp" or (
            want is not None and marker and marker.manifest_crc32c != want
        ):
            raise FormatError(
                f"{path} is not the step rank {rank} wrote for this DCP checkpoint (rewritten since?)"
            )
        self._steps[rank] = _RankStep(path, manifest)
        return self._steps[rank]

    def _read_item(
        self, req: ReadItem, mapped: MappedFile, verified: set[MetadataIndex], planner: LoadPlanner
    ) -> None:
        loc = self._storage[req.storage_index]
        key = item_key(req.storage_index)
        if loc.offset + loc.length > mapped.size:
            raise CorruptShardError(
                f"{mapped.path}: item {key!r} runs past the end of the file", path=str(mapped.path), key=key
            )
        region = mapped.buffer[loc.offset : loc.offset + loc.length]
        if req.storage_index not in verified:
            actual = crc32c_address(region.data_ptr(), loc.length) if loc.length else 0
            if actual != loc.crc32c:
                raise CorruptShardError(
                    f"{mapped.path}: item {key!r} (bytes {loc.offset}..{loc.offset + loc.length}) has crc32c "
                    f"{actual:08x}, expected {loc.crc32c:08x}: the shard is corrupt",
                    path=str(mapped.path),
                    key=key,
                )
            verified.add(req.storage_index)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(region.numpy().tobytes()))
            return
        self._load_tensor(req, region, planner)

    def _load_tensor(self, req: ReadItem, region: torch.Tensor, planner: LoadPlanner) -> None:
        index = req.storage_index
        sizes, dtype = self._chunks[(index.fqn, tuple(index.offset or ()))]
        if region.numel() != sizes.numel() * dtype.itemsize:
            raise FormatError(
                f"item {item_key(index)!r}: {region.numel()} bytes do not hold {dtype} {tuple(sizes)}"
            )
        src = narrow_tensor_by_index(region.view(dtype).reshape(sizes), req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != src.size():
            raise FormatError(
                f"item {item_key(index)!r}: stored slice {tuple(src.size())} does not fit "
                f"destination {tuple(target.size())}"
            )
        target.copy_(src)
        planner.commit_tensor(req, target)


def _hold_lease(stack: contextlib.ExitStack, path: Path) -> None:
    """Lease a step while this rank reads it, so retention elsewhere cannot remove it under us."""
    step = parse_step_id(path.name)
    assert step is not None
    try:
        stack.enter_context(leases.hold(path.parent, step, f"dcp-load-{os.getpid()}"))
    except (OSError, MissingCheckpointError) as exc:  # e.g. a read-only copy: reading is still safe
        log.warning("reading %s without a lease: %s", path, exc)
