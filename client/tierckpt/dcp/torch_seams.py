"""The private torch APIs ``tierckpt.dcp`` uses, in one place: each where torch offers no public one.

- ``_create_cpu_state_dict`` and ``_copy_state_dict`` (``torch.distributed._state_dict_utils``): host
  copies of a state dict allocated once and copied into on every save (``staging``). DCP's public
  ``BlockingAsyncStager`` uses them too, but always pins its copy (no CUDA, no pinning) and keeps it
  when the state's structure changes.
- ``_EmptyStateDictLoadPlanner`` and ``_load_state_dict``: load a whole checkpoint without a state dict
  to load into (``export``). DCP's public ``format_utils.dcp_to_torch_save`` does the same, but only
  from its own file-system reader.
- ``flatten_state_dict`` and ``unflatten_state_dict`` (``torch.distributed.checkpoint._nested_dict``):
  DCP's flattening of nested state into dotted keys, which the in-place staging must match key for key
  (``inplace``).

They were tested with the torch releases of ``TESTED_TORCH``, the range the "torch" extra of
pyproject.toml declares: tests/dcp/test_torch_seams.py checks that the two agree and that no other
module imports a private torch name, and scripts/torch-range.sh runs the client suite on the oldest and
the newest release of the range. Widen the range only with that script passing on its new end.
"""

from __future__ import annotations

from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

__all__ = [
    "TESTED_TORCH",
    "_EmptyStateDictLoadPlanner",
    "_copy_state_dict",
    "_create_cpu_state_dict",
    "_load_state_dict",
    "flatten_state_dict",
    "unflatten_state_dict",
]

TESTED_TORCH = ((2, 9), (2, 16))
"""The torch releases (from, up to but excluding; major and minor) these seams were tested with."""
