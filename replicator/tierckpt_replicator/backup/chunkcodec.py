"""How a chunk's bytes are stored in the bucket (layout 3): the codecs and the compression policy.

Codecs (the suffix of ``chunks/<sha256>.<codec>``):

- ``raw``: the bytes as they are;
- ``zst``: zstd, level 1;
- ``g2zst``, ``g4zst``, ``g8zst``: byte grouping of 2-, 4- or 8-byte elements
  (``tierckpt.protocol.chunks.group_bytes``), then zstd level 1.

``Compression`` is the policy (``BackupSettings.compression``): ``off`` stores every chunk raw, ``zstd``
compresses with plain zstd, ``grouped`` groups the bytes by the element size of the tensor that fills
most of the chunk first. A chunk that does not shrink by at least 2% is stored raw (decoding it then
costs nothing). The default and the measurements behind it: docs/benchmarks.md, "Bucket codecs".

``decode`` is the reader's side and trusts nothing: the stored size was bounded before the download,
the output is bounded by the raw size the chunk list declares, and the caller checks the SHA-256.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Literal

import zstandard

from tierckpt.protocol.chunks import group_bytes, ungroup_bytes
from tierckpt.protocol.errors import CorruptShardError
from tierckpt.protocol.format import TensorEntry

__all__ = ["CODECS", "Compression", "chunk_width", "decode", "encode", "stored_limit"]

Compression = Literal["off", "zstd", "grouped"]

CODECS = ("raw", "zst", "g2zst", "g4zst", "g8zst")
_WORTH = 0.98
"""A chunk is stored compressed only if that saves at least 2%."""

_local = threading.local()


def _zc() -> zstandard.ZstdCompressor:
    z = getattr(_local, "c", None)
    if z is None:
        z = _local.c = zstandard.ZstdCompressor(level=1)
    return z


def _zd() -> zstandard.ZstdDecompressor:
    z = getattr(_local, "d", None)
    if z is None:
        z = _local.d = zstandard.ZstdDecompressor()
    return z


def stored_limit(size: int) -> int:
    """The most bytes a chunk of ``size`` raw bytes may occupy in the bucket under any codec (zstd's
    worst case, ``ZSTD_compressBound``, with room to spare)."""
    return size + (size >> 7) + (1 << 10)


def encode(raw: bytes, policy: Compression, width: int) -> tuple[str, bytes]:
    """``(codec, stored bytes)`` of a chunk under ``policy`` (``width``: its element size)."""
    if policy == "off" or not raw:
        return "raw", raw
    if policy == "grouped" and width in (2, 4, 8):
        codec, blob = f"g{width}zst", _zc().compress(group_bytes(raw, width))
    else:
        codec, blob = "zst", _zc().compress(raw)
    if len(blob) > _WORTH * len(raw):
        return "raw", raw
    return codec, blob


def decode(blob: bytes, codec: str, size: int, *, what: str) -> bytes:
    """The raw bytes of a stored chunk, exactly ``size`` of them, or ``CorruptShardError``."""
    if codec == "raw":
        raw = blob
    elif codec in CODECS:
        try:
            raw = _zd().decompress(blob, max_output_size=size)
        except zstandard.ZstdError as exc:
            raise CorruptShardError(f"{what}: does not decode ({exc})", path=what) from None
        if codec != "zst":
            raw = ungroup_bytes(raw, int(codec[1]))
    else:
        raise CorruptShardError(f"{what}: unknown codec {codec!r}", path=what)
    if len(raw) != size:
        raise CorruptShardError(f"{what}: {len(raw)} bytes decoded, {size} expected", path=what)
    return raw


_WIDTHS = {"float64": 8, "int64": 8, "uint64": 8, "complex64": 8, "float32": 4, "int32": 4, "uint32": 4}
_WIDTHS |= {"bfloat16": 2, "float16": 2, "half": 2, "int16": 2, "uint16": 2}


def _width(dtype: str) -> int:
    return _WIDTHS.get(dtype.rsplit(".", 1)[-1], 1)


def chunk_width(tensors: Sequence[TensorEntry], offset: int, length: int) -> int:
    """The element size of the dtype that covers most of ``file[offset:offset+length]`` (``tensors``:
    the file's, sorted by offset); 1 where no tensor does (pickled objects)."""
    cover: dict[int, int] = {}
    end = offset + length
    for t in tensors:
        lo, hi = max(t.offset, offset), min(t.offset + t.length, end)
        if hi > lo:
            w = _width(t.dtype)
            cover[w] = cover.get(w, 0) + hi - lo
    return max(cover, key=lambda w: cover[w]) if cover else 1
