"""Staging ``dcp.async_save`` straight into the ramdisk slot the save will commit.

``dcp.async_save`` blocks training while it stages a training-safe copy of the state, then saves that
copy on a background thread. Staged into a host buffer (``staging.StagingCache``), the bytes are copied
twice: into the buffer while training waits, then into the ramdisk by ``write_data``. Staged here, they
are copied once: into the mapped (and, with CUDA, registered) data files of a slot taken from the rank's
slot pool, laid out exactly as this rank's previous save was (``Template``). The staged state's tensors
are views of those files (DTensors keep their mesh and placements around such a view), so when
``write_data`` resolves an item it finds its bytes already in place, checksums and commits.

That needs the layout before DCP has planned the save. It is the previous save's layout when the state
has the same structure (same keys, dtypes, shapes and shards): DCP's planning, and the node copies, are
deterministic in that. ``stage_into_slot`` checks every item against the state and gives up (None: stage
into a host buffer instead) at the first difference; ``write_data`` uses the staged slot only if the plan
it gets lays out exactly the same, and copies from it otherwise. The first async save, and any save after
the structure changed, stage into a host buffer.

Tensors this rank does not write (DCP saves a replicated tensor on another rank) still need a training-
safe copy, in case the plan changes: they are copied into host buffers kept between saves.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable
from typing import Any, cast

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.tensor import DTensor

from tierckpt.dcp.torch_seams import flatten_state_dict, unflatten_state_dict
from tierckpt.snapshot.copy import copy_into
from tierckpt.snapshot.dtypes import dtype_name
from tierckpt.snapshot.layout import LayoutPlan, TensorSpec, plan_layout
from tierckpt.snapshot.pool import Slot

__all__ = ["Staged", "Template", "stage_into_slot"]


@dataclasses.dataclass(frozen=True)
class Template:
    """The layout of this rank's last write: ``plan.specs[i]`` holds the item ``indices[i]``."""

    plan: LayoutPlan
    indices: tuple[MetadataIndex, ...]


@dataclasses.dataclass
class Staged:
    """A slot filled by ``stage_into_slot``, waiting for the save's ``write_data``."""

    slot: Slot
    plan: LayoutPlan


def _local(value: Any) -> torch.Tensor | None:
    if isinstance(value, DTensor):
        return value._local_tensor
    if type(value) in (torch.Tensor, torch.nn.Parameter):
        return cast("torch.Tensor", value)
    return None


def _offset(value: Any) -> tuple[int, ...]:
    if isinstance(value, DTensor):
        # the chunk DCP's planner writes for this rank (the protocol DTensor implements for DCP)
        (chunk,) = value.__create_chunk_list__()
        return tuple(int(o) for o in chunk.offsets)
    return (0,) * int(value.dim())


def _rewrap(like: Any, local: torch.Tensor) -> Any:
    """``local`` in the place of ``like``'s local shard. Not ``DTensor.from_local``: that moves a host shard
    back to a CUDA mesh's device. Like DCP's own staging, the staged DTensor keeps the mesh and placements
    around a host tensor."""
    if isinstance(like, DTensor):
        return DTensor(local, like._spec, requires_grad=False)
    return local


def _object_bytes(value: Any) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)  # what DCP's planner stores for a non-tensor item
    return out.getvalue()


def stage_into_slot(
    state_dict: dict[str, Any],
    template: Template,
    take: Callable[[LayoutPlan], Slot],
    spare: dict[str, torch.Tensor],
) -> tuple[dict[str, Any], Staged] | None:
    """Copy ``state_dict``'s items laid out as ``template`` into a slot from ``take``; returns the staged
    state dict (same structure, tensors viewing the slot) and the slot. None when the state's structure
    no longer fits the template (nothing taken then). ``spare``: host buffers for the tensors this rank
    does not write, kept by the caller between saves."""
    flat, mapping = flatten_state_dict(state_dict)
    specs: list[TensorSpec] = []
    sources: dict[int, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for i, (index, spec) in enumerate(zip(template.indices, template.plan.specs, strict=True)):
        if index.fqn not in flat:
            return None
        value = flat[index.fqn]
        local = _local(value)
        if index.offset is None:  # a non-tensor object: its size may change from save to save
            if local is not None or isinstance(value, torch.Tensor):
                return None
            objects[index.fqn] = copy.deepcopy(value)
            specs.append(dataclasses.replace(spec, shape=(len(_object_bytes(objects[index.fqn])),)))
            continue
        if (
            local is None
            or dtype_name(local.dtype) != spec.dtype
            or tuple(local.shape) != spec.shape
            or _offset(value) != tuple(index.offset)
        ):
            return None
        sources[i] = local.detach()
        specs.append(spec)
    plan = plan_layout(specs)
    slot = take(plan)
    try:
        views = slot.views(plan)
        ticket = copy_into([views[i] for i in sources], list(sources.values()))
        if ticket is not None:
            ticket.synchronize()
    except BaseException:
        slot.close(unlink=True)
        raise
    staged_of = {template.indices[i].fqn: views[i] for i in sources}
    staged: dict[str, Any] = {}
    for fqn, value in flat.items():
        local = _local(value)
        if fqn in staged_of:
            staged[fqn] = _rewrap(value, staged_of[fqn])
        elif local is not None:  # saved by another rank this time; keep a safe copy all the same
            buf = spare.get(fqn)
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = spare[fqn] = torch.empty(local.shape, dtype=local.dtype)
            buf.copy_(local.detach())
            staged[fqn] = _rewrap(value, buf)
        elif isinstance(value, torch.Tensor):
            staged[fqn] = value.detach().clone()  # another kind of tensor (e.g. sharded): a plain copy
        else:
            staged[fqn] = objects[fqn] if fqn in objects else copy.deepcopy(value)
    return unflatten_state_dict(staged, mapping), Staged(slot, plan)
