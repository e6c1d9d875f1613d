"""Typed JSON encoding for the frozen dataclasses that make up tierckpt's files and wire messages.

Every message type is a frozen dataclass with a class-level ``KIND`` and ``VERSION``. ``encode`` writes
``{"kind": ..., "version": ..., **fields}``; ``decode`` checks both and rebuilds nested dataclasses,
tuples, enums and dicts from the type hints. Unknown fields are ignored (forward compatible within a
major version); a missing required field or a wrong type raises ``FormatError``. No pickle, ever.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from typing import Any, ClassVar, TypeVar

from tierckpt.protocol.errors import FormatError

__all__ = ["Message", "decode", "decode_bytes", "encode", "encode_bytes"]

T = TypeVar("T", bound="Message")


class Message:
    """Mixin for versioned message dataclasses."""

    KIND: ClassVar[str]
    VERSION: ClassVar[int] = 1

    def to_dict(self) -> dict[str, Any]:
        return encode(self)

    def to_bytes(self) -> bytes:
        return encode_bytes(self)

    @classmethod
    def from_dict(cls: type[T], data: Any) -> T:
        return decode(cls, data)

    @classmethod
    def from_bytes(cls: type[T], data: bytes | str) -> T:
        return decode_bytes(cls, data)


_SCALARS = (int, str, float, bool, type(None))


def _plain(value: Any) -> Any:
    if type(value) in _SCALARS:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        if all(type(v) in _SCALARS for v in value):
            return list(value)
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def encode(msg: Message) -> dict[str, Any]:
    """The JSON-ready dict of a message, with its kind and version first."""
    return {"kind": msg.KIND, "version": msg.VERSION, **_plain(msg)}


def encode_bytes(msg: Message) -> bytes:
    return json.dumps(encode(msg), separators=(",", ":"), sort_keys=False).encode()


def decode_bytes(cls: type[T], data: bytes | str) -> T:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{cls.KIND}: not valid JSON ({exc})") from exc
    return decode(cls, obj)


def decode(cls: type[T], data: Any) -> T:
    """Rebuild ``cls`` from a dict, checking kind and version."""
    if not isinstance(data, dict):
        raise FormatError(f"{cls.KIND}: expected a JSON object, got {type(data).__name__}")
    kind, version = data.get("kind"), data.get("version")
    if kind != cls.KIND:
        raise FormatError(f"expected a {cls.KIND!r} message, got kind {kind!r}")
    if not isinstance(version, int) or version < 1 or version > cls.VERSION:
        raise FormatError(
            f"{cls.KIND}: unsupported version {version!r} (this build reads up to {cls.VERSION})"
        )
    return _build(cls, data, cls.KIND)


@functools.cache
def _fields_and_hints(cls: type) -> tuple[tuple[dataclasses.Field[Any], ...], dict[str, Any]]:
    """Resolving type hints is slow; messages with thousands of records resolve them once per class."""
    return dataclasses.fields(cls), typing.get_type_hints(cls)


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise FormatError(f"{where}: expected an object")
    fields, hints = _fields_and_hints(cls)
    kwargs = {}
    for f in fields:
        if f.name in data:
            kwargs[f.name] = _coerce(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise FormatError(f"{where}: missing field {f.name!r}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise FormatError(f"{where}: {exc}") from exc


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except FormatError as exc:
                errors.append(str(exc))
        raise FormatError(f"{where}: {value!r} matches none of {args}")
    if origin is typing.Literal:
        if value not in args:
            raise FormatError(f"{where}: {value!r} is not one of {args}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise FormatError(f"{where}: expected a list")
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            if args[0] in (int, str, bool) and all(type(v) is args[0] for v in value):
                return tuple(value)  # fast path for long homogeneous arrays; errors take the slow path
            return tuple(_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if origin is tuple:
            if len(value) != len(args):
                raise FormatError(f"{where}: expected {len(args)} items")
            pairs = enumerate(zip(args, value, strict=True))
            return tuple(_coerce(a, v, f"{where}[{i}]") for i, (a, v) in pairs)
        return [_coerce(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise FormatError(f"{where}: expected an object")
        ktype, vtype = args
        return {_coerce_key(ktype, k, where): _coerce(vtype, v, f"{where}[{k}]") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError as exc:
            raise FormatError(f"{where}: {exc}") from exc
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FormatError(f"{where}: expected a number")
        return float(value)
    if tp in (int, str, bool):
        if type(value) is not tp:
            raise FormatError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return value
    return value


def _coerce_key(tp: Any, key: str, where: str) -> Any:
    if tp is int:
        try:
            return int(key)
        except ValueError as exc:
            raise FormatError(f"{where}: key {key!r} is not an integer") from exc
    return key
