"""A state dict <-> the manifest's JSON ``tree`` plus its tensors and pickled objects (pure, no I/O).

``flatten`` walks nested dicts, OrderedDicts, lists and tuples. Dense tensors (and numpy arrays of a
storable dtype) become ``{"t": "tensor", "i": n}`` / ``{"t": "ndarray", "i": n}`` pointing into a flat
list; JSON-able scalars are stored inline, exactly (floats through ``float.hex``); anything else is a
``{"t": "object", "i": n}`` pointing into the list pickled in objects.pkl. The encoding is specified in
docs/format.md, "State tree".

``restore_into`` rebuilds the saved structure inside the caller's dict, *in place*: tensors that are
already at the same path with the same dtype and shape are filled (so parameters and optimizer
state keep their identity and device), containers of the same type are updated, the rest is created.

A ``DTensor`` (FSDP2, tensor parallel) is stored as its local shard with a ``{"t": "dtensor"}`` node
describing its mesh and placements, and restored only into a DTensor of the same layout
(``snapshot.dtensor``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tierckpt.protocol.errors import FormatError
from tierckpt.snapshot import dtensor
from tierckpt.snapshot.dtypes import dtype_name, numpy_dtype

__all__ = ["ArrayFiller", "FlatState", "TensorFiller", "flatten", "restore_into", "storable_tensor"]

log = logging.getLogger(__name__)

_MAX_JSON_INT = 2**53 - 1
_SCALARS = (type(None), bool, str)
_SHARDED_TENSOR = "ShardedTensor"

TensorFiller = Callable[[int, Any], Any]
"""``(tensor index, what the destination holds at that path) -> the value to put there``."""
ArrayFiller = Callable[[int, Any], np.ndarray]
"""The same for ``ndarray`` nodes: returns the array to put there (the existing one, when it fits)."""


@dataclasses.dataclass(frozen=True)
class FlatState:
    """The flattened form of one state dict: JSON tree, tensors with unique keys, objects to pickle."""

    tree: Any
    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    objects: tuple[Any, ...]


def storable_tensor(value: Any) -> bool:
    """True for a dense tensor (or Parameter) whose bytes the format stores directly."""
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return (
        value.layout == torch.strided
        and not value.is_quantized
        and not value.is_nested
        and value.device.type != "meta"
        and dtype_name(value.dtype) is not None
    )


def _storable_array(value: Any) -> bool:
    return type(value) is np.ndarray and value.dtype.isnative and numpy_dtype(value.dtype.name) == value.dtype


class _Flattener:
    def __init__(self) -> None:
        self.keys: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.objects: list[Any] = []
        self._seen_keys: set[str] = set()

    def _key(self, path: tuple[str, ...]) -> str:
        key = "/".join(path) or "."
        unique, n = key, 1
        while unique in self._seen_keys:
            unique, n = f"{key}#{n}", n + 1
        self._seen_keys.add(unique)
        return unique

    def _add_tensor(self, tensor: torch.Tensor, path: tuple[str, ...]) -> int:
        self.keys.append(self._key(path))
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def _add_object(self, value: Any) -> dict[str, Any]:
        self.objects.append(value)
        return {"t": "object", "i": len(self.objects) - 1}

    def node(self, value: Any, path: tuple[str, ...]) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is int:
            return value if abs(value) <= _MAX_JSON_INT else {"t": "int", "v": str(value)}
        if kind is float:
            return {"t": "float", "v": value.hex()}
        if kind is dict or kind is collections.OrderedDict:
            items = [[self.key_node(k), self.node(v, (*path, _path_part(k)))] for k, v in value.items()]
            return {"t": "dict" if kind is dict else "odict", "v": items}
        if kind is list or kind is tuple:
            items = [self.node(v, (*path, str(i))) for i, v in enumerate(value)]
            return {"t": "list" if kind is list else "tuple", "v": items}
        if storable_tensor(value):
            node: dict[str, Any] = {"t": "tensor", "i": self._add_tensor(value, path)}
            if kind is torch.nn.Parameter:
                node["param"] = True
            if value.requires_grad:
                node["rg"] = True
            return node
        if _storable_array(value):
            array = value if value.flags.c_contiguous and value.flags.writeable else value.copy(order="C")
            return {"t": "ndarray", "i": self._add_tensor(torch.from_numpy(array), path)}
        if dtensor.is_dtensor(value):
            return self._dtensor(value, path)
        if isinstance(value, torch.Tensor) and kind.__name__ == _SHARDED_TENSOR:
            raise TypeError(
                f"{'/'.join(path)}: a ShardedTensor is a shard of a distributed tensor; save it through "
                "torch.distributed.checkpoint with tierckpt.dcp, not Checkpointer.save"
            )
        if isinstance(value, torch.Tensor):
            log.debug("%s: %s is pickled into objects.pkl", "/".join(path), kind.__name__)
        return self._add_object(value)

    def _dtensor(self, value: Any, path: tuple[str, ...]) -> dict[str, Any]:
        """This rank's local shard, as an ordinary tensor of the step, with the layout it belongs to."""
        local = dtensor.local_shard(value)
        if not storable_tensor(local):
            raise TypeError(f"{'/'.join(path)}: a DTensor whose local shard is a {type(local).__name__}")
        node = {
            "t": "dtensor",
            "i": self._add_tensor(local, path),
            "key": "/".join(path),
            **dtensor.describe(value),
        }
        if value.requires_grad:
            node["rg"] = True
        return node

    def key_node(self, key: Any) -> Any:
        kind = type(key)
        if kind in _SCALARS or kind in (int, float):
            return self.node(key, ())
        if kind is tuple and all(type(k) in (*_SCALARS, int, float) for k in key):
            return {"t": "tuple", "v": [self.node(k, ()) for k in key]}
        return self._add_object(key)


