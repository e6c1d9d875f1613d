"""Settings dataclasses filled from command-line flags, then environment variables, then defaults.

The daemons (``tierckpt-replicator``, ``tierckpt-operator``) each declare one frozen ``Settings``
dataclass whose fields carry their help text; this module holds the one way such a dataclass is
typed, read from ``<PREFIX><FIELD>`` environment variables and merged with parsed flags.

A field marked ``group`` (``metadata={"group": "..."}``, its default a dataclass of options) groups
options by concern: its own fields are options as if they were the outer class's (the same flags and
variables, ``option_fields``), and the group is built from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["env_name", "field_type", "from_env", "merge_settings", "option_fields"]

S = TypeVar("S")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_name(prefix: str, field: str) -> str:
    """``TIERCKPT_REPLICATOR_`` + ``data_port`` -> ``TIERCKPT_REPLICATOR_DATA_PORT``."""
    return prefix + field.upper()


def field_type(f: dataclasses.Field[Any]) -> type:
    """The type a flag or environment value of field ``f`` is parsed as, from its default."""
    if isinstance(f.default, bool):
        return bool
    if isinstance(f.default, (int, float)):
        return type(f.default)
    return Path if "Path" in str(f.type) else str


def from_env(f: dataclasses.Field[Any], raw: str, *, prefix: str) -> Any:
    """Parse one environment value for field ``f``; a bad value raises ``ValueError`` naming the variable."""
    kind, name = field_type(f), env_name(prefix, f.name)
    if kind is bool:
        if raw.strip().lower() in _TRUE:
            return True
        if raw.strip().lower() in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean")
    try:
        return kind(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from exc


def option_fields(cls: type[Any]) -> Iterator[dataclasses.Field[Any]]:
    """Every option of settings class ``cls``: its fields, a group's fields in its place."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("group"):
            yield from option_fields(f.default_factory)  # type: ignore[arg-type]  # the group's class
        else:
            yield f


def merge_settings(cls: type[S], args: Mapping[str, Any], environ: Mapping[str, str], *, prefix: str) -> S:
    """Build ``cls``: a given flag wins, then ``<prefix><FIELD>`` from ``environ``, then the default."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.metadata.get("group"):
            group: Any = f.default_factory  # the group's class
            values[f.name] = merge_settings(group, args, environ, prefix=prefix)
        elif args.get(f.name) is not None:
            values[f.name] = args[f.name]
        elif env_name(prefix, f.name) in environ:
            values[f.name] = from_env(f, environ[env_name(prefix, f.name)], prefix=prefix)
    return cls(**values)
