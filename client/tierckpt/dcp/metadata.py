"""DCP's global ``Metadata`` as typed JSON (``dcp-metadata.json``): never pickled.

DCP's own ``FileSystemWriter`` pickles ``Metadata``. We store the same object graph as a versioned
``_codec`` message instead, so every rank (and every tool) can read it without unpickling anything:

* ``entries``: one ``EntryRecord`` per state-dict key, in DCP's order. A tensor entry carries its
  ``TensorProperties`` (dtype, layout, requires_grad, memory_format, pin_memory), its global size and its
  chunks (offsets, sizes); an entry without ``tensor`` is ``BytesStorageMetadata`` (a pickled user object).
  Its ``items`` say who holds each saved item (``MetadataIndex``: fqn, offset, index hint): the process
  rank DCP chose to write it, and the ranks holding identical copies, as columns (big jobs have 10^5
  chunks). Each holder's manifest says where in its step the bytes are, and their crc32c.
* ``save_id``: the coordinator's id of this save, recorded in every rank's manifest too.
* ``planner_data``: the default planner's flatten mapping (fqn -> object path) or any JSON value.

Pure: no I/O. ``encode_metadata`` / ``decode_metadata`` convert to and from ``torch``'s ``Metadata``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tierckpt.protocol.codec import Message, Record
from tierckpt.protocol.errors import FormatError
from tierckpt.snapshot.dtypes import dtype_name, torch_dtype

__all__ = [
    "DcpMetadata",
    "EntryRecord",
    "ItemLocation",
    "LocationsRecord",
    "PlannerDataRecord",
    "StorageMetaRecord",
    "TensorPropertiesRecord",
    "TensorRecord",
    "decode_metadata",
    "encode_metadata",
    "item_holders",
    "tensor_dtype_name",
]

METADATA_VERSION = 2
"""2: items list their holder ranks; where the bytes are is in each holder's manifest (1 also listed
file, offset, length and crc32c per item; such files still decode)."""


# ------------------------------------------------------------------------------ torch enum names


def _torch_name(value: object) -> str:
    return str(value).removeprefix("torch.")


def _from_torch_name(name: str, kind: type, what: str) -> Any:
    value = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(value, kind):
        raise FormatError(f"unknown torch {what} {name!r} in DCP metadata")
    return value


def tensor_dtype_name(dtype: torch.dtype) -> str:
    """The manifest name of a dtype (``torch.bfloat16`` -> ``"bfloat16"``); FormatError if not storable."""
    name = dtype_name(dtype)
    if name is None:
        raise FormatError(f"dtype {dtype} cannot be stored as raw bytes")
    return name


# ------------------------------------------------------------------------------ records


@dataclasses.dataclass(frozen=True)
class TensorPropertiesRecord(Record):
    dtype: str
    layout: str = "strided"
    requires_grad: bool = False
    memory_format: str = "contiguous_format"
    pin_memory: bool = False


@dataclasses.dataclass(frozen=True)
class TensorRecord(Record):
    """``TensorStorageMetadata``: properties, global size, and the chunks (n x ndim, flattened row-major)."""

    properties: TensorPropertiesRecord
    size: tuple[int, ...]
    chunk_count: int
    chunk_offsets: tuple[int, ...]
    chunk_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        want = len(self.size) * self.chunk_count
        if len(self.chunk_offsets) != want or len(self.chunk_sizes) != want:
            raise FormatError(f"{self.chunk_count} chunks of a {len(self.size)}-d tensor need {want} numbers")


@dataclasses.dataclass(frozen=True)
class LocationsRecord(Record):
    """The saved items of one entry, one column per field (arrays keep big jobs' metadata fast to load).

    Item ``i`` is ``MetadataIndex(fqn, index_offsets[i*ndim:(i+1)*ndim], hint)`` (offset None and
    ``ndim`` 0 for objects; hint ``-1`` means None), written by process rank ``ranks[i]`` (the rank DCP
    chose); ``copies[i]``, when present, lists the other ranks that hold an identical copy (one on each
    node that would otherwise lack it). Each holder's manifest says where the bytes are: the entry keyed
    ``item_key(index)`` gives the data file, offset, length and crc32c.
    """

    index_offsets: tuple[int, ...] = ()
    index_hints: tuple[int, ...] = ()
    ranks: tuple[int, ...] = ()
    copies: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.ranks)
        if len(self.index_hints) != n:
            raise FormatError("item location columns have different lengths")
        if (n and min(self.ranks) < 0) or any(c and min(c) < 0 for c in self.copies.values()):
            raise FormatError("item ranks must be non-negative")
        if self.copies and not 0 <= min(self.copies) <= max(self.copies) < n:
            raise FormatError("a copy names an item that does not exist")

    def holders(self, i: int) -> tuple[int, ...]:
        """Every rank holding item ``i``: the writer DCP chose first, then the copies."""
        return (self.ranks[i], *self.copies.get(i, ()))


@dataclasses.dataclass(frozen=True)
class EntryRecord(Record):
    """One state-dict key: a tensor (``tensor`` set) or a pickled object (``tensor`` None), and its items."""

    fqn: str
    tensor: TensorRecord | None = None
    items: LocationsRecord = LocationsRecord()


@dataclasses.dataclass(frozen=True)
class ItemLocation:
    """Where one saved item's bytes are: ``file[offset:offset+length]`` of ``rank``'s step directory.

    The ``storage_data`` of DCP's ``WriteResult`` (what the coordinator's ``finish`` checks).
    """

    rank: int
    file: str
    offset: int
    length: int
    crc32c: int


@dataclasses.dataclass(frozen=True)
class PlannerDataRecord(Record):
    """``Metadata.planner_data``: the default planner's flatten mapping, or another JSON value."""

    flatten_mapping: dict[str, tuple[str | int, ...]] | None = None
    value: Any = None


