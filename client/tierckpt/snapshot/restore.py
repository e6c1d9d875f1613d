"""Reading a committed step back into the caller's state dict, in place, verifying as it goes.

Tensor bytes are copied once, straight from the mapped data file into the destination tensor: on
CPU one parallel batch of copies from the mapping (``copy.copy_cpu``), on CUDA a ``non_blocking``
host-to-device path (``upload``: packed small tensors, direct DMAs from a pinned mapping, pinned
bounce buffers from an unpinned one). With ``verify``, every data file's crc32c is computed on all
CPUs (``checksum.start_file_crcs``), started *before* the GPU copies so it overlaps them, and
compared with the manifest's file crc; only on a mismatch are per-tensor crcs computed, to name the
damaged tensor (or the padding) in ``CorruptShardError``. CPU destinations are copied only after
the check, so a corrupt step leaves their bytes alone.

With a ``bindings.BindingCache`` whose binding for this structure still holds in the destination,
every copy is issued before the tree walk (``_Filler.prefill``), and the walk then only restores what
is not a tensor, while the copies run; otherwise the walk records a binding for the next load.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from tierckpt import cuda
from tierckpt.protocol.errors import CorruptShardError, FormatError, StateMismatchError
from tierckpt.protocol.format import OBJECTS_NAME, FileEntry, Manifest, TensorEntry, iter_data_files
from tierckpt.protocol.integrity import crc32c
from tierckpt.snapshot import objects as pickled
from tierckpt.snapshot.bindings import BindingCache, Bound
from tierckpt.snapshot.checksum import PendingCrcs, region_crcs, start_file_crcs
from tierckpt.snapshot.compare import mismatches
from tierckpt.snapshot.copy import copy_cpu, memmove
from tierckpt.snapshot.dtypes import numpy_dtype, torch_dtype
from tierckpt.snapshot.flatten import Branch, KeyPath, Leaf, restore_into, restore_leaves
from tierckpt.snapshot.shardfile import MappedFile
from tierckpt.snapshot.upload import RestoreStaging, to_device

__all__ = [
    "check_structure",
    "load_into",
    "open_data_files",
    "read_objects",
    "saved_structure",
    "tensor_views",
]

_LISTED_MISMATCHES = 20

log = logging.getLogger(__name__)


def open_data_files(
    step_path: Path, manifest: Manifest, *, register: bool = False, populate: bool | None = None
) -> dict[str, MappedFile]:
    """Map a step's data files read-only, checking their sizes against the manifest.

    ``populate`` (default: unless ``register``) faults the pages in up front.
    """
    out: dict[str, MappedFile] = {}
    try:
        for entry in iter_data_files(manifest):
            path = step_path / entry.name
            try:
                f = MappedFile.open(
                    path, writable=False, populate=not register if populate is None else populate
                )
            except FileNotFoundError as exc:
                raise CorruptShardError(f"{path}: missing", path=str(path)) from exc
            out[entry.name] = f
            if f.size != entry.size:
                raise CorruptShardError(f"{path}: {f.size} bytes, manifest says {entry.size}", path=str(path))
            if register:
                f.register()
    except BaseException:
        for f in out.values():
            f.close()
        raise
    return out


def tensor_views(manifest: Manifest, files: dict[str, MappedFile]) -> list[torch.Tensor]:
    """A typed CPU view of every tensor of the manifest, into the mapped files."""
    views = []
    for t in manifest.tensors:
        buf = files[t.file].buffer
        if t.offset + t.length > buf.numel():
            raise CorruptShardError(f"{t.file}: too short for tensor {t.key!r}", path=t.file, key=t.key)
        views.append(buf[t.offset : t.offset + t.length].view(torch_dtype(t.dtype)).view(t.shape))
    return views


def read_objects(step_path: Path, manifest: Manifest) -> list[Any]:
    """Unpickle objects.pkl after checking its crc32c (an empty list when the step has none), with the
    restricted unpickler of ``snapshot.objects``."""
    if manifest.object_count == 0:
        return []
    entry = manifest.file(OBJECTS_NAME)
    path = step_path / OBJECTS_NAME
    try:
        body = path.read_bytes()
    except FileNotFoundError as exc:
        raise CorruptShardError(f"{path}: missing", path=str(path)) from exc
    if len(body) != entry.size or crc32c(body) != entry.crc32c:
        raise CorruptShardError(f"{path}: does not match its crc32c in the manifest", path=str(path))
    objects = pickled.loads(body, str(path))  # restricted: the step may come from another tier
    if not isinstance(objects, list) or len(objects) != manifest.object_count:
        raise FormatError(f"{path}: expected a list of {manifest.object_count} objects")
    return objects


def saved_structure(manifest: Manifest, objects: Sequence[Any]) -> tuple[dict[Any, Any], set[int]]:
    """The step's state tree with meta tensors (and zero-stride arrays): shapes and dtypes, no bytes; and
    the ``id``s of the meta tensors that stand for DTensor shards (their layout is checked when filled)."""
    entries = manifest.tensors
    shards = _dtensor_indices(manifest.tree)
    shard_ids: set[int] = set()

    def fill(i: int, existing: Any) -> torch.Tensor:
        meta = torch.empty(entries[i].shape, dtype=torch_dtype(entries[i].dtype), device="meta")
        if i in shards:
            shard_ids.add(id(meta))
        return meta

    def fill_array(i: int, existing: Any) -> np.ndarray:
        dtype = numpy_dtype(entries[i].dtype)
        shape = entries[i].shape
        return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), shape, (0,) * len(shape), writeable=False)

    skeleton: dict[Any, Any] = {}
    restore_into(
        skeleton,
        _local_shards(manifest.tree),
        fill=fill,
        fill_array=fill_array,
        n_tensors=len(entries),
        objects=objects,
    )
    return skeleton, shard_ids


def _local_shards(node: Any) -> Any:
    """The tree with each DTensor node as a plain tensor node of its local shard."""
    if isinstance(node, dict):
        if node.get("t") == "dtensor":
            return {"t": "tensor", "i": node["i"]}
        return {k: _local_shards(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_local_shards(v) for v in node]
    return node


def _dtensor_indices(node: Any) -> set[int]:
    if isinstance(node, dict):
        found = {int(node["i"])} if node.get("t") == "dtensor" else set()
        return found.union(*(_dtensor_indices(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_dtensor_indices(v) for v in node))
    return set()


def check_structure(
    dest: dict[Any, Any], step_path: Path, manifest: Manifest, objects: Sequence[Any]
) -> None:
    """Strict loading: ``StateMismatchError`` naming every difference of structure, shape or dtype between
    ``dest`` and the step (``snapshot.compare``), before anything is copied."""
    skeleton, shards = saved_structure(manifest, objects)
    found = mismatches(dest, skeleton, skip=shards)
    if not found:
        return
    listed = "; ".join(found[:_LISTED_MISMATCHES])
    more = f" (and {len(found) - _LISTED_MISMATCHES} more)" if len(found) > _LISTED_MISMATCHES else ""
    raise StateMismatchError(
        f"{step_path}: the checkpoint does not fit the destination: {listed}{more}; nothing was loaded "
        "(load(..., strict=False) replaces mismatched tensors and adds missing entries instead)",
        mismatches=tuple(found),
    )


class _Filler:
    """Supplies tensor ``i`` for ``restore_into``; ``finish`` moves the bytes in.

    CUDA destinations: host-to-device copies (``upload.to_device``) while the files are checksummed
    on the checksum pool. CPU destinations: copied in one parallel batch once the check passed, so a
    corrupt step leaves their bytes untouched.
    """

    def __init__(
        self,
        step_path: Path,
        manifest: Manifest,
        files: dict[str, MappedFile],
        views: Sequence[torch.Tensor],
        *,
        verify: bool,
        device: torch.device | None,
        staging: RestoreStaging,
        pack_bytes: int,
        pack_limit: int,
        timings: dict[str, float],
    ) -> None:
        self.step_path = step_path
        self.manifest = manifest
        self.entries: Sequence[TensorEntry] = manifest.tensors
        self.files = files
        self.staging = staging
        self.pack_bytes, self.pack_limit = pack_bytes, pack_limit
        self.timings = timings
        self.data_files: list[tuple[FileEntry, MappedFile]] = []
        self.early: set[torch.device] = set()
        """Devices with DMAs issued during the tree walk (large tensors from pinned mappings)."""
        self.pending: PendingCrcs | None = None
        self.views = views
        self.verify = verify
        self.device = device
        self.cpu: list[tuple[int, torch.Tensor]] = []
        self.gpu: list[tuple[int, torch.Tensor]] = []
        self.bound: dict[int, torch.Tensor] = {}

    def check(self, indices: Sequence[int], crcs: Sequence[int]) -> None:
        for i, crc in zip(indices, crcs, strict=True):
            entry = self.entries[i]
            if crc != entry.crc32c:
                path = self.step_path / entry.file
                raise CorruptShardError(
                    f"{path}: tensor {entry.key!r} at [{entry.offset}, {entry.offset + entry.length}) has "
                    f"crc32c {crc:08x}, manifest says {entry.crc32c:08x}",
                    path=str(path),
                    key=entry.key,
                )

    def _target(self, i: int, existing: torch.Tensor | None) -> torch.Tensor:
        src = self.views[i]
        if existing is not None and (existing.dtype != src.dtype or existing.shape != src.shape):
            log.warning(
                "%s: checkpoint has %s%s, the destination %s%s; replacing the tensor",
                self.entries[i].key,
                src.dtype,
                tuple(src.shape),
                existing.dtype,
                tuple(existing.shape),
            )
            return torch.empty(src.shape, dtype=src.dtype, device=existing.device)
        if existing is not None and existing.device.type != "meta":
            return existing
        return torch.empty(src.shape, dtype=src.dtype, device=self.device or "cpu")

    def __call__(self, i: int, existing: torch.Tensor | None) -> torch.Tensor:
        target = self._target(i, existing)
        if not cuda.is_cuda(target):
            self.cpu.append((i, target))
            return target
        entry = self.entries[i]
        if entry.length > self.pack_bytes and self.files[entry.file].registered:
            with torch.no_grad():  # a large tensor from a pinned mapping: start its DMA while walking on
                cuda.copy(target, self.views[i], non_blocking=True)
            self.early.add(target.device)
        else:
            self.gpu.append((i, target))
        return target

    def prefill(self, targets: Sequence[tuple[int, torch.Tensor]]) -> None:
        """A binding gave every tensor's destination: start all host-to-device copies now (CPU ones wait
        for the check, as always); the walk then only hands the same tensors back (``bound_fill``)."""
        self.bound = dict(targets)
        gpu: list[tuple[int, torch.Tensor]] = []
        for target in targets:
            (gpu if target[1].is_cuda else self.cpu).append(target)
        if gpu:
            to_device(
                self.manifest,
                self.files,
                self.views,
                gpu,
                staging=self.staging,
                pack_bytes=self.pack_bytes,
                pack_limit=self.pack_limit,
                memcpy=memmove,
                wait=False,
            )
            self.early.update(t.device for _, t in gpu)

    def bound_fill(self, i: int, existing: Any) -> torch.Tensor:
        target = self.bound.get(i)
        if target is not None and target is existing:
            return target
        return self(i, existing)  # the tree differs from the bound one here (same keys): as without

    def array(self, i: int, existing: Any) -> np.ndarray:
        """An ``ndarray`` node: fill the existing array when it fits, else a new one (always on CPU)."""
        src = self.views[i]
        fits = (
            type(existing) is np.ndarray
            and existing.shape == tuple(src.shape)
            and existing.dtype == numpy_dtype(self.entries[i].dtype)
            and existing.flags.writeable
            and existing.flags.c_contiguous
        )
        if fits:
            self.cpu.append((i, torch.from_numpy(existing)))
            return cast("np.ndarray", existing)
        target = torch.empty(src.shape, dtype=src.dtype)
        self.cpu.append((i, target))
        return target.numpy()

    def start_verify(self) -> None:
        """Start checksumming every data file on all CPUs (the fast path: one crc per file)."""
        if self.verify:
            self.data_files = [(e, self.files[e.name]) for e in iter_data_files(self.manifest)]
            self.pending = start_file_crcs(
                [(f.address, f.size) if f.size else (0, 0) for _, f in self.data_files]
            )

    def abandon(self) -> None:
        """After an error: let in-flight DMAs and checksums finish (they read mappings about to close)."""
        if self.pending is not None:
            self.pending.abandon()
        with contextlib.suppress(Exception):
            cuda.synchronize(self.early)

    def _check(self, pending: PendingCrcs) -> None:
        """Compare file crcs with the manifest; on a mismatch, find the tensor (or padding) to blame."""
        for (entry, _), crc in zip(self.data_files, pending.result(), strict=True):
            if crc == entry.crc32c:
                continue
            indices = [i for i, t in enumerate(self.entries) if t.file == entry.name]
            self.check(
                indices, region_crcs([(self.views[i].data_ptr(), self.entries[i].length) for i in indices])
            )
            path = self.step_path / entry.name
            raise CorruptShardError(
                f"{path}: padding or unused bytes differ "
                f"(file crc32c {crc:08x}, manifest says {entry.crc32c:08x})",
                path=str(path),
            )

    def finish(self) -> None:
        """Copy the rest to the GPU (checksums running meanwhile), check; then copy the CPU tensors."""
        t = self.timings
        start = time.perf_counter()
        if self.gpu:
            to_device(
                self.manifest,
                self.files,
                self.views,
                self.gpu,
                staging=self.staging,
                pack_bytes=self.pack_bytes,
                pack_limit=self.pack_limit,
                memcpy=memmove,
            )
        cuda.synchronize(self.early)
        t["h2d_s"] = time.perf_counter() - start
        if self.pending is not None:
            self._check(self.pending)
        t["verify_wait_s"] = time.perf_counter() - start - t["h2d_s"]
        if self.cpu:
            copy_cpu([t for _, t in self.cpu], [self.views[i] for i, _ in self.cpu])
        t["copy_s"] = time.perf_counter() - start


def load_into(
    dest: dict[Any, Any],
    step_path: Path,
    manifest: Manifest,
    files: dict[str, MappedFile],
    *,
    verify: bool = True,
    device: torch.device | str | None = None,
    views: Sequence[torch.Tensor] | None = None,
    staging: RestoreStaging | None = None,
    pack_bytes: int = 1 << 20,
    pack_limit: int = 256 << 20,
    timings: dict[str, float] | None = None,
    bindings: BindingCache | None = None,
    strict: bool = True,
) -> None:
    """Fill ``dest`` in place from a committed step whose data files are mapped in ``files``.

    ``strict``: first check that ``dest`` has the step's structure, shapes and dtypes
    (``check_structure``), raising ``StateMismatchError`` before anything is copied; without it a
    mismatched tensor is replaced (logged) and missing entries are created. A destination a binding
    resolves (every saved tensor lands on a tensor of its dtype and shape) is not checked again.

    ``views`` (from ``tensor_views``, e.g. cached by the pool) saves building them again;
    ``staging`` (kept by the caller) keeps the device staging of packed small tensors between
    loads; ``bindings`` (kept by the caller) the destinations of this structure's tensors.
    ``timings`` receives the phases in seconds (``bind_s``, ``tree_s``, ``h2d_s``, ``verify_wait_s``,
    ``copy_s``) and ``bound`` (1.0 when a binding spared the tree walk its tensor work).
    """
    if manifest.manifest_kind != "state_dict":
        raise FormatError(f"{step_path}: a {manifest.manifest_kind!r} step; load it through tierckpt.dcp")
    objects = read_objects(step_path, manifest)
    views = tensor_views(manifest, files) if views is None else views
    timings = {} if timings is None else timings
    filler = _Filler(
        step_path,
        manifest,
        files,
        views,
        verify=verify,
        device=None if device is None else torch.device(device),
        staging=staging or RestoreStaging(),
        pack_bytes=pack_bytes,
        pack_limit=pack_limit,
        timings=timings,
    )
    start = time.perf_counter()
    bound = None if bindings is None else bindings.resolve(manifest, dest)
    if strict and bound is None:
        check_structure(dest, step_path, manifest, objects)
    timings["bind_s"] = time.perf_counter() - start
    timings["bound"] = float(bound is not None)
    try:
        if bound is not None:
            filler.prefill(bound.tensors)  # every copy starts before the checksums compete for the CPUs
        filler.start_verify()  # the checksums run during the rest and the copies
        walked = _fill_tree(dest, manifest, filler, bound, objects, remember=bindings is not None)
        timings["tree_s"] = time.perf_counter() - start - timings["bind_s"]
        filler.finish()
    except BaseException:
        filler.abandon()
        raise
    if walked is not None and bindings is not None:
        bindings.remember_loaded(manifest, dest, *walked)


def _fill_tree(
    dest: dict[Any, Any],
    manifest: Manifest,
    filler: _Filler,
    bound: Bound | None,
    objects: list[Any],
    *,
    remember: bool,
) -> tuple[dict[int, KeyPath], list[Leaf | Branch]] | None:
    """Put every leaf of the step's tree into ``dest``: through the binding's leaves when it has them,
    else by walking the tree. Returns what a walk found (the tensors' key paths and the leaves), for
    ``bindings.remember_loaded``, when asked to ``remember`` and the tree was walked."""
    n_tensors = len(filler.views)
    if bound is not None and bound.leaves is not None:
        fast = restore_leaves(
            manifest.tree,
            bound.leaves,
            bound.branches,
            fill=filler.bound_fill,
            fill_array=filler.array,
            n_tensors=n_tensors,
            objects=objects,
        )
        if fast:
            return None
    paths: dict[int, KeyPath] | None = {} if remember else None
    leaves: list[Leaf | Branch] | None = [] if remember else None
    restore_into(
        dest,
        manifest.tree,
        fill=filler if bound is None else filler.bound_fill,
        fill_array=filler.array,
        n_tensors=n_tensors,
        objects=objects,
        paths=paths,
        leaves=leaves,
    )
    return None if paths is None or leaves is None else (paths, leaves)