def _path_part(key: Any) -> str:
    return key if type(key) is str else str(key) if type(key) is int else repr(key)


def flatten(state: dict[Any, Any]) -> FlatState:
    """Flatten a state dict (a ``dict`` or ``OrderedDict``) into tree, tensors and objects."""
    if type(state) not in (dict, collections.OrderedDict):
        raise TypeError(f"a state dict must be a dict or OrderedDict, not {type(state).__name__}")
    f = _Flattener()
    tree = f.node(state, ())
    return FlatState(tree=tree, keys=tuple(f.keys), tensors=tuple(f.tensors), objects=tuple(f.objects))


# ------------------------------------------------------------------------------------------ restore


class _Builder:
    def __init__(
        self, fill: TensorFiller, n_tensors: int, objects: Sequence[Any], fill_array: ArrayFiller | None
    ) -> None:
        self.fill = fill
        self.fill_array = fill_array or self._array_from_tensor
        self.n_tensors = n_tensors
        self.objects = objects

    def value(self, node: Any, existing: Any) -> Any:
        if node is None or type(node) in (bool, int, str):
            return node
        if type(node) is not dict or not isinstance(node.get("t"), str):
            raise FormatError(f"malformed state tree node {node!r:.80}")
        build = getattr(self, "_" + node["t"], None)
        if build is None:
            raise FormatError(f"unknown state tree node type {node['t']!r}")
        return build(node, existing)

    def _index(self, node: dict[str, Any], limit: int) -> int:
        i = node.get("i")
        if type(i) is not int or not 0 <= i < limit:
            raise FormatError(f"state tree {node['t']} index {i!r} out of range")
        return i

    def _int(self, node: dict[str, Any], existing: Any) -> int:
        try:
            return int(node["v"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"bad int node {node!r:.80}") from exc

    def _float(self, node: dict[str, Any], existing: Any) -> float:
        try:
            return float.fromhex(node["v"])
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"bad float node {node!r:.80}") from exc

    def _object(self, node: dict[str, Any], existing: Any) -> Any:
        return self.objects[self._index(node, len(self.objects))]

    def _tensor(self, node: dict[str, Any], existing: Any) -> Any:
        dest = existing if isinstance(existing, torch.Tensor) else None
        value = self.fill(self._index(node, self.n_tensors), dest)
        if value is dest:
            return value
        if node.get("param"):
            return torch.nn.Parameter(value, requires_grad=bool(node.get("rg")))
        if node.get("rg"):
            value.requires_grad_(True)
        return value

    def _dtensor(self, node: dict[str, Any], existing: Any) -> Any:
        """Fill the destination DTensor's local shard in place; any other destination is an error."""
        i = self._index(node, self.n_tensors)
        key = str(node.get("key", f"tensor {i}"))
        problem = dtensor.mismatch(node, existing)
        if problem is None:
            local = dtensor.local_shard(existing)
            if self.fill(i, local) is local:
                return existing
            problem = "its local shard differs in shape or dtype from the one saved"
        raise dtensor.layout_error(key, problem)

    def _ndarray(self, node: dict[str, Any], existing: Any) -> Any:
        return self.fill_array(self._index(node, self.n_tensors), existing)

    def _array_from_tensor(self, i: int, existing: Any) -> np.ndarray:
        array = self.fill(i, None).cpu().numpy()
        if (
            type(existing) is np.ndarray
            and existing.shape == array.shape
            and existing.dtype == array.dtype
            and existing.flags.writeable
        ):
            np.copyto(existing, array)
            return existing
        return array

    def _items(self, node: dict[str, Any]) -> list[Any]:
        items = node.get("v")
        if type(items) is not list:
            raise FormatError(f"state tree {node['t']} node without a list of items")
        return items

    def _list(self, node: dict[str, Any], existing: Any) -> list[Any]:
        items = self._items(node)
        if type(existing) is not list:
            return [self.value(v, None) for v in items]
        for i, child in enumerate(items):
            if i < len(existing):
                existing[i] = self.value(child, existing[i])
            else:
                existing.append(self.value(child, None))
        del existing[len(items) :]
        return existing

    def _tuple(self, node: dict[str, Any], existing: Any) -> tuple[Any, ...]:
        items = self._items(node)
        old = existing if type(existing) in (tuple, list) and len(existing) == len(items) else None
        return tuple(self.value(v, None if old is None else old[i]) for i, v in enumerate(items))

    def _mapping(self, node: dict[str, Any], existing: Any, kind: type) -> Any:
        target = existing if type(existing) is kind else kind()
        for pair in self._items(node):
            if type(pair) is not list or len(pair) != 2:
                raise FormatError(f"state tree {node['t']} item is not a [key, value] pair")
            key = self.value(pair[0], None)
            target[key] = self.value(pair[1], target.get(key))
        return target

    def _dict(self, node: dict[str, Any], existing: Any) -> dict[Any, Any]:
        return self._mapping(node, existing, dict)

    def _odict(self, node: dict[str, Any], existing: Any) -> collections.OrderedDict[Any, Any]:
        return self._mapping(node, existing, collections.OrderedDict)


def restore_into(
    dest: dict[Any, Any],
    tree: Any,
    *,
    fill: TensorFiller,
    n_tensors: int,
    objects: Sequence[Any],
    fill_array: ArrayFiller | None = None,
) -> None:
    """Rebuild ``tree`` inside ``dest`` in place; ``fill(i, existing)`` supplies tensor ``i`` (< n_tensors).

    ``fill_array`` supplies ``ndarray`` nodes (default: ``fill(i, None)`` as numpy, copied into an
    existing array of the same shape and dtype). Keys of ``dest`` the checkpoint lacks stay as they are.
    """
    if not isinstance(tree, dict) or tree.get("t") not in ("dict", "odict"):
        raise FormatError("the state tree's root is not a dict")
    if not isinstance(dest, dict):
        raise TypeError(f"load fills a dict in place, not a {type(dest).__name__}")
    builder = _Builder(fill, n_tensors, objects, fill_array)
    builder._mapping(tree, dest, type(dest))
