"""A state dict <-> the manifest's JSON ``tree`` plus its tensors and pickled objects (pure, no I/O).

``flatten`` walks nested dicts, OrderedDicts, lists and tuples. Dense tensors (and numpy arrays of a
storable dtype) become ``{"t": "tensor", "i": n}`` / ``{"t": "ndarray", "i": n}`` pointing into a flat
list; JSON-able scalars are stored inline, exactly (floats through ``float.hex``); anything else is a
``{"t": "object", "i": n}`` pointing into the list pickled in objects.pkl. The encoding is specified in
docs/format.md, "State tree".

``restore_into`` rebuilds the saved structure inside the caller's dict, *in place*: tensors that are
already at the same path with the same dtype and shape are filled (so parameters and optimizer
state keep their identity and device), containers of the same type are updated, the rest is created.

Both can record, for every tensor node, its ``KeyPath``: the container kinds and keys that lead to it
from the root, which ``bindings`` uses to find the same tensors again without walking. ``restore_into``
can also record the ``Leaf``s: every subtree that is not a tensor and not a container filled in place
that holds tensors (scalars, objects, arrays, tuples), with where it sits in the tree, so that
``restore_leaves`` restores just those next time (the tensors being bound already).

A ``DTensor`` (FSDP2, tensor parallel) is stored as its local shard with a ``{"t": "dtensor"}`` node
describing its mesh and placements, and restored only into a DTensor of the same layout
(``snapshot.dtensor``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch

from tierckpt.protocol.errors import FormatError
from tierckpt.snapshot import dtensor
from tierckpt.snapshot.dtypes import dtype_name, numpy_dtype

__all__ = [
    "ArrayFiller",
    "Branch",
    "FlatState",
    "KeyPath",
    "Leaf",
    "TensorFiller",
    "flatten",
    "restore_into",
    "restore_leaves",
    "storable_tensor",
]

log = logging.getLogger(__name__)

_MAX_JSON_INT = 2**53 - 1
_SCALARS = (type(None), bool, str)
_SHARDED_TENSOR = "ShardedTensor"

TensorFiller = Callable[[int, Any], Any]
"""``(tensor index, what the destination holds at that path) -> the value to put there``."""
ArrayFiller = Callable[[int, Any], np.ndarray]
"""The same for ``ndarray`` nodes: returns the array to put there (the existing one, when it fits)."""
KeyPath = tuple[tuple[Any, Any], ...]
"""``((kind, key), ...)`` from the root: ``kind`` is the type of the container holding ``key`` (``dict``,
``OrderedDict``, ``list``) or ``(tuple, length)``; the last key holds the tensor."""
TreePath = tuple[tuple[int, Any], ...]
"""Where a node sits in the state tree: ``(position in the parent's items, key node)`` per level (the
key node is ``_NO_KEY`` below lists and tuples), checked when the path is followed in another tree."""
_NO_KEY = ("no key",)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A subtree to restore as a whole: ``where`` in the destination, ``at`` in the tree."""

    where: KeyPath
    at: TreePath


@dataclasses.dataclass(frozen=True)
class Branch:
    """A container filled in place that holds tensors: ``at`` in the tree, with ``items`` children (so a
    tree that gained or lost a key there is told apart)."""

    at: TreePath
    items: int


@dataclasses.dataclass(frozen=True)
class FlatState:
    """The flattened form of one state dict: JSON tree, tensors with unique keys, objects to pickle."""

    tree: Any
    keys: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...]
    objects: tuple[Any, ...]
    paths: dict[int, KeyPath] | None = None
    """With ``flatten(..., record_paths=True)``: the key path of every tensor node (not ndarrays)."""


def storable_tensor(value: Any) -> bool:
    """True for a dense tensor (or Parameter) whose bytes the format stores directly."""
    if type(value) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return (
        value.layout is torch.strided
        and not value.is_quantized
        and not value.is_nested
        and not value.is_meta
        and dtype_name(value.dtype) is not None
    )


def _storable_array(value: Any) -> bool:
    return type(value) is np.ndarray and value.dtype.isnative and numpy_dtype(value.dtype.name) == value.dtype