@dataclasses.dataclass(frozen=True)
class StorageMetaRecord(Record):
    checkpoint_id: str | None = None
    save_id: str | None = None
    modules: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class DcpMetadata(Message):
    """``dcp-metadata.json``: the global metadata of one DCP save.

    The coordinator builds it while planning (before any byte is written) and hands it to one rank of
    every node, which writes it into its own step: every node holds the metadata of its ranks' steps.
    ``save_id`` is the coordinator's id of this save; every rank's manifest records the same one, so a
    reader can tell that a rank's step is the one this checkpoint was saved with.
    """

    KIND = "tierckpt.dcp-metadata"
    VERSION = METADATA_VERSION

    job: str
    step: int
    world_size: int
    coordinator: int
    entries: tuple[EntryRecord, ...]
    save_id: str = ""
    planner_data: PlannerDataRecord | None = None
    storage_meta: StorageMetaRecord | None = None
    dcp_version: str | None = None

    @property
    def ranks_with_data(self) -> list[int]:
        """Every rank that holds at least one item (as DCP's writer or as a copy)."""
        ranks = {r for e in self.entries for r in e.items.ranks}
        ranks.update(r for e in self.entries for c in e.items.copies.values() for r in c)
        return sorted(ranks)


# ------------------------------------------------------------------------------ encode


def _properties_record(p: TensorProperties) -> TensorPropertiesRecord:
    return TensorPropertiesRecord(
        dtype=tensor_dtype_name(p.dtype),
        layout=_torch_name(p.layout),
        requires_grad=bool(p.requires_grad),
        memory_format=_torch_name(p.memory_format),
        pin_memory=bool(p.pin_memory),
    )


def _tensor_record(md: TensorStorageMetadata) -> TensorRecord:
    offsets = tuple(int(v) for c in md.chunks for v in c.offsets)
    sizes = tuple(int(v) for c in md.chunks for v in c.sizes)
    return TensorRecord(_properties_record(md.properties), tuple(md.size), len(md.chunks), offsets, sizes)


def _locations_record(
    fqn: str, ndim: int | None, items: list[tuple[MetadataIndex, tuple[int, ...]]]
) -> LocationsRecord:
    """Columns of one entry's items; ``ndim`` None for an object entry (its items have no offset)."""
    offsets: list[int] = []
    hints: list[int] = []
    ranks: list[int] = []
    copies: dict[int, tuple[int, ...]] = {}
    for i, (index, holders) in enumerate(items):
        offset = None if index.offset is None else tuple(index.offset)
        if (offset is None) != (ndim is None) or (offset is not None and len(offset) != ndim):
            raise FormatError(f"item {fqn!r}: index offset {offset} does not fit its entry ({ndim} dims)")
        offsets.extend(offset or ())
        hints.append(-1 if index.index is None else index.index)
        ranks.append(holders[0])
        if len(holders) > 1:
            copies[i] = tuple(holders[1:])
    return LocationsRecord(tuple(offsets), tuple(hints), tuple(ranks), copies)


