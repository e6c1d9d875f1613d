"""Where a step's tensors go in a destination state dict, remembered between loads (and from saves).

A load walks the manifest's state tree alongside the destination to pair each saved tensor with the
tensor it fills; for a model and its optimizer (2,000 tensors) that walk costs about 10 ms of Python,
as long as copying a gigabyte to the GPU. A ``Binding`` keeps its outcome: the key path from the root
to every destination tensor, with a weak reference to that tensor. The next load of a step of the
same *structure* (the same tensor keys, dtypes and shapes, in the same order) resolves the paths in
the destination, one lookup per container and per tensor, and when every path still leads to a tensor
over the same memory with the same dtype, shape, strides and device, it starts every copy at once. The
memory, not the tensor object: a module's ``state_dict()`` (the README's ``{"model": model, ...}``)
hands out new detached tensors over its parameters at every call, so identity never matched and every
such load walked and checked the whole tree (about 12 ms of a 1 GiB restore's 42 ms on an H100). What is not a
tensor is then restored from the binding's *leaves* (``flatten.Leaf``: the scalars, objects, arrays and
tuples, with their places in the tree, checked key by key), while the copies run; where the new tree
does not match them, by the whole tree walk instead. Anything else (a tensor replaced, resized or
moved, a container of another type, a list of another length) falls back to the walk, which records
a new binding.

A save records one too (``remember_saved``): loading back into the dict that was saved, the usual
way to roll back in place, skips the first walk as well. Bindings hold no tensor alive (only where
their bytes were).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tierckpt.protocol.format import Manifest
from tierckpt.snapshot.dtensor import is_dtensor, local_shard
from tierckpt.snapshot.dtypes import dtype_name
from tierckpt.snapshot.flatten import Branch, FlatState, KeyPath, Leaf, TreePath

__all__ = ["Binding", "BindingCache", "Bound", "Signature", "flat_signature", "manifest_signature"]

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]
"""``(key, dtype name, shape)`` of every tensor, in manifest order."""

_MISSING = object()
_Memory = tuple[int, torch.dtype, torch.Size, tuple[int, ...], int]
"""Where a destination tensor's bytes are, and their geometry: data pointer (of the local shard of a
DTensor), dtype, shape, strides, device index."""
_Bound = tuple[int, int, Any, _Memory]


def manifest_signature(manifest: Manifest) -> Signature:
    return tuple((t.key, t.dtype, tuple(t.shape)) for t in manifest.tensors)


def flat_signature(flat: FlatState) -> Signature:
    pairs = zip(flat.keys, flat.tensors, strict=True)
    return tuple((key, dtype_name(t.dtype) or "", tuple(t.shape)) for key, t in pairs)


def _kind_matches(value: Any, kind: Any, length: int | None) -> bool:
    if type(kind) is tuple:  # (tuple, length)
        return type(value) is tuple and len(value) == kind[1]
    return type(value) is kind and (length is None or len(value) == length)


@dataclasses.dataclass(frozen=True)
class Bound:
    """A binding resolved in a destination: its tensors, and its leaves' containers (None: walk)."""

    tensors: list[tuple[int, torch.Tensor]]
    leaves: list[tuple[Any, Any, TreePath]] | None
    branches: tuple[Branch, ...] = ()


