"""Reading a committed step back into the caller's state dict, in place, verifying as it goes.

Tensor bytes are copied once, straight from the mapped data file into the destination tensor: on
CPU one parallel batch of copies from the mapping (``copy.copy_cpu``), on CUDA a ``non_blocking``
host-to-device copy from the mapping (pinned when the pool registered it). With ``verify``, CPU
tensors are all checksummed before any byte is copied (a corrupt step leaves their bytes alone) and
CUDA tensors concurrently with their DMA; a mismatch raises ``CorruptShardError`` naming the tensor
and the file.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierckpt import cuda
from tierckpt.errors import CorruptShardError, FormatError
from tierckpt.format import OBJECTS_NAME, Manifest, TensorEntry, iter_data_files
from tierckpt.integrity import crc32c
from tierckpt.snapshot.copy import copy_cpu, region_crcs
from tierckpt.snapshot.dtypes import numpy_dtype, torch_dtype
from tierckpt.snapshot.flatten import restore_into
from tierckpt.snapshot.shardfile import MappedFile

__all__ = ["load_into", "open_data_files", "read_objects", "tensor_views"]

log = logging.getLogger(__name__)


def open_data_files(step_path: Path, manifest: Manifest, *, register: bool = False) -> dict[str, MappedFile]:
    """Map a step's data files read-only, checking their sizes against the manifest."""
    out: dict[str, MappedFile] = {}
    try:
        for entry in iter_data_files(manifest):
            path = step_path / entry.name
            try:
                f = MappedFile.open(path, writable=False, populate=not register)
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
    """Unpickle objects.pkl after checking its crc32c (an empty list when the step has none)."""
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
    objects = pickle.loads(body)
    if not isinstance(objects, list) or len(objects) != manifest.object_count:
        raise FormatError(f"{path}: expected a list of {manifest.object_count} objects")
    return objects


class _Filler:
    """Supplies tensor ``i`` for ``restore_into``; ``finish`` moves the bytes in.

    CUDA destinations: one batch of host-to-device copies from the mapping, while the same regions
    are checksummed on threads (``region_crcs``). CPU destinations: checksummed, then copied in one
    parallel batch, so a corrupt step leaves their bytes untouched.
    """

    def __init__(
        self,
        step_path: Path,
        entries: Sequence[TensorEntry],
        views: Sequence[torch.Tensor],
        *,
        verify: bool,
        device: torch.device | None,
    ) -> None:
        self.step_path = step_path
        self.entries = entries
        self.views = views
        self.verify = verify
        self.device = device
        self.cpu: list[tuple[int, torch.Tensor]] = []
        self.gpu: list[tuple[int, torch.Tensor]] = []

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
                self.entries[i].key, src.dtype, tuple(src.shape), existing.dtype, tuple(existing.shape),
            )  # fmt: skip
            return torch.empty(src.shape, dtype=src.dtype, device=existing.device)
        if existing is not None and existing.device.type != "meta":
            return existing
        return torch.empty(src.shape, dtype=src.dtype, device=self.device or "cpu")

    def __call__(self, i: int, existing: torch.Tensor | None) -> torch.Tensor:
        target = self._target(i, existing)
        (self.gpu if cuda.is_cuda(target) else self.cpu).append((i, target))
        return target

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
            return existing
        target = torch.empty(src.shape, dtype=src.dtype)
        self.cpu.append((i, target))
        return target.numpy()

    def _crcs(self, indices: Sequence[int]) -> list[int]:
        return region_crcs([(self.views[i].data_ptr(), self.entries[i].length) for i in indices])

    def finish(self) -> None:
        """Copy to the GPU while checksumming; checksum then copy the CPU tensors."""
        if self.gpu:
            indices = [i for i, _ in self.gpu]
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierckpt-verify") as pool:
                crcs = pool.submit(self._crcs, indices) if self.verify else None
                with torch.no_grad():
                    cuda.copy_to_device([t for _, t in self.gpu], [self.views[i] for i in indices])
                if crcs is not None:
                    self.check(indices, crcs.result())
        if self.cpu:
            indices = [i for i, _ in self.cpu]
            if self.verify:
                self.check(indices, self._crcs(indices))
            copy_cpu([t for _, t in self.cpu], [self.views[i] for i in indices])


def load_into(
    dest: dict[Any, Any],
    step_path: Path,
    manifest: Manifest,
    files: dict[str, MappedFile],
    *,
    verify: bool = True,
    device: torch.device | str | None = None,
    views: Sequence[torch.Tensor] | None = None,
) -> None:
    """Fill ``dest`` in place from a committed step whose data files are mapped in ``files``.

    ``views`` (from ``tensor_views``, e.g. cached by the pool) saves building them again.
    """
    if manifest.manifest_kind != "state_dict":
        raise FormatError(f"{step_path}: a {manifest.manifest_kind!r} step; load it through tierckpt.dcp")
    objects = read_objects(step_path, manifest)
    views = tensor_views(manifest, files) if views is None else views
    filler = _Filler(
        step_path,
        manifest.tensors,
        views,
        verify=verify,
        device=None if device is None else torch.device(device),
    )
    restore_into(
        dest, manifest.tree, fill=filler, fill_array=filler.array, n_tensors=len(views), objects=objects
    )
    filler.finish()
