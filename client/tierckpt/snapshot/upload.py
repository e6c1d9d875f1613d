"""Restore's host-to-device path: mapped data file -> CUDA tensors, in as few DMAs as possible.

* Small destinations (up to ``pack_bytes``) of one device and one file are grouped into runs of
  nearby file bytes (``plan_runs``, pure). Each run goes to the device as ONE copy into a staging
  buffer, then fused ``_foreach_copy_`` kernels scatter it into the tensors (``cuda.scatter_from_host``).
  ``RestoreStaging`` keeps the staging buffers and their slot views for the last manifest, so a
  warm restore allocates nothing and builds no views.
* Large destinations are copied directly from the mapping.
* From a registered (pinned) mapping the copies are plain ``non_blocking`` DMAs. From a mapping that
  is not registered (a cold restore in a fresh process, before the pool has pinned it) they go
  through ``cuda.copy_through_bounce``: parallel memcpy into reusable pinned bounce buffers,
  pipelined with the DMAs, instead of paying ``cudaHostRegister`` (~0.2 s/GiB) first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch

from tierckpt import cuda
from tierckpt.protocol.format import Manifest
from tierckpt.snapshot.dtypes import torch_dtype
from tierckpt.snapshot.shardfile import MappedFile

__all__ = ["MAX_GAP", "RestoreStaging", "Run", "plan_runs", "to_device"]

log = logging.getLogger(__name__)

MAX_GAP = 64 << 10
"""Small tensors further apart than this in the file start a new run (the gap would be copied too)."""


@dataclasses.dataclass(frozen=True)
class Run:
    """File bytes ``[start, end)`` of ``file`` holding small tensors ``indices``, all bound for ``device``."""

    device: torch.device
    file: str
    start: int
    end: int
    indices: tuple[int, ...]


def plan_runs(
    places: Sequence[tuple[int, torch.device, str, int, int]], *, max_gap: int = MAX_GAP, limit: int
) -> list[Run]:
    """Group ``(index, device, file, offset, length)`` into runs of nearby bytes (pure).

    A device whose runs would need more than ``limit`` bytes of staging gets none (its tensors are
    then copied one by one).
    """
    by_key: dict[tuple[torch.device, str], list[tuple[int, int, int]]] = {}
    for i, device, file, offset, length in places:
        by_key.setdefault((device, file), []).append((offset, length, i))
    runs: list[Run] = []
    for (device, file), members in by_key.items():
        members.sort()
        start, end, indices = members[0][0], members[0][0] + members[0][1], [members[0][2]]
        for offset, length, i in members[1:]:
            if offset - end > max_gap:
                runs.append(Run(device, file, start, end, tuple(indices)))
                start, indices = offset, []
            indices.append(i)
            end = max(end, offset + length)
        runs.append(Run(device, file, start, end, tuple(indices)))
    totals: dict[torch.device, int] = {}
    for r in runs:
        totals[r.device] = totals.get(r.device, 0) + r.end - r.start
    return [r for r in runs if totals[r.device] <= limit]


@dataclasses.dataclass
class _Prepared:
    runs: list[Run]
    stagings: list[torch.Tensor]
    slots: list[list[torch.Tensor]]


class RestoreStaging:
    """Device staging buffers and slot views for packed restores, cached for the last layout."""

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._manifest: Manifest | None = None
        self._prepared: _Prepared | None = None

    def prepare(
        self, manifest: Manifest, places: Sequence[tuple[int, torch.device, str, int, int]], limit: int
    ) -> _Prepared:
        key = (id(manifest), tuple(places), limit)
        if self._prepared is not None and self._manifest is manifest and self._key == key:
            return self._prepared
        runs = plan_runs(places, limit=limit)
        stagings, slots = [], []
        for run in runs:
            staging = torch.empty(run.end - run.start, dtype=torch.uint8, device=run.device)
            views = []
            for i in run.indices:
                t = manifest.tensors[i]
                raw = staging[t.offset - run.start : t.offset - run.start + t.length]
                views.append(raw.view(torch_dtype(t.dtype)).view(t.shape))
            stagings.append(staging)
            slots.append(views)
        self._key, self._manifest, self._prepared = key, manifest, _Prepared(runs, stagings, slots)
        return self._prepared

    @property
    def device_bytes(self) -> int:
        return sum(s.numel() for s in self._prepared.stagings) if self._prepared else 0

    def clear(self) -> None:
        self._key = self._manifest = self._prepared = None


def _flat_bytes(t: torch.Tensor) -> torch.Tensor | None:
    """A uint8 view of a contiguous tensor's bytes (None when it is not plainly contiguous)."""
    if not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None
    return cuda.flat_bytes(t)


def to_device(
    manifest: Manifest,
    files: dict[str, MappedFile],
    views: Sequence[torch.Tensor],
    targets: Sequence[tuple[int, torch.Tensor]],
    *,
    staging: RestoreStaging,
    pack_bytes: int,
    pack_limit: int,
    memcpy: Callable[[int, int, int], None],
    wait: bool = True,
) -> None:
    """Copy tensor ``i``'s bytes (``views[i]``, in ``files``) into each CUDA ``target``; returns when done
    (``wait=False``: once issued, except copies through bounce buffers, which are done by then)."""
    entries = manifest.tensors
    small = [
        (i, t.device, entries[i].file, entries[i].offset, entries[i].length)
        for i, t in targets
        if 0 < entries[i].length <= pack_bytes
    ]
    prepared = staging.prepare(manifest, small, pack_limit) if small else _Prepared([], [], [])
    by_index = dict(targets)
    packed = {i for run in prepared.runs for i in run.indices}
    direct_dst, direct_src, bounce = [], [], []
    for i, t in targets:
        if i in packed or entries[i].length == 0:
            continue
        f = files[entries[i].file]
        flat = _flat_bytes(t)
        if f.registered or flat is None:
            direct_dst.append(t)  # pinned: async DMA; pageable and strided (rare): a plain copy
            direct_src.append(views[i])
        else:
            bounce.append((f.address + entries[i].offset, entries[i].length, flat))
    packs = []
    bounced: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
    for run, stage, slots in zip(prepared.runs, prepared.stagings, prepared.slots, strict=True):
        f = files[run.file]
        tensors = [by_index[i] for i in run.indices]
        if f.registered:
            packs.append(cuda.PackedCopy(stage, f.buffer[run.start : run.end], slots, tensors))
        else:
            bounce.append((f.address + run.start, run.end - run.start, stage))
            # Scattered below whatever ``registered`` says by then: the pool pins files in the
            # background, and a run staged through the bounce buffers must still reach its tensors.
            bounced.append((stage, tensors, slots))
    with torch.no_grad():
        if direct_dst:
            cuda.copy_to_device(direct_dst, direct_src, wait=False)
        cuda.scatter_from_host(packs)
        if bounce:
            cuda.copy_through_bounce(bounce, memcpy)
            for stage, tensors, slots in bounced:
                with torch.cuda.device(stage.device):
                    cuda.gather(tensors, slots)
    if wait:
        cuda.synchronize({t.device for _, t in targets})