@dataclasses.dataclass(frozen=True)
class Binding:
    """Key paths of a destination's tensors, compiled into container and tensor lookups."""

    root: Any
    """The kind of the destination dict itself."""
    containers: tuple[tuple[int, Any, Any, int | None], ...]
    """``(parent index, key, kind, length of a list)``; container 0 is the destination, container
    ``n + 1`` is entry ``n``."""
    tensors: tuple[_Bound, ...]
    """``(manifest index, container index, key, memory)``."""
    leaves: tuple[tuple[int, Any, TreePath], ...] | None = None
    """``(container index, key, place in the tree)`` of every leaf; None: unknown (walk the tree)."""
    branches: tuple[Branch, ...] = ()
    """The containers filled in place, with their number of items in the tree."""

    @classmethod
    def compile(
        cls, dest: dict[Any, Any], paths: dict[int, KeyPath], leaves: list[Leaf | Branch] | None = None
    ) -> Binding | None:
        """The binding of ``paths`` (recorded while ``dest`` was filled or saved) and of its ``leaves``
        (recorded while it was filled), or None when a path does not lead to a tensor in ``dest`` now or
        there is nothing to bind."""
        if not paths or not all(paths.values()):
            return None
        index: dict[KeyPath, int] = {(): 0}
        specs: list[tuple[int, Any, Any]] = []
        tensors = []
        root = next(iter(paths.values()))[0][0]
        for i in sorted(paths):
            path = paths[i]
            if path[0][0] != root:
                return None
            parent = 0
            for depth in range(1, len(path)):
                prefix = path[:depth]
                found = index.get(prefix)
                if found is None:
                    specs.append((parent, path[depth - 1][1], path[depth][0]))
                    found = index[prefix] = len(specs)
                parent = found
            tensors.append((i, parent, path[-1][1]))
        objects = cls._resolve(dest, root, [(p, k, kind, None) for p, k, kind in specs])
        if objects is None:
            return None
        containers = tuple(
            (p, k, kind, len(objects[n + 1]) if kind is list else None)
            for n, (p, k, kind) in enumerate(specs)
        )
        out = []
        for i, parent, key in tensors:
            t = _get(objects[parent], key)
            if not isinstance(t, torch.Tensor):
                return None
            out.append((i, parent, key, _memory(t)))
        bound_leaves: list[tuple[int, Any, Any]] | None = None
        branches: tuple[Branch, ...] = ()
        if leaves is not None:
            bound_leaves = []
            branches = tuple(b for b in leaves if isinstance(b, Branch))
            leaf_nodes = [leaf for leaf in leaves if isinstance(leaf, Leaf)]
            wheres = {leaf.where for leaf in leaf_nodes}
            for leaf in leaf_nodes:
                if any(leaf.where[:k] in wheres for k in range(1, len(leaf.where))):
                    continue  # inside a larger leaf, restored with it
                parent_at = index.get(leaf.where[:-1])
                if parent_at is None or type(objects[parent_at]) is tuple:
                    bound_leaves = None  # a leaf outside the bound containers: walk the tree instead
                    break
                bound_leaves.append((parent_at, leaf.where[-1][1], leaf.at))
        kept = None if bound_leaves is None else tuple(bound_leaves)
        return cls(root, containers, tuple(out), kept, branches)

    @staticmethod
    def _resolve(
        dest: Any, root: Any, containers: Sequence[tuple[int, Any, Any, int | None]]
    ) -> list[Any] | None:
        if type(dest) is not root:
            return None
        resolved = [dest]
        for parent, key, kind, length in containers:
            child = _get(resolved[parent], key)
            if not _kind_matches(child, kind, length):
                return None
            resolved.append(child)
        return resolved

    def resolve(self, dest: dict[Any, Any]) -> Bound | None:
        """The bound tensors and leaf containers in ``dest``, or None if ``dest`` changed."""
        resolved = self._resolve(dest, self.root, self.containers)
        if resolved is None:
            return None
        out = []
        for i, parent, key, memory in self.tensors:
            t = _get(resolved[parent], key)
            if not isinstance(t, torch.Tensor) or _memory(t) != memory:
                return None
            out.append((i, t))
        leaves = None if self.leaves is None else [(resolved[p], key, at) for p, key, at in self.leaves]
        return Bound(out, leaves, self.branches)


def _memory(t: torch.Tensor) -> _Memory:
    local = local_shard(t) if is_dtensor(t) else t
    return (local.data_ptr(), t.dtype, t.shape, t.stride(), t.get_device())


def _get(container: Any, key: Any) -> Any:
    try:
        return container[key]
    except (KeyError, IndexError, TypeError):
        return _MISSING


class BindingCache:
    """The bindings of the last few state structures (thread-safe: saves record them in the background)."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self._bindings: collections.OrderedDict[Signature, Binding] = collections.OrderedDict()
        self._signatures: collections.OrderedDict[int, tuple[Manifest, Signature]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def signature(self, manifest: Manifest) -> Signature:
        """The manifest's signature (computed once per manifest object)."""
        with self._lock:
            known = self._signatures.get(id(manifest))
        if known is not None and known[0] is manifest:
            return known[1]
        signature = manifest_signature(manifest)
        with self._lock:
            self._signatures[id(manifest)] = (manifest, signature)
            while len(self._signatures) > self.capacity:
                self._signatures.popitem(last=False)
        return signature

    def resolve(self, manifest: Manifest, dest: dict[Any, Any]) -> Bound | None:
        signature = self.signature(manifest)
        with self._lock:
            binding = self._bindings.get(signature)
        return None if binding is None else binding.resolve(dest)

    def resolve_saved(self, state: dict[Any, Any], flat: FlatState) -> bool:
        """Whether the binding of ``flat``'s structure already leads to its tensors in ``state``."""
        with self._lock:
            binding = self._bindings.get(flat_signature(flat))
        found = None if binding is None else binding.resolve(state)
        return found is not None and all(t is flat.tensors[i] for i, t in found.tensors)

    def remember(
        self,
        signature: Signature,
        dest: dict[Any, Any],
        paths: dict[int, KeyPath],
        leaves: list[Leaf | Branch] | None = None,
    ) -> bool:
        """Compile and keep the binding of ``paths`` in ``dest`` for ``signature`` (False: cannot bind)."""
        binding = Binding.compile(dest, paths, leaves)
        with self._lock:
            if binding is None:
                self._bindings.pop(signature, None)
                return False
            self._bindings[signature] = binding
            self._bindings.move_to_end(signature)
            while len(self._bindings) > self.capacity:
                self._bindings.popitem(last=False)
        return True

    def remember_loaded(
        self, manifest: Manifest, dest: dict[Any, Any], paths: dict[int, KeyPath], leaves: list[Leaf | Branch]
    ) -> bool:
        return self.remember(self.signature(manifest), dest, paths, leaves)

    def remember_saved(self, state: dict[Any, Any], flat: FlatState, tensors: Sequence[torch.Tensor]) -> bool:
        """Bind the state dict a save flattened (``flat`` with recorded paths), if its tensors are still
        the ones that save copied (``tensors``, by identity)."""
        if flat.paths is None or len(flat.tensors) != len(tensors):
            return False
        if any(a is not b for a, b in zip(flat.tensors, tensors, strict=True)):
            return False
        return self.remember(flat_signature(flat), state, flat.paths)

    def clear(self) -> None:
        with self._lock:
            self._bindings.clear()
            self._signatures.clear()
