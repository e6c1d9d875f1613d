"""DTensor (FSDP2, tensor parallel) state in ``Checkpointer``: each rank keeps its local shard, in place.

A ``DTensor`` is saved as its local shard (an ordinary tensor of the step) plus a tree node describing
where that shard belongs: the device mesh (its shape, the global ranks in it, the dimension names, the
device type), the placements and the global shape. ``Checkpointer.load`` fills the destination's local
shard in place, but only when the destination is a ``DTensor`` laid out exactly so: same mesh, same
placements, same global and local shapes. Anything else (another mesh, another world size, other
placements, a plain tensor) raises ``DTensorLayoutError``: restoring a shard into another layout would be
silently wrong; ``torch.distributed.checkpoint`` with ``tierckpt.dcp`` reshards.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DTensorLayoutError", "describe", "is_dtensor", "local_shard", "mismatch"]

_RESHARD_HINT = (
    "a DTensor restores in place only under the mesh and placements it was saved with; to load it "
    "under another mesh or world size, save and load through torch.distributed.checkpoint with "
    "tierckpt.dcp (RamdiskWriter/RamdiskReader), which reshards"
)


class DTensorLayoutError(ValueError):
    """A saved DTensor shard does not belong where the destination expects it (see the module doc)."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_dtensor(value: Any) -> bool:
    if type(value) in _PLAIN:  # the common case, without the import machinery (loads ask per tensor)
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed
        return False
    return isinstance(value, DTensor)


def local_shard(value: Any) -> torch.Tensor:
    """The tensor this rank holds of a DTensor (saved and filled in place)."""
    return value._local_tensor  # type: ignore[no-any-return]


def describe(value: Any) -> dict[str, Any]:
    """The JSON description of a DTensor's layout, stored in the state tree."""
    mesh = value.device_mesh
    return {
        "mesh": {
            "shape": list(mesh.mesh.shape),
            "ranks": [int(r) for r in mesh.mesh.flatten().tolist()],
            "dims": None if mesh.mesh_dim_names is None else list(mesh.mesh_dim_names),
            "device": mesh.device_type,
        },
        "placements": [str(p) for p in value.placements],
        "shape": list(value.shape),
    }


def mismatch(saved: dict[str, Any], existing: Any) -> str | None:
    """Why ``existing`` cannot take the shard saved with layout ``saved`` in place; None if it can."""
    if not is_dtensor(existing):
        what = "nothing" if existing is None else f"a {type(existing).__name__}"
        return f"the checkpoint holds a DTensor shard, the destination holds {what}"
    have = describe(existing)
    for field, name in (("mesh", "device mesh"), ("placements", "placements"), ("shape", "global shape")):
        if saved.get(field) != have[field]:
            return f"saved with {name} {saved.get(field)}, the destination has {have[field]}"
    return None


def layout_error(key: str, problem: str) -> DTensorLayoutError:
    return DTensorLayoutError(f"{key}: {problem}. {_RESHARD_HINT}")
