"""Read a whole DCP checkpoint from the ramdisk into one process, without building the model first.

``full_state_dict`` rebuilds the saved state (nesting included, from the metadata's flatten mapping)
with every tensor whole, on CPU: every chunk of every rank is read and checked. It is the ramdisk
counterpart of DCP's ``format_utils.dcp_to_torch_save``, for inspection, evaluation and export. Run it
on one process: it holds the entire checkpoint in memory.
"""

from __future__ import annotations

import os
from typing import Any

from .reader import RamdiskReader
from .torch_seams import _EmptyStateDictLoadPlanner, _load_state_dict

__all__ = ["full_state_dict"]


def full_state_dict(
    root: str | os.PathLike[str] | None = None, job: str | None = None, step: int | None = None
) -> dict[str, Any]:
    """The checkpoint ``step`` (None: the newest one this root holds whole and undamaged) as one unsharded
    CPU state dict. This process alone reads it: no collective, even in a distributed program."""
    state: dict[str, Any] = {}
    reader = RamdiskReader(root, job, step, collective=False)
    _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state