def _planner_data_record(data: Any) -> PlannerDataRecord | None:
    if data is None:
        return None
    if isinstance(data, dict) and all(
        isinstance(k, str) and isinstance(v, tuple) and all(type(p) in (str, int) for p in v)
        for k, v in data.items()
    ):
        return PlannerDataRecord(flatten_mapping=data)
    try:
        json.dumps(data, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FormatError(
            f"planner_data of type {type(data).__name__} cannot be stored as JSON ({exc}); "
            "tierckpt never pickles checkpoint metadata"
        ) from exc
    return PlannerDataRecord(value=data)


def _storage_meta_record(meta: StorageMeta | None) -> StorageMetaRecord | None:
    if meta is None:
        return None
    cid = None if meta.checkpoint_id is None else str(meta.checkpoint_id)
    return StorageMetaRecord(checkpoint_id=cid, save_id=meta.save_id, modules=tuple(meta.modules))


def encode_metadata(
    metadata: Metadata,
    holders: dict[MetadataIndex, tuple[int, ...]],
    *,
    job: str,
    step: int,
    world_size: int,
    coordinator: int,
    save_id: str = "",
) -> DcpMetadata:
    """The typed record of ``metadata`` (its entries, planner data and storage meta); ``holders`` gives,
    for every saved item, the ranks holding it: the one DCP chose first, then its copies."""
    by_fqn: dict[str, list[tuple[MetadataIndex, tuple[int, ...]]]] = {}
    for index, ranks in holders.items():
        if not ranks:
            raise FormatError(f"saved item {index.fqn!r} has no holder")
        by_fqn.setdefault(index.fqn, []).append((index, ranks))
    unknown = set(by_fqn) - set(metadata.state_dict_metadata)
    if unknown:
        raise FormatError(f"saved items {sorted(unknown)[:5]} have no entry in the DCP metadata")
    entries = []
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            tensor, ndim = _tensor_record(md), len(md.size)
        elif isinstance(md, BytesStorageMetadata):
            tensor, ndim = None, None
        else:
            raise FormatError(f"DCP metadata entry {fqn!r} has unsupported type {type(md).__name__}")
        items = sorted(by_fqn.get(fqn, []), key=lambda it: -1 if it[0].index is None else it[0].index)
        entries.append(EntryRecord(fqn, tensor, _locations_record(fqn, ndim, items)))
    return DcpMetadata(
        job=job,
        step=step,
        world_size=world_size,
        coordinator=coordinator,
        entries=tuple(entries),
        save_id=save_id,
        planner_data=_planner_data_record(metadata.planner_data),
        storage_meta=_storage_meta_record(metadata.storage_meta),
        dcp_version=metadata.version,
    )


# ------------------------------------------------------------------------------ decode


def _properties(r: TensorPropertiesRecord) -> TensorProperties:
    return TensorProperties(
        dtype=torch_dtype(r.dtype),
        layout=_from_torch_name(r.layout, torch.layout, "layout"),
        requires_grad=r.requires_grad,
        memory_format=_from_torch_name(r.memory_format, torch.memory_format, "memory format"),
        pin_memory=r.pin_memory,
    )


def _storage_type(t: TensorRecord | None) -> TensorStorageMetadata | BytesStorageMetadata:
    if t is None:
        return BytesStorageMetadata()
    ndim = len(t.size)
    span = [slice(i * ndim, (i + 1) * ndim) for i in range(t.chunk_count)]
    offsets, sizes = t.chunk_offsets, t.chunk_sizes
    chunks = [ChunkStorageMetadata(torch.Size(offsets[c]), torch.Size(sizes[c])) for c in span]
    return TensorStorageMetadata(properties=_properties(t.properties), size=torch.Size(t.size), chunks=chunks)


def item_holders(e: EntryRecord) -> dict[MetadataIndex, tuple[int, ...]]:
    """Every item of one entry -> the ranks holding it (DCP's writer first)."""
    ndim = 0 if e.tensor is None else len(e.tensor.size)
    items = e.items
    if len(items.index_offsets) != ndim * len(items.ranks):
        raise FormatError(f"entry {e.fqn!r}: item offsets do not match its {ndim} dimensions")
    out = {}
    for i in range(len(items.ranks)):
        offset = None if e.tensor is None else items.index_offsets[i * ndim : (i + 1) * ndim]
        hint = items.index_hints[i]
        out[MetadataIndex(e.fqn, offset, None if hint < 0 else hint)] = items.holders(i)
    return out


def _planner_data(r: PlannerDataRecord | None) -> Any:
    if r is None:
        return None
    return r.flatten_mapping if r.flatten_mapping is not None else r.value


def decode_metadata(record: DcpMetadata) -> Metadata:
    """``torch``'s ``Metadata``; its ``storage_data`` maps each ``MetadataIndex`` to its holder ranks."""
    storage_data: dict[MetadataIndex, tuple[int, ...]] = {}
    for e in record.entries:
        storage_data.update(item_holders(e))
    sm = record.storage_meta
    storage_meta = None if sm is None else StorageMeta(sm.checkpoint_id, sm.save_id, None, list(sm.modules))
    return Metadata(
        state_dict_metadata={e.fqn: _storage_type(e.tensor) for e in record.entries},
        planner_data=_planner_data(record.planner_data),
        storage_data=storage_data,
        storage_meta=storage_meta,
        version=record.dcp_version,
    )
