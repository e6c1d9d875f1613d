"""Strict loading: where a destination state dict differs from a checkpoint's saved structure (pure).

``mismatches(dest, saved)`` walks both trees together. ``saved`` is the checkpoint rebuilt with meta
tensors (shape and dtype only, no bytes). A difference is:

* a tensor whose shape or dtype differs from the saved one;
* a key of a destination dict, holding tensors, that the checkpoint lacks (a layer the saved model did
  not have);
* a saved key, holding tensors, that a non-empty destination ``OrderedDict`` lacks (a layer the
  destination does not have). ``nn.Module.state_dict()`` returns an ``OrderedDict`` whose keys are the
  architecture; a plain ``dict`` (a state dict's top level, an optimizer's state) is a container that
  loading extends with what was saved, as it fills an empty container: that is how state that does not
  exist yet (an optimizer before its first step) is loaded;
* a tensor on one side and something else on the other (a destination value of None is a placeholder
  and accepts anything); a list of another length, or a container of another kind, where tensors are
  involved.

Non-tensor leaves (hyper-parameters, counters, strings) may differ: they are state, not structure.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["mismatches"]

_ARRAYS = (torch.Tensor, np.ndarray)


def _dtype(value: torch.Tensor | np.ndarray) -> str:
    return str(value.dtype).removeprefix("torch.")


def _describe(value: Any) -> str:
    if isinstance(value, _ARRAYS):
        return f"{_dtype(value)} {tuple(value.shape)}"
    return type(value).__name__


def _holds_tensors(value: Any) -> bool:
    if isinstance(value, _ARRAYS):
        return True
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


def _path(parts: tuple[str, ...]) -> str:
    return "/".join(parts) or "."


def _walk(dest: Any, saved: Any, parts: tuple[str, ...], skip: Collection[int]) -> Iterator[str]:
    if dest is None or id(saved) in skip:
        return
    if isinstance(saved, _ARRAYS) or isinstance(dest, _ARRAYS):
        same = (
            isinstance(saved, _ARRAYS)
            and isinstance(dest, _ARRAYS)
            and tuple(saved.shape) == tuple(dest.shape)
            and _dtype(saved) == _dtype(dest)
        )
        if not same:
            yield f"{_path(parts)}: checkpoint {_describe(saved)}, destination {_describe(dest)}"
        return
    if isinstance(dest, dict) and isinstance(saved, dict):
        for key, value in dest.items():
            if key not in saved and _holds_tensors(value):
                yield f"{_path((*parts, str(key)))}: in the destination, not in the checkpoint"
        for key, value in saved.items():
            if key in dest:
                yield from _walk(dest[key], value, (*parts, str(key)), skip)
            elif dest and isinstance(dest, collections.OrderedDict) and _holds_tensors(value):
                yield f"{_path((*parts, str(key)))}: in the checkpoint, not in the destination"
        return
    if isinstance(dest, (list, tuple)) and isinstance(saved, (list, tuple)):
        if dest and len(dest) != len(saved) and (_holds_tensors(dest) or _holds_tensors(saved)):
            yield f"{_path(parts)}: checkpoint has {len(saved)} items, destination {len(dest)}"
            return
        for i, (d, s) in enumerate(zip(dest, saved)):  # noqa: B905 - an empty destination is filled
            yield from _walk(d, s, (*parts, str(i)), skip)
        return
    empty = isinstance(dest, (dict, list, tuple)) and not dest  # filled with whatever was saved
    if not empty and (_holds_tensors(dest) or _holds_tensors(saved)):
        yield f"{_path(parts)}: checkpoint {_describe(saved)}, destination {_describe(dest)}"


def mismatches(dest: Any, saved: Any, *, skip: Collection[int] = ()) -> list[str]:
    """Every structural difference between ``dest`` and the checkpoint's ``saved`` tree (see module doc).

    ``skip``: ``id``s of nodes of ``saved`` not to compare (DTensor shards: their layout is checked,
    strictly and with a message that points to DCP, when they are filled)."""
    return list(_walk(dest, saved, (), skip))
