"""Adapter classes built on first use: a tierckpt mixin over a framework's class, so importing an
integration module never imports the framework."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["framework_subclass"]


def framework_subclass(
    namespace: dict[str, Any], name: str, mixin: type, base: tuple[str, str], doc: str
) -> type:
    """``class name(mixin, base)`` for ``base`` = (module, class), cached in ``namespace`` (the
    integration module's globals, so its ``__getattr__`` runs once)."""
    module, attr = base
    cls = type(
        name,
        (mixin, getattr(importlib.import_module(module), attr)),
        {"__doc__": doc, "__module__": namespace["__name__"]},
    )
    namespace[name] = cls
    return cls