class _Flattener:
    """One walk of a state dict. The path to the current node is a stack of raw keys (``_parts``), joined
    into a tensor's key only where a tensor is found: most nodes of an optimizer's state are scalars."""

    def __init__(self, *, record_paths: bool = False) -> None:
        self.keys: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.objects: list[Any] = []
        self._seen_keys: set[str] = set()
        self.paths: dict[int, KeyPath] | None = {} if record_paths else None
        self._where: list[tuple[Any, Any]] = []
        self._parts: list[Any] = []

    def _path(self) -> tuple[str, ...]:
        return tuple(_path_part(p) for p in self._parts)

    def _key(self) -> str:
        key = "/".join(map(_path_part, self._parts)) or "."
        unique, n = key, 1
        while unique in self._seen_keys:
            unique, n = f"{key}#{n}", n + 1
        self._seen_keys.add(unique)
        return unique

    def _add_tensor(self, tensor: torch.Tensor) -> int:
        self.keys.append(self._key())
        self.tensors.append(tensor)
        return len(self.tensors) - 1

    def _add_object(self, value: Any) -> dict[str, Any]:
        self.objects.append(value)
        return {"t": "object", "i": len(self.objects) - 1}

    def node(self, value: Any) -> Any:
        kind = type(value)
        if kind in _SCALARS:
            return value
        if kind is int:
            return value if abs(value) <= _MAX_JSON_INT else {"t": "int", "v": str(value)}
        if kind is float:
            return {"t": "float", "v": value.hex()}
        if kind is dict or kind is collections.OrderedDict:
            return {"t": "dict" if kind is dict else "odict", "v": self._items(value, kind)}
        if kind is list or kind is tuple:
            return {"t": "list" if kind is list else "tuple", "v": self._elements(value, kind)}
        if storable_tensor(value):
            index = self._add_tensor(value)
            if self.paths is not None:
                self.paths[index] = tuple(self._where)
            node: dict[str, Any] = {"t": "tensor", "i": index}
            if kind is torch.nn.Parameter:
                node["param"] = True
            if value.requires_grad:
                node["rg"] = True
            return node
        if _storable_array(value):
            array = value if value.flags.c_contiguous and value.flags.writeable else value.copy(order="C")
            return {"t": "ndarray", "i": self._add_tensor(torch.from_numpy(array))}
        if dtensor.is_dtensor(value):
            return self._dtensor(value)
        if isinstance(value, torch.Tensor) and kind.__name__ == _SHARDED_TENSOR:
            raise TypeError(
                f"{'/'.join(self._path())}: a ShardedTensor is a shard of a distributed tensor; save it "
                "through torch.distributed.checkpoint with tierckpt.dcp, not Checkpointer.save"
            )
        if isinstance(value, torch.Tensor):
            log.debug("%s: %s is pickled into objects.pkl", "/".join(self._path()), kind.__name__)
        return self._add_object(value)

    def _items(self, value: Any, kind: type) -> list[list[Any]]:
        """A dict's ``[key node, value node]`` pairs (keeping ``_where``, the key path, when recording)."""
        parts, where, recording = self._parts, self._where, self.paths is not None
        items = []
        for k, v in value.items():
            parts.append(k)
            if recording:
                where.append((kind, k))
            items.append([k if type(k) is str else self.key_node(k), self.node(v)])
            if recording:
                where.pop()
            parts.pop()
        return items

    def _elements(self, value: Any, kind: type) -> list[Any]:
        parts, where, recording = self._parts, self._where, self.paths is not None
        holder = list if kind is list else (tuple, len(value))
        out = []
        for i, v in enumerate(value):
            parts.append(i)
            if recording:
                where.append((holder, i))
            out.append(self.node(v))
            if recording:
                where.pop()
            parts.pop()
        return out

    def _dtensor(self, value: Any) -> dict[str, Any]:
        """This rank's local shard, as an ordinary tensor of the step, with the layout it belongs to."""
        local = dtensor.local_shard(value)
        path = "/".join(self._path())
        if not storable_tensor(local):
            raise TypeError(f"{path}: a DTensor whose local shard is a {type(local).__name__}")
        node = {"t": "dtensor", "i": self._add_tensor(local), "key": path, **dtensor.describe(value)}
        if value.requires_grad:
            node["rg"] = True
        return node

    def key_node(self, key: Any) -> Any:
        kind = type(key)
        if kind in _SCALARS or kind in (int, float):
            return self.node(key)
        if kind is tuple and all(type(k) in (*_SCALARS, int, float) for k in key):
            return {"t": "tuple", "v": [self.node(k) for k in key]}
        return self._add_object(key)


