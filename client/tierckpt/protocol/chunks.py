"""Content-addressed chunks of bucket layout 3: their size, names and the byte-grouping transform.

A data file is cut into chunks at fixed boundaries (``plan_chunks``: at every large tensor's start and
end, every ``TENSOR_CHUNK_SIZE`` bytes inside a large tensor and every ``CHUNK_SIZE`` bytes between
large tensors). A chunk is
named by the SHA-256 of its raw bytes (``chunk_name``), so two equal chunks of a job (a frozen tensor
saved again at the next step, a buffer that never changes) are one object. The name is what a reader
verifies the content against: a chunk is trusted only once its decoded bytes hash to its name.

Byte grouping (``group_bytes``) puts byte ``i`` of every ``width``-byte element together (the
exponent bytes of bf16 or fp32 values apart from their mantissa bytes), which makes float data more
compressible by a general-purpose codec (docs/benchmarks.md, "Bucket codecs"). Pure functions, no I/O.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Iterable

__all__ = [
    "CHUNK_SIZE",
    "MAX_CHUNKS",
    "MAX_CHUNK_SIZE",
    "MIN_CUT",
    "TENSOR_CHUNK_SIZE",
    "ChunkDigest",
    "chunk_name",
    "group_bytes",
    "is_chunk_name",
    "plan_chunks",
    "ungroup_bytes",
]

CHUNK_SIZE = 4 << 20
"""The most raw bytes a chunk holds between large tensors (where small tensors share chunks): the bytes
a changed small tensor drags along stay few."""

TENSOR_CHUNK_SIZE = 16 << 20
"""The most raw bytes a chunk inside one large tensor holds: a tensor changes or stays as a whole (a
frozen weight is the same chunks at every step whatever their size), and a restore makes a request per
chunk: 64 a GiB, where 4 MiB chunks made 256 (docs/benchmarks.md, "Bucket layout 3")."""

MAX_CHUNK_SIZE = 64 << 20
"""The largest chunk a reader accepts from a chunk list (whatever its ``chunk_size`` says): bounds what
one chunk costs a reader in memory (a compressed chunk is decoded in memory) and in one request."""

MIN_CUT = 256 << 10
"""Tensors of at least this many bytes start and end a chunk (``plan_chunks``)."""

MAX_CHUNKS = 1 << 20
"""Chunks one file may have (4 TiB of small tensors): bounds a chunk list read from the bucket."""

_NAME = re.compile(r"[0-9a-f]{64}")


def chunk_name(raw: bytes | memoryview) -> str:
    """The chunk's name: the hex SHA-256 of its raw (decoded) bytes."""
    return hashlib.sha256(raw).hexdigest()


class ChunkDigest:
    """A chunk's name taken as its bytes go by, in order (``update``), without holding them: after the
    last, ``name()`` is ``chunk_name`` of them all."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: bytes | memoryview, /) -> None:
        self._hash.update(data)

    def name(self) -> str:
        return self._hash.hexdigest()


def is_chunk_name(name: str) -> bool:
    return _NAME.fullmatch(name) is not None


def plan_chunks(
    size: int,
    spans: Iterable[tuple[int, int]] = (),
    chunk_size: int = CHUNK_SIZE,
    min_cut: int = MIN_CUT,
    tensor_chunk_size: int = TENSOR_CHUNK_SIZE,
) -> list[tuple[int, int]]:
    """``(offset, length)`` of each chunk of a ``size``-byte file whose tensors lie at ``spans``
    (``(offset, length)``, from the manifest).

    Boundaries are fixed, not content-defined: every tensor of at least ``min_cut`` bytes starts and
    ends a chunk, and inside such a tensor a chunk ends every ``tensor_chunk_size`` bytes; between such
    tensors a chunk ends every ``chunk_size`` bytes. A rank's files hold the same tensors at the same
    offsets at every step of a job, so an unchanged large tensor (a frozen weight) is the same chunks at
    every step, whatever changes around it, and the small tensors between two large ones (adapters,
    norms, their optimizer state) share one chunk instead of dirtying a large tensor's. Content-defined
    chunking would find the same boundaries only by hashing a rolling window over every byte, more CPU
    than the upload itself on a 2-vCPU node (docs/benchmarks.md)."""
    cuts = {0, size}
    large = set()
    for offset, length in spans:
        if length >= min_cut and offset >= 0 and offset + length <= size:
            cuts.update((offset, offset + length))
            large.add((offset, offset + length))
    points = sorted(cuts)
    inside = _covered(large, points)
    return [
        (off, min(stride, end - off))
        for i, (start, end) in enumerate(itertools.pairwise(points))
        for stride in (tensor_chunk_size if inside[i] else chunk_size,)
        for off in range(start, end, stride)
    ]


def _covered(spans: set[tuple[int, int]], points: list[int]) -> list[bool]:
    """For each segment between successive ``points`` (every span's ends among them), whether one of
    ``spans`` (``(start, end)``) covers it (a sweep: linear in the spans and points)."""
    index = {p: i for i, p in enumerate(points)}
    delta = [0] * len(points)
    for start, end in spans:
        delta[index[start]] += 1
        delta[index[end]] -= 1
    return [depth > 0 for depth in itertools.accumulate(delta[:-1])]


def group_bytes(data: bytes | memoryview, width: int) -> bytes:
    """Byte ``i`` of every ``width``-byte element together, plane after plane; a tail shorter than an
    element stays as it is, at the end."""
    data = bytes(data)
    if width <= 1:
        return data
    whole = len(data) - len(data) % width
    body = data[:whole]
    return b"".join(body[i::width] for i in range(width)) + data[whole:]


def ungroup_bytes(data: bytes | memoryview, width: int) -> bytes:
    """The inverse of ``group_bytes``."""
    data = bytes(data)
    if width <= 1:
        return data
    whole = len(data) - len(data) % width
    plane = whole // width
    out = bytearray(len(data))
    for i in range(width):
        out[i:whole:width] = data[i * plane : (i + 1) * plane]
    out[whole:] = data[whole:]
    return bytes(out)
