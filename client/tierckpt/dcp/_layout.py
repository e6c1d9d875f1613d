"""Where one rank's DCP items go inside its step's data files (pure; no I/O).

Items are spread over ``files`` data files (one writer thread each: a tmpfs file takes one writer at a
time) by size, largest first onto the least-loaded file; inside a file each item starts at a multiple
of ``format.ALIGNMENT``. The zero bytes between items belong to the item before them when the file's
crc32c is derived from the items' crcs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import google_crc32c

from tierckpt.format import ALIGNMENT, align_up
from tierckpt.integrity import crc32c_concat

__all__ = ["RankLayout", "Slot", "file_crc32c", "plan_layout"]

_ZEROS = bytes(ALIGNMENT)


@dataclasses.dataclass(frozen=True)
class Slot:
    """Item ``item`` (its position in the plan) at ``data-<file>.bin[offset:offset+length]``."""

    item: int
    file: int
    offset: int
    length: int


@dataclasses.dataclass(frozen=True)
class RankLayout:
    slots: tuple[Slot, ...]
    """One per item, in the plan's item order."""
    file_sizes: tuple[int, ...]

    def slots_in(self, file: int) -> list[Slot]:
        """The slots of one file, in offset order."""
        return sorted((s for s in self.slots if s.file == file), key=lambda s: s.offset)


def plan_layout(lengths: Sequence[int], files: int) -> RankLayout:
    """Assign each item (by byte length) a file and an aligned offset."""
    n_files = max(1, min(files, len(lengths))) if lengths else 0
    ends = [0] * n_files
    slots: dict[int, Slot] = {}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        f = min(range(n_files), key=lambda f: (ends[f], f))
        offset = align_up(ends[f])
        slots[i] = Slot(i, f, offset, lengths[i])
        ends[f] = offset + lengths[i]
    return RankLayout(tuple(slots[i] for i in range(len(lengths))), tuple(ends))


def file_crc32c(slots_in_file: Sequence[Slot], crcs: Sequence[int]) -> int:
    """The crc32c of a whole data file from its slots (offset order) and each item's crc (plan order)."""
    parts = []
    for k, slot in enumerate(slots_in_file):
        end = slot.offset + slot.length
        pad = slots_in_file[k + 1].offset - end if k + 1 < len(slots_in_file) else 0
        crc = crcs[slot.item]
        if pad:
            crc = google_crc32c.extend(crc, _ZEROS[:pad])
        parts.append((crc, slot.length + pad))
    return crc32c_concat(parts)
