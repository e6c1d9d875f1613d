"""Staging for ``dcp.async_save``: host copies of the state dict, kept and reused across saves.

``dcp.async_save`` first makes a "training-safe" copy of the state (staging), then saves that copy on
a background thread. Allocating that copy afresh costs page faults on every byte, every save; this stager
allocates it once (pinned when CUDA is up, so device-to-host copies run at full speed) and copies into
the same buffers on later saves, so the caller is blocked for one memcpy. The cache is rebuilt when the
state's structure changes (keys, shapes, dtypes, devices). Non-tensor values are deep-copied.

``RamdiskWriter`` stages through a ``StagingCache`` (DCP uses a storage writer that is an ``AsyncStager``
unless ``async_stager=`` is given); hold one writer across saves to benefit.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, cast

import torch
from torch.distributed.tensor import DTensor

from tierckpt import cuda
from tierckpt.dcp.torch_seams import _copy_state_dict, _create_cpu_state_dict

__all__ = ["StagingCache"]

log = logging.getLogger(__name__)


def _signature(value: Any) -> Any:
    """What the cached copy depends on: container shapes, and each tensor's type, shape, dtype, device."""
    if isinstance(value, DTensor):
        local = value.to_local()
        return ("D", tuple(value.shape), tuple(local.shape), value.dtype, str(value.placements))
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, dict):
        return ("d", tuple((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    return None


def _deepcopy_objects(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        return {k: _deepcopy_objects(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deepcopy_objects(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_deepcopy_objects(v) for v in value)
    return copy.deepcopy(value)


class StagingCache:
    """Blocking staging into host buffers, allocated once and reused (``reuse=False``: fresh each time)."""

    def __init__(self, *, reuse: bool = True) -> None:
        self.reuse = reuse
        self._cache: dict[str, Any] | None = None
        self._signature: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        signature = _signature(state_dict) if self.reuse else None
        if self._cache is None or not self.reuse or signature != self._signature:
            pin = cuda.available() and torch.cuda.is_initialized()
            log.debug("allocating the async staging copy (pinned: %s)", pin)
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=pin)
            self._signature = signature
        staged = _copy_state_dict(state_dict, self._cache)
        if not self.reuse:
            self._cache = None
        return cast("dict[str, Any]", _deepcopy_objects(staged))  # a dict copies to a dict

    def close(self) -> None:
        self._cache, self._signature = None, None
