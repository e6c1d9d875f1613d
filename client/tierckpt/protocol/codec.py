"""Typed JSON for the frozen dataclasses that make up tierckpt's files and wire messages (pydantic).

Every message type is a frozen dataclass deriving from ``Message``, with a class-level ``KIND`` and
``VERSION``; the records nested in messages derive from ``Record``. ``encode`` writes
``{"kind": ..., "version": ..., **fields}``; ``decode`` checks both, then validates the fields with
pydantic against the type hints, strictly: a wrong type, a missing field, a NaN or infinite number,
an integer outside the signed 64-bit range (in any typed field, dict keys included; fields typed
``Any``, such as a manifest's state tree, carry the user's own values and are exempt), a malformed or
too deeply nested document all raise ``FormatError``. Unknown fields are ignored (forward compatible
within a major version). The dataclasses' own ``__post_init__`` checks run too. No pickle, ever.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import typing
from typing import Any, ClassVar, TypeVar

import pydantic
import pydantic.json_schema

from tierckpt.protocol.errors import FormatError

__all__ = [
    "Message",
    "Record",
    "decode",
    "decode_bytes",
    "encode",
    "encode_bytes",
    "encode_from_parts",
    "json_schema",
    "record_bytes",
]

T = TypeVar("T", bound="Message")
R = TypeVar("R", bound="Record")


class Record:
    """Base of every dataclass that appears inside a message: the validation rules, in one place."""

    __pydantic_config__: ClassVar[pydantic.ConfigDict] = pydantic.ConfigDict(
        strict=True, allow_inf_nan=False, extra="ignore"
    )


class Message(Record):
    """Base of versioned message dataclasses (files and wire bodies)."""

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


_adapters: dict[type[Record], pydantic.TypeAdapter[Any]] = {}


def _adapter(cls: type[R]) -> pydantic.TypeAdapter[R]:
    """Building a validator is slow; each message class builds it once (a plain dict rather than
    ``functools.cache``, whose ``Hashable`` argument mypy does not accept a class object for)."""
    adapter = _adapters.get(cls)
    if adapter is None:
        adapter = _adapters[cls] = pydantic.TypeAdapter(cls)
    return adapter


def _envelope(cls: type[Message]) -> bytes:
    return b'{"kind":' + json.dumps(cls.KIND).encode() + b',"version":' + str(cls.VERSION).encode()


def encode(msg: Message) -> dict[str, Any]:
    """The JSON-ready dict of a message, with its kind and version first."""
    fields = _adapter(type(msg)).dump_python(msg, mode="json")
    return {"kind": msg.KIND, "version": msg.VERSION, **fields}


def encode_bytes(msg: Message) -> bytes:
    """Compact JSON of a message, with its kind and version first."""
    body = _adapter(type(msg)).dump_json(msg)
    return _envelope(type(msg)) + (b"}" if body == b"{}" else b"," + body[1:])


def record_bytes(record: Record) -> bytes:
    """Compact JSON of a record's fields, as ``encode_bytes`` writes it inside a message (a message
    nested in another travels without its envelope)."""
    return _adapter(type(record)).dump_json(record)


def encode_from_parts(msg: Message, parts: dict[str, bytes]) -> bytes:
    """``encode_bytes(msg)``, byte for byte, with its last fields taken from ``parts`` (each field's JSON:
    its ``record_bytes``, made once for the many messages that share it, or ``b"null"``) instead of
    encoded again. ``parts`` must name the message's last fields (the JSON keeps the fields' order)."""
    names = [f.name for f in dataclasses.fields(msg)]  # type: ignore[arg-type]  # every message is one
    tail = names[len(names) - len(parts) :]
    if set(tail) != set(parts):
        raise ValueError(f"{msg.KIND}: {sorted(parts)} are not its last fields {tail}")
    head = _adapter(type(msg)).dump_json(msg, exclude=set(parts))
    fields = [head[1:-1]] if head != b"{}" else []
    fields += [b'"' + name.encode() + b'":' + parts[name] for name in tail]
    return _envelope(type(msg)) + b"".join(b"," + f for f in fields) + b"}"


def decode(cls: type[T], data: Any) -> T:
    """Rebuild ``cls`` from a decoded JSON object (a dict), checking kind and version."""
    if not isinstance(data, dict):
        raise FormatError(f"{cls.KIND}: expected a JSON object, got {type(data).__name__}")
    try:
        body = json.dumps(data, allow_nan=True)
    except (TypeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{cls.KIND}: not a JSON document ({exc})") from exc
    return decode_bytes(cls, body)


def decode_bytes(cls: type[T], data: bytes | str) -> T:
    """Parse and validate one ``cls`` message from JSON text."""
    try:
        head = _Head.model_validate_json(data)
    except pydantic.ValidationError as exc:
        raise FormatError(f"{cls.KIND}: {_first_error(exc)}") from exc
    if head.kind != cls.KIND:
        raise FormatError(f"expected a {cls.KIND!r} message, got kind {head.kind!r}")
    version = head.version
    if type(version) is not int or not 1 <= version <= cls.VERSION:
        raise FormatError(
            f"{cls.KIND}: unsupported version {version!r} (this build reads up to {cls.VERSION})"
        )
    try:
        msg = _adapter(cls).validate_json(data)
    except pydantic.ValidationError as exc:
        raise FormatError(f"{cls.KIND}: {_first_error(exc)}") from exc
    if _MAY_EXCEED_INT64.search(data if isinstance(data, bytes) else data.encode()):
        _check_ints(msg, cls.KIND)
    return msg


_MAY_EXCEED_INT64 = re.compile(rb"\d{19}|\d[eE]")
"""Text that may hold an integer outside ``INT_MIN..INT_MAX``: a run of 19 digits (every integer of 18
digits or fewer is inside), or a number with an exponent (which validation may turn into an integer).
Messages without either skip the walk of ``_check_ints`` (29,000 calls for a DCP metadata record of
1,000 tensors)."""


INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1
"""The range of every integer in a message (a field's own check may narrow it)."""
_SCALARS = (str, bytes, float, bool, enum.Enum)

_int_fields: dict[type[Any], tuple[str, ...]] = {}


def _fields_to_check(cls: type[Any]) -> tuple[str, ...]:
    """The fields of a record that may hold integers: all but those typed ``Any`` or a plain scalar."""
    names = _int_fields.get(cls)
    if names is None:
        try:
            hints = typing.get_type_hints(cls)
        except Exception:  # a hint that cannot be resolved at run time: check the field's value anyway
            hints = {}
        names = tuple(
            f.name
            for f in dataclasses.fields(cls)
            if not (
                hints.get(f.name) is Any
                or (isinstance(hints.get(f.name), type) and issubclass(hints[f.name], _SCALARS))
            )
        )
        _int_fields[cls] = names
    return names


def _check_ints(value: Any, where: str) -> None:
    """``FormatError`` if an integer in ``value`` (a decoded message) is outside ``INT_MIN..INT_MAX``."""
    if type(value) is int:
        if not INT_MIN <= value <= INT_MAX:
            raise FormatError(f"{where}: an integer of {value.bit_length()} bits exceeds the 64-bit range")
    elif isinstance(value, (tuple, list)):
        for item in value:
            _check_ints(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_ints(key, where)
            _check_ints(item, where)
    elif isinstance(value, Record):  # every record is a dataclass
        for name in _fields_to_check(type(value)):
            _check_ints(getattr(value, name), f"{where}: {name}")


class _WireSchema(pydantic.json_schema.GenerateJsonSchema):
    """JSON Schema as the bytes travel: an object with integer keys (rank -> ..., step -> ...) says so,
    so a schema-driven generator (a fuzzer) produces keys the message accepts."""

    def dict_schema(self, schema: Any) -> Any:
        out = super().dict_schema(schema)
        if schema.get("keys_schema", {}).get("type") == "int":
            out["propertyNames"] = {"pattern": r"^(0|-?[1-9][0-9]*)$"}
        return out


def json_schema(cls: type[Message]) -> dict[str, Any]:
    """The JSON Schema of ``cls`` as it travels: its fields plus the ``kind``/``version`` envelope."""
    schema = _adapter(cls).json_schema(mode="serialization", schema_generator=_WireSchema)
    props = schema.setdefault("properties", {})
    schema["properties"] = {
        "kind": {"const": cls.KIND, "type": "string"},
        "version": {"type": "integer", "minimum": 1, "maximum": cls.VERSION},
        **props,
    }
    schema["required"] = ["kind", "version", *schema.get("required", [])]
    return schema


class _Head(pydantic.BaseModel):
    """What every message starts with; anything else is checked once the kind is known."""

    model_config = pydantic.ConfigDict(extra="ignore", strict=True)
    kind: Any = None
    version: Any = None


def _first_error(exc: pydantic.ValidationError) -> str:
    """The first validation error as ``where: what`` (a message names the field, not the input)."""
    err = exc.errors(include_url=False, include_input=False)[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where + ': ' if where else ''}{err['msg']}{more}"
