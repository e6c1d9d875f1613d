"""Where each tensor goes: data files, offsets and file sizes (pure; a frozen plan, like DCP's SavePlan).

Tensors are laid out in the order given, each at an offset aligned to ``format.ALIGNMENT``, in
``data-00000.bin``; a new file starts when ``max_file_bytes`` would be exceeded (never splitting a
tensor). A file's size is its last tensor's end rounded up to the alignment (at least one alignment
unit), so every byte of a file is either a tensor byte or zero padding.

Tensors whose spec names a ``group`` (the checkpointer groups small tensors of one CUDA device) are
placed first, group after group, so each group occupies one contiguous region per file: a *packed
run* (``packed_runs``). The device copies such a run as one DMA from (or into) a staging buffer laid
out exactly like the file region, instead of one copy per tensor.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tierckpt.protocol.format import ALIGNMENT, align_up, data_file_name
from tierckpt.snapshot.dtypes import itemsize

__all__ = ["FilePlan", "LayoutPlan", "PackedRun", "Placement", "TensorSpec", "packed_runs", "plan_layout"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What the layout needs to know about one tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    group: str | None = None
    """Tensors of one group are placed contiguously (before ungrouped ones), for packed copies."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Placement:
    """One tensor's bytes: ``files[file].name`` at ``[offset, offset + length)``."""

    file: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class FilePlan:
    name: str
    size: int


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    specs: tuple[TensorSpec, ...]
    placements: tuple[Placement, ...]
    files: tuple[FilePlan, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def padding(self, file: int) -> list[tuple[int, int]]:
        """The zero-filled ``(offset, length)`` gaps of one file, in order (for its crc)."""
        gaps, end = [], 0
        for p in sorted((p for p in self.placements if p.file == file), key=lambda p: p.offset):
            if p.offset > end:
                gaps.append((end, p.offset - end))
            end = max(end, p.offset + p.length)
        if self.files[file].size > end:
            gaps.append((end, self.files[file].size - end))
        return gaps


def plan_layout(
    specs: Sequence[TensorSpec], *, alignment: int = ALIGNMENT, max_file_bytes: int | None = None
) -> LayoutPlan:
    """Place ``specs`` into data files. No tensors means no data files."""
    if alignment <= 0 or alignment % ALIGNMENT:
        raise ValueError(f"alignment must be a positive multiple of {ALIGNMENT}")
    placements: list[Placement | None] = [None] * len(specs)
    sizes: list[int] = []
    offset = 0
    for i in _placement_order(specs):
        spec = specs[i]
        n = spec.nbytes
        if not sizes or (max_file_bytes is not None and offset > 0 and offset + n > max_file_bytes):
            if sizes:
                sizes[-1] = max(align_up(offset, alignment), alignment)
            sizes.append(0)
            offset = 0
        placements[i] = Placement(len(sizes) - 1, offset, n)
        offset = align_up(offset + n, alignment)
    if sizes:
        sizes[-1] = max(offset, alignment)
    files = tuple(FilePlan(data_file_name(i), size) for i, size in enumerate(sizes))
    placed = tuple(p for p in placements if p is not None)
    return LayoutPlan(specs=tuple(specs), placements=placed, files=files)


def _placement_order(specs: Sequence[TensorSpec]) -> list[int]:
    """Grouped specs first (groups in order of first appearance, specs in given order), then the rest."""
    groups: dict[str, list[int]] = {}
    rest = []
    for i, spec in enumerate(specs):
        if spec.group is None:
            rest.append(i)
        else:
            groups.setdefault(spec.group, []).append(i)
    return [i for members in groups.values() for i in members] + rest


@dataclasses.dataclass(frozen=True)
class PackedRun:
    """A contiguous region ``[start, end)`` of one file holding tensors ``indices`` of one group."""

    group: str
    file: int
    start: int
    end: int
    indices: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def packed_runs(plan: LayoutPlan) -> list[PackedRun]:
    """The packed runs of ``plan``: one per (group, file), in placement order (pure)."""
    members: dict[tuple[str, int], list[int]] = {}
    for i, (spec, p) in enumerate(zip(plan.specs, plan.placements, strict=True)):
        if spec.group is not None and p.length:
            members.setdefault((spec.group, p.file), []).append(i)
    runs = []
    for (group, file), indices in members.items():
        indices.sort(key=lambda i: plan.placements[i].offset)
        start = plan.placements[indices[0]].offset
        end = max(plan.placements[i].offset + plan.placements[i].length for i in indices)
        runs.append(PackedRun(group, file, start, end, tuple(indices)))
    return runs
