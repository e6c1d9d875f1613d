"""``RamdiskReader``: a DCP ``StorageReader`` over DCP steps in the tierckpt ramdisk format.

DCP's call order, and what each call does here:

1. (all ranks) ``reset(checkpoint_id)``: the step to load (None: the newest one every rank can load).
2. (all ranks) ``read_metadata``: without a step, agree with the other ranks on the newest step that
   every rank's node holds whole and undamaged (``tierckpt.dcp.choice``: older steps when the newest is
   not). Find a committed step of the checkpoint that carries its metadata on this node (one rank of
   every node writes it; primary or replica copy), check ``dcp-metadata.json`` against that step's
   manifest, decode it into DCP's ``Metadata``.
3. (all ranks) ``set_up_storage_reader``: raise what went wrong in ``read_metadata`` (see there).
4. (all ranks) ``prepare_local_plan``: for every item this rank reads, pick a rank holding it whose step
   is on this node as the checkpoint's save wrote it (the writer DCP chose, or a copy). Items that no
   rank of this node holds (a reshard across nodes, a node that lost its copies, or one that holds only
   another save of the step) are fetched first: the reader asks the node's replicator for those ranks'
   steps of the save (``tierckpt.dcp.fetch``) and waits.
5. (all ranks) ``read_data``: for each item, open (and lease) the holding rank's committed step (under
   ``<root>/<job>/rank-NNNNN`` or ``<root>/<job>/replicas/rank-NNNNN``), find the item in its manifest,
   map the data file, verify the item's crc32c, and copy its bytes once into the destination tensor
   (resharding through DCP's plan).

A crc mismatch, or a data file that is missing or of another size than its manifest says, raises
``CorruptShardError`` naming the item and the file (DCP wraps it in its ``CheckpointException``; see
``docs/dcp.md``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from tierckpt import cuda
from tierckpt.protocol import leases
from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError
from tierckpt.protocol.format import (
    DCP_METADATA_NAME,
    Manifest,
    TensorEntry,
    committed_steps,
    dcp_save_id,
    job_dir,
    rank_dir,
    ranks_in,
    read_commit,
    read_manifest,
    replica_rank_dir,
)
from tierckpt.protocol.integrity import crc32c
from tierckpt.settings import resolve
from tierckpt.snapshot import agree, upload
from tierckpt.snapshot.checksum import region_crcs
from tierckpt.snapshot.copy import memmove
from tierckpt.snapshot.dtypes import torch_dtype
from tierckpt.snapshot.shardfile import MappedFile
from tierckpt.verify import verify_file

from ._node import node_identity
from ._paths import find_rank_step, parse_step_id, rank_step_copies, require_step_id
from ._store import live_mapping
from .choice import NodeShare, newest_loadable
from .fetch import fetch_rank_steps
from .metadata import DcpMetadata, decode_metadata, item_holders
from .writer import item_key

__all__ = ["RamdiskReader", "dcp_steps"]

log = logging.getLogger(__name__)


class _Decoded:
    """The metadata bodies this process decoded last, by content: validating a body (``DcpMetadata``)
    and building torch's ``Metadata`` from it cost about 0.1 s per 1,000 tensors, at every load of the
    same step (the profile of a DCP load of 1,560 tensors on a CPU: most of its time). A body read again
    is checked (its crc32c against the manifest, by the caller) and compared byte for byte with the one
    decoded; each load gets its own ``Metadata`` container (DCP sets its ``storage_meta.load_id``) over
    shared, unmodified entries."""

    def __init__(self, capacity: int = 4) -> None:
        self._capacity = capacity
        self._items: collections.OrderedDict[int, tuple[bytes, DcpMetadata, Metadata]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def record(self, body: bytes) -> DcpMetadata:
        key = crc32c(body)
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and hit[0] == body:
                self._items.move_to_end(key)
                return hit[1]
        record = DcpMetadata.from_bytes(body)
        metadata = decode_metadata(record)
        with self._lock:
            self._items[key] = (body, record, metadata)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)
        return record

    def metadata(self, record: DcpMetadata) -> Metadata:
        with self._lock:
            shared = next((m for _, r, m in self._items.values() if r is record), None)
        if shared is None:
            return decode_metadata(record)
        sm = shared.storage_meta
        return Metadata(
            state_dict_metadata=dict(shared.state_dict_metadata),
            planner_data=shared.planner_data,
            storage_data=dict(shared.storage_data),
            storage_meta=None if sm is None else dataclasses.replace(sm, modules=list(sm.modules)),
            version=shared.version,
        )


_DECODED = _Decoded()


def _all_rank_dirs(root: Path, job: str) -> list[Path]:
    base = job_dir(root, job)
    primaries = [rank_dir(root, job, r) for r in ranks_in(base)]
    return primaries + [replica_rank_dir(root, job, r) for r in ranks_in(base / "replicas")]


def dcp_steps(root: str | os.PathLike[str], job: str) -> list[int]:
    """Steps (newest first) for which some rank on this root holds a committed step; candidates only.
    Which step to load on several nodes is ``tierckpt.dcp.agreed_step``'s answer, not this node's list."""
    steps: set[int] = set()
    for d in _all_rank_dirs(Path(root), job):
        steps.update(committed_steps(d))
    return sorted(steps, reverse=True)


class _RankStep:
    """One holding rank's committed step, checked against the checkpoint's metadata when opened."""

    def __init__(self, path: Path, step: int, manifest: Manifest) -> None:
        self.path = path
        self.step = step
        self.manifest = manifest
        self.entries: dict[str, TensorEntry] = {t.key: t for t in manifest.tensors}
        self.index: dict[str, int] = {t.key: i for i, t in enumerate(manifest.tensors)}
        self._checked: set[str] = set()

    def views(self, mapped: MappedFile) -> list[torch.Tensor]:
        """Typed views of this step's items (those of ``mapped``'s file are backed by it; the others are
        empty placeholders), indexed like the manifest's tensors."""
        empty = torch.empty(0, dtype=torch.uint8)
        out = []
        for t in self.manifest.tensors:
            if t.file != mapped.path.name:
                out.append(empty)
                continue
            raw = mapped.buffer[t.offset : t.offset + t.length]
            out.append(raw.view(torch_dtype(t.dtype)).view(t.shape))
        return out

    def entry(self, key: str) -> TensorEntry:
        try:
            return self.entries[key]
        except KeyError:
            raise FormatError(f"{self.path}: item {key!r} is not in this step's manifest") from None

    def open(self, name: str, *, needed: int) -> tuple[MappedFile, bool]:
        """A data file's mapping, and whether the caller closes it: the one a writer of this process
        keeps (pinned and faulted in already: borrowed), else a new one, faulted in up front when at
        least half of it (``needed`` bytes) is read."""
        size = self.manifest.file(name).size
        live = live_mapping(self.path.parent, self.step, name)
        if live is not None:
            self._check_size(live, name)
            return live, False
        try:
            mapped = MappedFile.open(self.path / name, writable=False, populate=2 * needed >= size)
        except FileNotFoundError:
            path = self.path / name
            raise CorruptShardError(f"{path}: missing (its manifest lists it)", path=str(path)) from None
        try:
            self._check_size(mapped, name)
        except CorruptShardError:
            mapped.close()
            raise
        return mapped, True

    def _check_size(self, mapped: MappedFile, name: str) -> None:
        if name not in self._checked:
            entry = self.manifest.file(name)
            if mapped.size != entry.size:
                raise CorruptShardError(
                    f"{mapped.path}: {mapped.size} bytes on disk, its manifest says {entry.size} (corrupt)",
                    path=str(mapped.path),
                )
            self._checked.add(name)