def _path_part(key: Any) -> str:
    return key if type(key) is str else str(key) if type(key) is int else repr(key)


def flatten(state: dict[Any, Any], *, record_paths: bool = False) -> FlatState:
    """Flatten a state dict (a ``dict`` or ``OrderedDict``) into tree, tensors and objects
    (``record_paths``: and the key path of each tensor)."""
    if type(state) not in (dict, collections.OrderedDict):
        raise TypeError(f"a state dict must be a dict or OrderedDict, not {type(state).__name__}")
    f = _Flattener(record_paths=record_paths)
    tree = f.node(state)
    return FlatState(
        tree=tree, keys=tuple(f.keys), tensors=tuple(f.tensors), objects=tuple(f.objects), paths=f.paths
    )


# ------------------------------------------------------------------------------------------ restore


class _Builder:
    def __init__(
        self,
        fill: TensorFiller,
        n_tensors: int,
        objects: Sequence[Any],
        fill_array: ArrayFiller | None,
        paths: dict[int, KeyPath] | None = None,
        leaves: list[Leaf | Branch] | None = None,
    ) -> None:
        self.fill = fill
        self.fill_array = fill_array or self._array_from_tensor
        self.n_tensors = n_tensors
        self.objects = objects
        self.paths = paths
        self.leaves = leaves if paths is not None else None
        self._where: list[tuple[Any, Any]] = []
        self._at: list[tuple[int, Any]] = []

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
        index = self._index(node, self.n_tensors)
        value = self.fill(index, dest)
        if self.paths is not None:
            self.paths[index] = tuple(self._where)
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
        array: np.ndarray = self.fill(i, None).cpu().numpy()
        if (
            type(existing) is np.ndarray
            and existing.shape == array.shape
            and existing.dtype == array.dtype
            and existing.flags.writeable
        ):
            np.copyto(existing, array)
            return cast("np.ndarray", existing)
        return array

    def _items(self, node: dict[str, Any]) -> list[Any]:
        items = node.get("v")
        if type(items) is not list:
            raise FormatError(f"state tree {node['t']} node without a list of items")
        return items

    def _child(
        self, holder: Any, key: Any, node: Any, existing: Any, at: int = 0, key_node: Any = _NO_KEY
    ) -> Any:
        """``value`` for a child at ``key`` (item ``at`` of the tree node) of a container of kind
        ``holder``, recording its key path and, if it is a leaf, the leaf."""
        if self.paths is None:
            return self.value(node, existing)
        self._where.append((holder, key))
        self._at.append((at, key_node))
        tensors = len(self.paths)
        try:
            value = self.value(node, existing)
            if self.leaves is not None and not (type(node) is dict and node.get("t") == "tensor"):
                held = len(self.paths) > tensors
                if held and value is existing and type(value) in (dict, collections.OrderedDict, list):
                    self.leaves.append(Branch(tuple(self._at), len(node["v"])))
                else:
                    self.leaves.append(Leaf(tuple(self._where), tuple(self._at)))
            return value
        finally:
            self._where.pop()
            self._at.pop()

    def _list(self, node: dict[str, Any], existing: Any) -> list[Any]:
        items = self._items(node)
        if type(existing) is not list:
            return [self._child(list, i, v, None, i) for i, v in enumerate(items)]
        for i, child in enumerate(items):
            if i < len(existing):
                existing[i] = self._child(list, i, child, existing[i], i)
            else:
                existing.append(self._child(list, i, child, None, i))
        del existing[len(items) :]
        return existing

    def _tuple(self, node: dict[str, Any], existing: Any) -> tuple[Any, ...]:
        items = self._items(node)
        old = existing if type(existing) in (tuple, list) and len(existing) == len(items) else None
        holder = (tuple, len(items))
        return tuple(
            self._child(holder, i, v, None if old is None else old[i], i) for i, v in enumerate(items)
        )

    def _mapping(self, node: dict[str, Any], existing: Any, kind: type) -> Any:
        target: Any = existing if type(existing) is kind else kind()
        for at, pair in enumerate(self._items(node)):
            if type(pair) is not list or len(pair) != 2:
                raise FormatError(f"state tree {node['t']} item is not a [key, value] pair")
            key = self._key(pair[0])
            target[key] = self._child(kind, key, pair[1], target.get(key), at, pair[0])
        return target

    def _key(self, node: Any) -> Any:
        """A dict key (never recorded: keys hold no tensors and are no leaves of their own)."""
        if self.paths is None:
            return self.value(node, None)
        paths, leaves, self.paths, self.leaves = self.paths, self.leaves, None, None
        try:
            return self.value(node, None)
        finally:
            self.paths, self.leaves = paths, leaves

    def _dict(self, node: dict[str, Any], existing: Any) -> dict[Any, Any]:
        return cast("dict[Any, Any]", self._mapping(node, existing, dict))

    def _odict(self, node: dict[str, Any], existing: Any) -> collections.OrderedDict[Any, Any]:
        return cast(
            "collections.OrderedDict[Any, Any]", self._mapping(node, existing, collections.OrderedDict)
        )


