"""Stateful objects in a state dict: ``{"model": model, "optim": optimizer}`` saved and loaded as DCP does.

A top-level value with ``state_dict()`` and ``load_state_dict()`` (a module, an optimizer, an LR
scheduler, a data loader, any object of that protocol) is saved as its ``state_dict()`` and loaded by
filling that state dict in place, then handing it to ``load_state_dict`` (skipped for a module whose
tensors were all filled in place: its parameters already hold the checkpoint). Optimizers found this way
are the ones a ``Checkpointer`` registers for overlap mode, so a save never has to wait for their state.

An optimizer that has not stepped yet holds no state to fill; ``init_state`` creates it first, as the
optimizer itself would, by one step on zero gradients with a learning rate of 0 (gradients and learning
rates are put back afterwards).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["Expanded", "expand", "init_state", "is_stateful"]


def is_stateful(value: Any) -> bool:
    """Whether ``value`` is saved through its ``state_dict`` (not a container, not a tensor)."""
    if isinstance(value, (Mapping, list, tuple, torch.Tensor)):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


@dataclasses.dataclass(frozen=True)
class Expanded:
    """A state dict whose stateful values are replaced by their state dicts, and those objects by key."""

    state: dict[Any, Any]
    objects: dict[Any, Any]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [v for v in self.objects.values() if isinstance(v, torch.optim.Optimizer)]

    def finish_load(self, original: dict[Any, Any]) -> None:
        """After ``state`` was filled: hand each object's state dict to its ``load_state_dict``, and put
        the other values back into ``original`` (the caller's dict, which keeps its objects)."""
        if not self.objects:
            return
        for key, value in self.state.items():
            if key not in self.objects:
                original[key] = value
        for key, obj in self.objects.items():
            loaded = self.state[key]
            if isinstance(obj, torch.nn.Module) and _filled_in_place(obj, loaded):
                continue
            obj.load_state_dict(loaded)


def expand(state: dict[Any, Any], *, for_load: bool = False) -> Expanded:
    """``state`` with each stateful top-level value replaced by its ``state_dict()`` (the same dict when
    there is none; the dict type is kept). ``for_load``: optimizers that have not stepped get their state
    first (``init_state``), so that there is state to fill."""
    objects = {k: v for k, v in state.items() if is_stateful(v)} if isinstance(state, dict) else {}
    if not objects:  # (not a dict at all: flattening it says so)
        return Expanded(state, {})
    if for_load:
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                init_state(obj)
    out = type(state)()
    for key, value in state.items():
        out[key] = value.state_dict() if key in objects else value
    return Expanded(out, objects)


def _filled_in_place(module: torch.nn.Module, loaded: Mapping[str, Any]) -> bool:
    """Whether every tensor of the module's state dict is the very memory ``loaded`` holds."""
    for key, value in module.state_dict().items():
        other = loaded.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(other, torch.Tensor)):
            return False
        if other.data_ptr() != value.data_ptr() or other.shape != value.shape or other.dtype != value.dtype:
            return False
    return True


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state of an optimizer that has not stepped (a no-op once it has): one step on zero
    gradients at a learning rate of 0, so every state tensor exists where the optimizer keeps it."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if not params:
        return
    grads = [p.grad for p in params]
    rates = [group.get("lr") for group in optimizer.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            if "lr" in group:
                group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, rates, strict=True):
            if lr is not None:
                group["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
