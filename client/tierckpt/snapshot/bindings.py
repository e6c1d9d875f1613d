"""Where a step's tensors go in a destination state dict, remembered between loads (and from saves).

A load walks the manifest's state tree alongside the destination to pair each saved tensor with the
tensor it fills; for a model and its optimizer (2,000 tensors) that walk costs about 10 ms of Python,
as long as copying a gigabyte to the GPU. A ``Binding`` keeps its outcome: the key path from the root
to every destination tensor, with a weak reference to that tensor. The next load of a step of the
same *structure* (the same tensor keys, dtypes and shapes, in the same order) resolves the paths in
the destination, one lookup per container and per tensor, and when every path still leads to the
same tensor objects with the same dtype, shape and device, it starts every copy at once; the tree
walk that follows only restores what is not a tensor, while the copies run. Anything else (a tensor
replaced, resized or moved, a container of another type, a shorter list) falls back to the walk,
which records a new binding.

A save records one too (``remember_saved``): loading back into the dict that was saved, the usual
way to roll back in place, skips the first walk as well. Bindings hold no tensor alive.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from tierckpt.protocol.format import Manifest
from tierckpt.snapshot.dtypes import dtype_name
from tierckpt.snapshot.flatten import FlatState, KeyPath

__all__ = ["Binding", "BindingCache", "Signature", "flat_signature", "manifest_signature"]

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]
"""``(key, dtype name, shape)`` of every tensor, in manifest order."""

_MISSING = object()
_Bound = tuple[int, int, Any, "weakref.ref[torch.Tensor]", torch.dtype, torch.Size, torch.device]


def manifest_signature(manifest: Manifest) -> Signature:
    return tuple((t.key, t.dtype, tuple(t.shape)) for t in manifest.tensors)


def flat_signature(flat: FlatState) -> Signature:
    pairs = zip(flat.keys, flat.tensors, strict=True)
    return tuple((key, dtype_name(t.dtype) or "", tuple(t.shape)) for key, t in pairs)


def _kind_matches(value: Any, kind: Any) -> bool:
    if type(kind) is tuple:  # (tuple, length)
        return type(value) is tuple and len(value) == kind[1]
    return type(value) is kind


@dataclasses.dataclass(frozen=True)
class Binding:
    """Key paths of a destination's tensors, compiled into container and tensor lookups."""

    root: Any
    """The kind of the destination dict itself."""
    containers: tuple[tuple[int, Any, Any], ...]
    """``(parent index, key, kind)``; container 0 is the destination, container ``n + 1`` is entry ``n``."""
    tensors: tuple[_Bound, ...]
    """``(manifest index, container index, key, tensor, dtype, shape, device)``."""

    @classmethod
    def compile(cls, dest: dict[Any, Any], paths: dict[int, KeyPath]) -> Binding | None:
        """The binding of ``paths`` (recorded while ``dest`` was filled or saved), or None when a path
        does not lead to a tensor in ``dest`` now or there is nothing to bind."""
        if not paths:
            return None
        index: dict[KeyPath, int] = {}
        containers: list[tuple[int, Any, Any]] = []
        tensors = []
        root = next(iter(paths.values()))[0][0]
        for i in sorted(paths):
            path = paths[i]
            if not path or path[0][0] != root:
                return None
            parent = 0
            for depth in range(1, len(path)):
                prefix = path[:depth]
                found = index.get(prefix)
                if found is None:
                    containers.append((parent, path[depth - 1][1], path[depth][0]))
                    found = index[prefix] = len(containers)
                parent = found
            tensors.append((i, parent, path[-1][1]))
        resolved = cls._containers(dest, root, tuple(containers))
        if resolved is None:
            return None
        out = []
        for i, parent, key in tensors:
            t = _get(resolved[parent], key)
            if not isinstance(t, torch.Tensor):
                return None
            out.append((i, parent, key, weakref.ref(t), t.dtype, t.shape, t.device))
        return cls(root, tuple(containers), tuple(out))

    @staticmethod
    def _containers(dest: Any, root: Any, containers: tuple[tuple[int, Any, Any], ...]) -> list[Any] | None:
        if type(dest) is not root:
            return None
        resolved = [dest]
        for parent, key, kind in containers:
            child = _get(resolved[parent], key)
            if not _kind_matches(child, kind):
                return None
            resolved.append(child)
        return resolved

    def resolve(self, dest: dict[Any, Any]) -> list[tuple[int, torch.Tensor]] | None:
        """``(manifest index, destination tensor)`` for every bound tensor, or None if ``dest`` changed."""
        resolved = self._containers(dest, self.root, self.containers)
        if resolved is None:
            return None
        out = []
        for i, parent, key, ref, dtype, shape, device in self.tensors:
            t = ref()
            if (
                t is None
                or _get(resolved[parent], key) is not t
                or t.dtype != dtype
                or t.shape != shape
                or t.device != device
            ):
                return None
            out.append((i, t))
        return out


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

    def resolve(self, manifest: Manifest, dest: dict[Any, Any]) -> list[tuple[int, torch.Tensor]] | None:
        signature = self.signature(manifest)
        with self._lock:
            binding = self._bindings.get(signature)
        return None if binding is None else binding.resolve(dest)

    def resolve_saved(self, state: dict[Any, Any], flat: FlatState) -> bool:
        """Whether the binding of ``flat``'s structure already leads to its tensors in ``state``."""
        with self._lock:
            binding = self._bindings.get(flat_signature(flat))
        found = None if binding is None else binding.resolve(state)
        return found is not None and all(t is flat.tensors[i] for i, t in found)

    def remember(self, signature: Signature, dest: dict[Any, Any], paths: dict[int, KeyPath]) -> bool:
        """Compile and keep the binding of ``paths`` in ``dest`` for ``signature`` (False: cannot bind)."""
        binding = Binding.compile(dest, paths)
        with self._lock:
            if binding is None:
                self._bindings.pop(signature, None)
                return False
            self._bindings[signature] = binding
            self._bindings.move_to_end(signature)
            while len(self._bindings) > self.capacity:
                self._bindings.popitem(last=False)
        return True

    def remember_loaded(self, manifest: Manifest, dest: dict[Any, Any], paths: dict[int, KeyPath]) -> bool:
        return self.remember(self.signature(manifest), dest, paths)

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