def restore_into(
    dest: dict[Any, Any],
    tree: Any,
    *,
    fill: TensorFiller,
    n_tensors: int,
    objects: Sequence[Any],
    fill_array: ArrayFiller | None = None,
    paths: dict[int, KeyPath] | None = None,
    leaves: list[Leaf | Branch] | None = None,
) -> None:
    """Rebuild ``tree`` inside ``dest`` in place; ``fill(i, existing)`` supplies tensor ``i`` (< n_tensors).

    ``fill_array`` supplies ``ndarray`` nodes (default: ``fill(i, None)`` as numpy, copied into an
    existing array of the same shape and dtype). Keys of ``dest`` the checkpoint lacks stay as they are.
    ``paths`` (a dict) receives the key path of every tensor node; ``leaves`` (with ``paths``) the leaves
    and branches (the root included).
    """
    if not isinstance(tree, dict) or tree.get("t") not in ("dict", "odict"):
        raise FormatError("the state tree's root is not a dict")
    if not isinstance(dest, dict):
        raise TypeError(f"load fills a dict in place, not a {type(dest).__name__}")
    builder = _Builder(fill, n_tensors, objects, fill_array, paths, leaves)
    builder._mapping(tree, dest, type(dest))
    if leaves is not None:
        leaves.append(Branch((), len(tree.get("v") or ())))


def _follow(tree: Any, at: TreePath) -> Any:
    """The node at ``at`` in ``tree``, or ``_NO_KEY`` where the tree does not have the recorded keys."""
    node = tree
    for position, key_node in at:
        items = node.get("v") if type(node) is dict else None
        if type(items) is not list or not 0 <= position < len(items):
            return _NO_KEY
        item = items[position]
        if key_node is _NO_KEY:
            node = item
        elif type(item) is list and len(item) == 2 and item[0] == key_node:
            node = item[1]
        else:
            return _NO_KEY
    return node


def restore_leaves(
    tree: Any,
    leaves: Sequence[tuple[Any, Any, TreePath]],
    branches: Sequence[Branch],
    *,
    fill: TensorFiller,
    n_tensors: int,
    objects: Sequence[Any],
    fill_array: ArrayFiller | None = None,
) -> bool:
    """Restore only ``(container, key, at)`` leaves: the subtree of ``tree`` at ``at`` goes to
    ``container[key]`` (as ``restore_into`` would put it). False, before changing anything, when
    ``tree`` differs from the recorded one: a path without the recorded keys, or a branch with more or
    fewer items."""
    for branch in branches:
        node = _follow(tree, branch.at)
        if type(node) is not dict or type(node.get("v")) is not list or len(node["v"]) != branch.items:
            return False
    nodes = []
    for _, _, at in leaves:
        node = _follow(tree, at)
        if node is _NO_KEY:
            return False
        nodes.append(node)
    builder = _Builder(fill, n_tensors, objects, fill_array)
    for (container, key, _), node in zip(leaves, nodes, strict=True):
        try:
            existing = container[key]
        except (KeyError, IndexError):
            existing = None
        value = builder.value(node, existing)
        if type(container) is list and key == len(container):
            container.append(value)
        else:
            container[key] = value
    return True
