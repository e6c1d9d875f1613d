"""What one ``Checkpointer.save`` writes, decided before any byte moves (as DCP's ``SavePlan``).

``SavePlanner.plan`` turns a state dict into a ``SavePlan``: the state flattened (``snapshot.flatten``),
its tensors laid out in data files (``snapshot.packing`` groups the small ones, ``snapshot.layout``
places them), its other objects pickled, and the storages only a registered optimizer's step mutates
(overlap mode and device staging copy those last). The plan is a value: the save's I/O
(``save_writer``) and the replica-group strategy (``grouped_save``) read it and never plan again.

Planning touches no file: a loop that saves the same state gets the same layout object back from a
small cache (the slot pool then reuses its files as they are).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterable
from typing import Any

import torch

from tierckpt.settings import Settings
from tierckpt.snapshot import objects as pickled
from tierckpt.snapshot.dtypes import dtype_name
from tierckpt.snapshot.fingerprint import structure_digest
from tierckpt.snapshot.flatten import FlatState, flatten
from tierckpt.snapshot.layout import LayoutPlan, TensorSpec, plan_layout
from tierckpt.snapshot.packing import pack_groups

__all__ = ["SavePlan", "SavePlanner", "protected_storages"]

_PLAN_CACHE = 4


@dataclasses.dataclass(frozen=True)
class SavePlan:
    """One save, planned: what to write where."""

    step: int
    flat: FlatState
    layout: LayoutPlan
    protected: frozenset[int]
    """Storages (data pointers) that only a registered optimizer's step mutates."""
    objects: bytes | None
    """The state's non-tensor values, pickled (None when it has none)."""

    @property
    def logical_bytes(self) -> int:
        """What a save of this plan without deduplication writes: its data files and objects."""
        return self.layout.total_bytes + len(self.objects or b"")


def protected_storages(optimizers: Iterable[torch.optim.Optimizer]) -> frozenset[int]:
    """Storages that only these optimizers' steps mutate: their parameters and their state's tensors."""
    out: set[int] = set()
    for opt in list(optimizers):
        for group in opt.param_groups:
            out.update(p.untyped_storage().data_ptr() for p in group["params"])
        for state in opt.state.values():
            out.update(v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor))
    return frozenset(out)


class SavePlanner:
    """Plans saves for one rank; keeps the last few layouts, so a loop saving one state plans once.
    Thread-safe (a fresh job's first optimizer step plans on a thread of its own)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._layouts: collections.OrderedDict[tuple[Any, ...], LayoutPlan] = collections.OrderedDict()
        self._last: tuple[tuple[Any, ...], LayoutPlan] | None = None
        self._structure: tuple[LayoutPlan, int] | None = None

    def plan(self, step: int, state_dict: dict[Any, Any], protected: frozenset[int]) -> SavePlan:
        """Flatten ``state_dict`` (its stateful values already expanded), lay it out, pickle its objects."""
        flat = flatten(state_dict)
        layout = self.layout(flat, protected)
        objects = pickled.dumps(list(flat.objects)) if flat.objects else None
        return SavePlan(step, flat, layout, protected, objects)

    def layout(self, flat: FlatState, protected: frozenset[int] = frozenset()) -> LayoutPlan:
        """The layout for this state; the same object for the same keys, dtypes, shapes, devices (and,
        in overlap mode, the same optimizer-owned tensors)."""
        with self._lock:
            return self._layout(flat, protected)

    def _layout(self, flat: FlatState, protected: frozenset[int]) -> LayoutPlan:
        s = self.settings
        tensors = flat.tensors
        later = (
            [t.untyped_storage().data_ptr() in protected for t in tensors]
            if protected
            else [False] * len(tensors)
        )
        shapes = tuple((t.dtype, t.shape, t.device) for t in tensors)
        last = self._last
        if last is not None and last[0] == (flat.keys, shapes, later):
            return last[1]  # a loop saves the same state: no need to group and look up again
        groups = pack_groups(tensors, later, max_bytes=s.pack_bytes, limit=s.pack_limit)
        signature = (flat.keys, shapes, groups)
        layout = self._layouts.get(signature)
        if layout is None:
            specs = []
            for key, t, group in zip(flat.keys, tensors, groups, strict=True):
                name = dtype_name(t.dtype)
                assert name is not None  # flatten only keeps storable dtypes
                specs.append(TensorSpec(key, name, tuple(t.shape), group))
            layout = plan_layout(specs, max_file_bytes=s.max_file_bytes)
            self._layouts[signature] = layout
            while len(self._layouts) > _PLAN_CACHE:
                self._layouts.popitem(last=False)
        self._layouts.move_to_end(signature)
        self._last = ((flat.keys, shapes, later), layout)
        return layout

    def structure(self, plan: SavePlan) -> int:
        """The structure hash of a replica group's fingerprint, once per layout (the same layout: the
        same keys and shapes)."""
        if self._structure is None or self._structure[0] is not plan.layout:
            self._structure = (plan.layout, structure_digest(plan.flat.keys, plan.flat.tensors))
        return self._structure[1]