class RamdiskReader(StorageReader):
    """Load a DCP checkpoint saved by ``RamdiskWriter`` from the node ramdisk.

    Args:
        root: the ramdisk root (default ``$TIERCKPT_ROOT``).
        job: the job id (default ``$TIERCKPT_JOB``, else ``"local"``).
        step: the step to load; ``dcp.load(..., checkpoint_id=step)`` sets it per load. None loads the
            newest step that every rank's node holds whole (the metadata and a copy of every item) and
            undamaged: the ranks agree on it (``tierckpt.dcp.choice``), falling back together past a
            step with a missing, short or corrupt file on any node (logged), and raise
            ``CorruptShardError`` when no step is left. With sharded state on several nodes no node
            holds every item: pass the step ``tierckpt.dcp.agreed_step()`` returns instead.
        fetch: ask the node's replicator for steps of other ranks this load needs and this node lacks
            (default: when a replicator is configured, ``$TIERCKPT_REPLICATOR_URL``). False: such a
            load fails with ``MissingCheckpointError`` naming the ranks.
        process_group: the process group ``dcp.load`` runs on (default: the default group), whose ranks
            agree on the step when none is given.
        collective: False: without a step, this process decides alone (for a load by one process in a
            distributed program, ``dcp.load(..., no_dist=True)``); every rank of ``process_group`` must
            load otherwise.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        job: str | None = None,
        step: int | None = None,
        *,
        fetch: bool | None = None,
        process_group: Any = None,
        collective: bool = True,
    ) -> None:
        super().__init__()
        where = resolve(root=root, job=job)
        self.root, self.job, self.rank = where.root, where.job, where.rank
        self.fetch = bool(where.replicator_url) if fetch is None else fetch
        self.process_group = process_group
        self.collective = collective
        self.stall_timeout = where.restore_wait
        self._staging = upload.RestoreStaging()
        """Device staging of the small items loaded to a GPU (kept for the next load of the same step)."""
        self.requested_step = None if step is None else require_step_id(step)
        """The step asked for (None: the newest loadable one); ``step`` is the one the last load resolved."""
        self.step = self.requested_step
        self.load_id = str(uuid.uuid4())
        self.fetched: tuple[int, ...] = ()
        """Ranks whose step the last load had the replicator bring to this node."""
        self.bytes_read = 0
        """Stored bytes the last load read (each item once)."""
        self.fetched_bytes = 0
        """Bytes the replicator reported moving for the last load's requests (0: nothing fetched)."""
        self.fetch_seconds = 0.0
        """Time the last load waited for its requests to be answered."""
        self._record: DcpMetadata | None = None
        self._holders: dict[MetadataIndex, tuple[int, ...]] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.Size, torch.dtype]] = {}
        self._steps: dict[tuple[int, int], _RankStep] = {}
        self._manifests: dict[Path, Manifest] = {}
        self._present: dict[tuple[int, int], Path | None] = {}
        self._chosen: dict[MetadataIndex, int] = {}
        self._failure: Exception | None = None

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
        """The checkpoint's metadata. What goes wrong is raised by ``set_up_storage_reader``: DCP turns an
        exception of ``read_metadata`` into an ``AssertionError`` that only quotes it ("metadata is None"),
        while one of ``set_up_storage_reader`` reaches the caller as itself (a ``CorruptShardError``, a
        ``MissingCheckpointError``), in ``CheckpointException.failures`` on every rank."""
        self._record, self._holders, self._chunks, self._steps = None, {}, {}, {}
        self._manifests, self._present, self._chosen, self.fetched, self.bytes_read = {}, {}, {}, (), 0
        self.fetched_bytes, self.fetch_seconds, self._failure = 0, 0.0, None
        try:
            if self.requested_step is not None:
                record = self._load_record(self.requested_step)
            else:
                record = self._agreed_record()
        except Exception as exc:
            self._failure = exc
            return Metadata(state_dict_metadata={})
        self.step, self._record = record.step, record
        metadata = _DECODED.metadata(record)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _metadata_step(self, step: int) -> tuple[Path, Manifest] | None:
        """A committed step of ``step`` on this root (any rank, primary or replica) carrying the metadata."""
        for d in _all_rank_dirs(self.root, self.job):
            path = d / f"step-{step:012d}"
            try:
                if not (path / DCP_METADATA_NAME).exists() or read_commit(path) is None:
                    continue
                manifest = self._manifest(path)
            except FormatError as exc:
                log.warning("skipping %s while looking for DCP metadata: %s", path, exc)
                continue
            if manifest.manifest_kind == "dcp" and manifest.extra.get("dcp", {}).get("metadata"):
                return path, manifest
        return None

    def _metadata_carrier(self, step: int, *, fetch: bool) -> tuple[Path, Manifest]:
        """The step carrying the metadata of ``step``; fetched (rank 0's, which always carries it) when
        this node has none and ``fetch``."""
        found = self._metadata_step(step)
        if found is None and fetch:
            self._fetch([0], step)
            found = self._metadata_step(step)
        if found is not None:
            return found
        where = job_dir(self.root, self.job)
        if step in dcp_steps(self.root, self.job):
            raise MissingCheckpointError(
                f"step {step} under {where} has no committed DCP metadata on this node: its save did not "
                "finish, it is not a DCP checkpoint, or the ranks carrying it are on other nodes"
            )
        raise MissingCheckpointError(f"no committed step {step} under {where}")

    def _manifest(self, path: Path) -> Manifest:
        """A committed step's manifest, read once per load."""
        if path not in self._manifests:
            self._manifests[path] = read_manifest(path)
        return self._manifests[path]

    def _load_record(self, step: int, *, fetch: bool = True) -> DcpMetadata:
        path, manifest = self._metadata_carrier(step, fetch=fetch and self.fetch)
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
        record = _DECODED.record(body)
        if record.step != step or record.job != self.job:
            raise FormatError(
                f"{file}: metadata of job {record.job!r} step {record.step}, not {self.job!r} {step}"
            )
        return record

    def _agreed_record(self) -> DcpMetadata:
        """The metadata of the newest step every rank can load from its node (``choice.newest_loadable``)."""
        records: dict[int, DcpMetadata] = {}

        def check(step: int, share: NodeShare) -> None:
            records[step] = self._check_here(step, share)

        base = job_dir(self.root, self.job)
        # ranks reading the same job directory split its crc checks; without one there is nothing to check
        node = f"{node_identity(base)}:{base.resolve()}" if base.is_dir() else f"none:{self.rank}"
        gather = functools.partial(agree.all_gather, group=self.process_group) if self.collective else _alone
        step = newest_loadable(
            dcp_steps(self.root, self.job), check, rank=self.rank, node=node, gather=gather, where=str(base)
        )
        return records[step]

    def _check_here(self, step: int, share: NodeShare) -> DcpMetadata:
        """``step``'s metadata, if this node holds the step whole: the metadata, a committed step of a holder
        of every item (the one a load reads), and, for this rank's share of the data files those items are
        in, the whole file at its manifest's size and crc32c (``verify_file``). Raises what is wrong."""
        record = self._load_record(step, fetch=False)
        files: dict[tuple[Path, str], _RankStep] = {}
        missing: list[str] = []
        for entry in record.entries:
            for index, holders in item_holders(entry).items():
                rank = next((r for r in holders if self._where(r, step, record) is not None), None)
                if rank is None:
                    missing.append(item_key(index))
                    continue
                held = self._rank_step(rank, step, record)
                files.setdefault((held.path, held.entry(item_key(index)).file), held)
        if missing:
            raise MissingCheckpointError(
                f"step {step}: no rank holding {missing[:3]}{' and more' if len(missing) > 3 else ''} has "
                f"its step on this node ({len(missing)} item(s) missing)"
            )
        for (path, name), held in share.of(sorted(files.items(), key=lambda kv: kv[0])):
            verify_file(path, held.manifest, held.manifest.file(name))
        return record

    # ------------------------------------------------------------------ planning

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        if not isinstance(metadata.storage_data, dict):
            raise FormatError("DCP metadata has no storage data: it was not saved by RamdiskWriter")
        self._holders = metadata.storage_data
        self._chunks = {
            (fqn, tuple(c.offsets)): (c.sizes, md.properties.dtype)
            for fqn, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
            for c in md.chunks
        }

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Pick a holder on this node for every item this rank reads; fetch those this node lacks."""
        self._choose(plan.items, fetch=self.fetch)
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _where(self, rank: int, step: int, record: DcpMetadata | None = None) -> Path | None:
        """Rank ``rank``'s committed ``step`` on this node: with the checkpoint's ``record`` (default: the
        one being loaded) the copy it names, the primary else a replica (a primary the run a job left
        saved may stand beside a replica of this save). A copy of another save is not the rank's step:
        None when only such copies are here (a load fetches the save's, naming it), unless the record
        names no save (then the first copy, which ``_rank_step`` refuses clearly); without a record the
        first copy. Looked up once a load."""
        record = record or self._record
        if record is None:
            return find_rank_step(self.root, self.job, rank, step)
        if (rank, step) not in self._present:
            copies = rank_step_copies(self.root, self.job, rank, step)
            named = next((path for path in copies if self._is_save(path, record)), None)
            fallback = None if record.save_id or not copies else copies[0]
            self._present[(rank, step)] = named or fallback
        return self._present[(rank, step)]

    def _is_save(self, path: Path, record: DcpMetadata) -> bool:
        """Whether the rank step at ``path`` is the one written for ``record``'s save."""
        try:
            manifest = self._manifest(path)
        except (FormatError, OSError):
            return False
        return manifest.manifest_kind == "dcp" and (
            not record.save_id or dcp_save_id(manifest) == record.save_id
        )

    def _present_here(self, rank: int) -> bool:
        assert self.step is not None
        return self._where(rank, self.step) is not None

    def _choose(self, items: list[ReadItem], *, fetch: bool) -> None:
        missing: set[int] = set()
        pending: list[MetadataIndex] = []
        for req in items:
            index = req.storage_index
            if index in self._chosen:
                continue
            holders = self._holders_of(index)
            here = next((r for r in holders if self._present_here(r)), None)
            if here is not None:
                self._chosen[index] = here
                continue
            missing.add(next((r for r in holders if r in missing), holders[0]))
            pending.append(index)
        if not missing:
            return
        assert self.step is not None
        if not fetch:
            rank = min(missing)
            raise MissingCheckpointError(
                f"rank {rank}'s step {self.step} is not on this node (not in "
                f"{rank_dir(self.root, self.job, rank)} nor among replicas; ranks {sorted(missing)} are "
                "missing): loading this DCP checkpoint needs their data here (docs/dcp.md)"
            )
        self._fetch(sorted(missing), self.step)
        self.fetched = tuple(sorted({*self.fetched, *missing}))
        self._present, self._manifests = {}, {}  # a fetch may have replaced a copy of another save
        self._choose([r for r in items if r.storage_index in set(pending)], fetch=False)

    def _fetch(self, ranks: list[int], step: int) -> None:
        rank = resolve(root=self.root, job=self.job).rank
        started = time.monotonic()
        status = fetch_rank_steps(
            self.root,
            self.job,
            rank,
            step,
            ranks,
            save_id=self._record.save_id if self._record is not None else "",
            stall_timeout=self.stall_timeout,
        )
        self.fetch_seconds += time.monotonic() - started
        self.fetched_bytes += status.bytes_done

    def _holders_of(self, index: MetadataIndex) -> tuple[int, ...]:
        try:
            return self._holders[index]
        except KeyError:
            raise FormatError(f"item {item_key(index)!r} is not in the checkpoint's metadata") from None

    # ------------------------------------------------------------------ reading

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._choose(plan.items, fetch=False)
        by_rank: dict[int, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            by_rank[self._chosen[req.storage_index]].append(req)
        with contextlib.ExitStack() as leased:
            for rank, reqs in sorted(by_rank.items()):
                assert self.step is not None and self._record is not None
                step = self._rank_step(rank, self.step, self._record)
                _hold_lease(leased, step.path)
                by_file: dict[str, list[tuple[ReadItem, TensorEntry]]] = defaultdict(list)
                for req in reqs:
                    entry = step.entry(item_key(req.storage_index))
                    by_file[entry.file].append((req, entry))
                for name, entries in sorted(by_file.items()):
                    needed = sum({e.offset: e.length for _, e in entries}.values())
                    self.bytes_read += needed
                    mapped, owned = step.open(name, needed=needed)
                    try:
                        self._read_file(step, mapped, sorted(entries, key=lambda it: it[1].offset), planner)
                    finally:
                        if owned:
                            mapped.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _rank_step(self, rank: int, step: int, record: DcpMetadata) -> _RankStep:
        """Rank ``rank``'s ``step`` on this node, checked to be the one it wrote for ``record``'s save."""
        if (rank, step) in self._steps:
            return self._steps[(rank, step)]
        path = self._where(rank, step, record)
        if path is None:
            raise MissingCheckpointError(
                f"rank {rank}'s step {step} is not on this node (not in "
                f"{rank_dir(self.root, self.job, rank)} nor among replicas): "
                "loading this DCP checkpoint needs that rank's data here (docs/dcp.md)"
            )
        manifest = self._manifest(path)
        if not self._is_save(path, record):
            raise FormatError(
                f"{path} is not the step rank {rank} wrote for this DCP checkpoint (rewritten since?)"
            )
        self._steps[(rank, step)] = _RankStep(path, step, manifest)
        return self._steps[(rank, step)]

    def _read_file(
        self,
        step: _RankStep,
        mapped: MappedFile,
        entries: list[tuple[ReadItem, TensorEntry]],
        planner: LoadPlanner,
    ) -> None:
        """Read ``entries`` (in file order) from one mapped data file: verify every item once (in
        parallel over the CPUs), copy whole items bound for a GPU as the native load does (small ones
        packed, large ones through pinned bounce buffers filled by parallel memcpy), the rest (slices of
        an item when resharding, CPU destinations, byte items) one by one; then commit each to the
        planner in order."""
        for _, entry in entries:
            if entry.offset + entry.length > mapped.size:
                raise CorruptShardError(
                    f"{mapped.path}: item {entry.key!r} runs past the end of the file",
                    path=str(mapped.path),
                    key=entry.key,
                )
        unique = list({e.key: e for _, e in entries}.values())
        actual = region_crcs([(mapped.address + e.offset, e.length) for e in unique])
        for entry, crc in zip(unique, actual, strict=True):
            if crc != entry.crc32c:
                raise CorruptShardError(
                    f"{mapped.path}: item {entry.key!r} (bytes {entry.offset}..{entry.offset + entry.length})"
                    f" has crc32c {crc:08x}, expected {entry.crc32c:08x}: the shard is corrupt",
                    path=str(mapped.path),
                    key=entry.key,
                )
        commits: list[tuple[ReadItem, torch.Tensor]] = []
        whole_gpu: list[tuple[int, torch.Tensor]] = []
        for req, entry in entries:
            region = mapped.buffer[entry.offset : entry.offset + entry.length]
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(region.numpy().tobytes()))
                continue
            src, whole = self._source(req, region)
            target = planner.resolve_tensor(req).detach()
            if target.size() != src.size():
                raise FormatError(
                    f"item {item_key(req.storage_index)!r}: stored slice {tuple(src.size())} does not fit "
                    f"destination {tuple(target.size())}"
                )
            if whole and target.is_cuda and target.dtype == src.dtype and target.is_contiguous():
                whole_gpu.append((step.index[entry.key], target))
            else:
                cuda.copy(target, src)  # the mapping may be pinned in pieces: cut at their boundaries
            commits.append((req, target))
        if whole_gpu:
            views = step.views(mapped)
            upload.to_device(
                step.manifest,
                {mapped.path.name: mapped},
                views,
                whole_gpu,
                staging=self._staging,
                pack_bytes=1 << 20,
                pack_limit=256 << 20,
                memcpy=memmove,
            )
        for req, target in commits:
            planner.commit_tensor(req, target)

    def _source(self, req: ReadItem, region: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The stored bytes ``req`` reads, typed and shaped (a slice of the item when resharding), and
        whether that is the whole item."""
        index = req.storage_index
        sizes, dtype = self._chunks[(index.fqn, tuple(index.offset or ()))]
        if region.numel() != sizes.numel() * dtype.itemsize:
            raise FormatError(
                f"item {item_key(index)!r}: {region.numel()} bytes do not hold {dtype} {tuple(sizes)}"
            )
        item = region.view(dtype).reshape(sizes)
        whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == tuple(sizes)
        return (item if whole else _narrow(item, req.storage_offsets, req.lengths)), whole


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The view of ``tensor`` that starts at ``offsets`` and spans ``lengths``, dimension by dimension."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


def _alone(obj: Any) -> list[Any]:
    return [obj]


def _hold_lease(stack: contextlib.ExitStack, path: Path) -> None:
    """Lease a step while this rank reads it, so retention elsewhere cannot remove it under us."""
    step = parse_step_id(path.name)
    assert step is not None
    try:
        stack.enter_context(leases.hold(path.parent, step, f"dcp-load-{os.getpid()}"))
    except (OSError, MissingCheckpointError) as exc:  # e.g. a read-only copy: reading is still safe
        log.warning("reading %s without a lease: %s", path, exc)
