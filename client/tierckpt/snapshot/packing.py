"""Packed copies of small CUDA tensors: persistent device staging laid out like the data file.

Copying ~2,000 small tensors one DMA at a time costs ~10 µs each, more than the bytes. The
checkpointer therefore gives every small CUDA tensor a layout *group* (per device, and per overlap
phase), so ``layout.plan_layout`` places each group contiguously in the file (a ``PackedRun``).
``SavePacker`` keeps one persistent device buffer per group, laid out exactly like the group's runs
(same offsets, zero padding), gathers the tensors into it with fused ``_foreach_copy_`` kernels and
moves each run with one DMA (``cuda.copy_to_host``). The buffers are allocated once and reused;
only a new layout re-zeroes them (their padding must stay zero: it lands in the file).

``pack_groups`` decides the groups (pure apart from reading tensor metadata).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tierckpt import cuda
from tierckpt.protocol.format import ALIGNMENT, align_up
from tierckpt.snapshot.dtypes import torch_dtype
from tierckpt.snapshot.layout import LayoutPlan, PackedRun, packed_runs
from tierckpt.snapshot.shardfile import MappedFile

__all__ = ["LATER", "SavePacker", "pack_groups"]

log = logging.getLogger(__name__)

LATER = "/later"
"""Suffix of the groups of tensors that overlap mode copies after ``save`` returns."""


def pack_groups(
    tensors: Sequence[torch.Tensor], later: Sequence[bool], *, max_bytes: int, limit: int
) -> tuple[str | None, ...]:
    """The layout group of each tensor: ``"cuda:N"`` (or ``"cuda:N/later"``) for CUDA tensors of at
    most ``max_bytes``, None for the rest, and for every tensor of a device whose packed total
    would exceed ``limit``."""
    groups: list[str | None] = [None] * len(tensors)
    if max_bytes <= 0:
        return tuple(groups)
    totals: dict[str, int] = {}
    names: dict[int, str] = {}
    for i, t in enumerate(tensors):
        if not t.is_cuda:
            continue
        n = t.numel() * t.element_size()
        if 0 < n <= max_bytes:
            index = t.get_device()
            device = names.get(index) or names.setdefault(index, f"cuda:{index}")
            groups[i] = device + LATER if later[i] else device
            totals[device] = totals.get(device, 0) + align_up(n, ALIGNMENT)
    over = {d for d, n in totals.items() if n > limit}
    for d in over:
        log.info(
            "%s: %d bytes of small tensors exceed pack_limit=%d; copying them one by one", d, totals[d], limit
        )
    if over:
        groups = [None if g is not None and g.removesuffix(LATER) in over else g for g in groups]
    return tuple(groups)


class SavePacker:
    """Persistent device staging buffers (one per group) for the packed runs of the current plan."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._plan: LayoutPlan | None = None
        self._runs: list[tuple[PackedRun, torch.Tensor, list[torch.Tensor]]] = []
        self._packed: frozenset[int] = frozenset()

    @property
    def device_bytes(self) -> int:
        """Device memory held by the staging buffers."""
        return sum(b.numel() for b in self._buffers.values())

    def _fit(self, plan: LayoutPlan) -> None:
        runs = packed_runs(plan)
        need: dict[str, int] = {}
        for run in runs:
            need[run.group] = need.get(run.group, 0) + run.nbytes
        for group, n in need.items():
            buffer = self._buffers.get(group)
            if buffer is None or buffer.numel() < n:
                self._buffers[group] = torch.zeros(n, dtype=torch.uint8, device=group.removesuffix(LATER))
                log.debug("packing staging for %s: %d bytes of device memory", group, n)
            else:
                buffer.zero_()  # a new layout: the old tensor bytes may sit in new padding
        for group in set(self._buffers) - set(need):
            del self._buffers[group]
        self._runs, used = [], dict.fromkeys(need, 0)
        for run in runs:
            staging = self._buffers[run.group][used[run.group] : used[run.group] + run.nbytes]
            used[run.group] += run.nbytes
            slots = []
            for i in run.indices:
                spec, p = plan.specs[i], plan.placements[i]
                raw = staging[p.offset - run.start : p.offset - run.start + p.length]
                slots.append(raw.view(torch_dtype(spec.dtype)).view(spec.shape))
            self._runs.append((run, staging, slots))
        self._packed = frozenset(i for run in runs for i in run.indices)
        self._plan = plan

    def copies(
        self, plan: LayoutPlan, files: Sequence[MappedFile], tensors: Sequence[torch.Tensor], *, later: bool
    ) -> list[cuda.PackedCopy]:
        """The packed copies of ``plan``'s groups (``later``: only overlap-deferred ones, else the others)
        from ``tensors`` into the mapped ``files``."""
        if self._plan is not plan:
            self._fit(plan)
        out = []
        for run, staging, slots in self._runs:
            if run.group.endswith(LATER) != later:
                continue
            host = files[run.file].buffer[run.start : run.end]
            out.append(cuda.PackedCopy(staging, host, slots, [tensors[i] for i in run.indices]))
        return out

    def packed(self, plan: LayoutPlan) -> frozenset[int]:
        """Indices of ``plan``'s tensors that travel in packed runs."""
        if self._plan is not plan:
            self._fit(plan)
        return self._packed

    def close(self) -> None:
        self._buffers.clear()
        self._runs, self._plan = [], None
