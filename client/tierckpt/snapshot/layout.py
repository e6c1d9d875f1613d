"""Where each tensor goes: data files, offsets and file sizes (pure; a frozen plan, like DCP's SavePlan).

Tensors are laid out in the order given, each at an offset aligned to ``format.ALIGNMENT``, in
``data-00000.bin``; a new file starts when ``max_file_bytes`` would be exceeded (never splitting a
tensor). A file's size is its last tensor's end rounded up to the alignment (at least one alignment
unit), so every byte of a file is either a tensor byte or zero padding.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tierckpt.format import ALIGNMENT, align_up, data_file_name
from tierckpt.snapshot.dtypes import itemsize

__all__ = ["FilePlan", "LayoutPlan", "Placement", "TensorSpec", "plan_layout"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What the layout needs to know about one tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]

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
        for p in self.placements:
            if p.file == file:
                if p.offset > end:
                    gaps.append((end, p.offset - end))
                end = p.offset + p.length
        if self.files[file].size > end:
            gaps.append((end, self.files[file].size - end))
        return gaps


def plan_layout(
    specs: Sequence[TensorSpec], *, alignment: int = ALIGNMENT, max_file_bytes: int | None = None
) -> LayoutPlan:
    """Place ``specs`` into data files. No tensors means no data files."""
    if alignment <= 0 or alignment % ALIGNMENT:
        raise ValueError(f"alignment must be a positive multiple of {ALIGNMENT}")
    placements: list[Placement] = []
    sizes: list[int] = []
    offset = 0
    for spec in specs:
        n = spec.nbytes
        if not sizes or (max_file_bytes is not None and offset > 0 and offset + n > max_file_bytes):
            if sizes:
                sizes[-1] = max(align_up(offset, alignment), alignment)
            sizes.append(0)
            offset = 0
        placements.append(Placement(len(sizes) - 1, offset, n))
        offset = align_up(offset + n, alignment)
    if sizes:
        sizes[-1] = max(offset, alignment)
    files = tuple(FilePlan(data_file_name(i), size) for i, size in enumerate(sizes))
    return LayoutPlan(specs=tuple(specs), placements=tuple(placements), files=files)
