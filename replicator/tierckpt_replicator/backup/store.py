"""The object-store boundary of the backup service: what it needs from a bucket, and its errors.

``ObjectStore`` is the protocol the uploader, the restorer and the catalog are written against.
``tierckpt_replicator.backup.gcs.GcsStore`` implements it with google-cloud-storage; tests put
explicit fakes here to reach paths an emulator cannot (server-side checksum rejection, preconditions
on resumable uploads). Every method blocks: the service runs them in its thread pool.

Errors: ``ObjectNotFound`` (404), ``PreconditionFailed`` (412: a create-only write found the object, a
conditional one another generation or none), ``UploadCorrupted`` (the stored object's crc32c is not the
one the caller expected; the object was deleted), ``TransientStoreError`` (5xx, timeouts, resets still
failing after the retry policy gave up; safe to retry later) and ``StoreError`` for anything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from tierckpt.protocol.errors import RetryableError, TierckptError

__all__ = [
    "LIST_PAGE",
    "Digest",
    "ObjectInfo",
    "ObjectNotFound",
    "ObjectStore",
    "PreconditionFailed",
    "StoreError",
    "TransientStoreError",
    "UploadCorrupted",
]


LIST_PAGE = 1000
"""Results per listing request (GCS's maximum page)."""


class Digest(Protocol):
    """What a download can feed its bytes to as they arrive (a ``hashlib`` hash)."""

    def update(self, data: bytes, /) -> None: ...


class StoreError(TierckptError):
    """An object-store request failed, and retrying the same request will not help."""


class TransientStoreError(StoreError, RetryableError):
    """A transient failure (5xx, timeout, connection reset) outlasted the retry policy."""


class ObjectNotFound(StoreError):
    pass


class PreconditionFailed(StoreError):
    """A create-only write found the object already there, or a write conditional on a generation found
    another one or none (HTTP 412)."""


class UploadCorrupted(StoreError):
    """The uploaded object's crc32c differs from the expected one; the object has been deleted."""


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    name: str
    size: int
    crc32c: int | None
    generation: int
    updated: float
    """Last modification, seconds since the epoch."""
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """The object's custom metadata (listings return it too)."""


class ObjectStore(Protocol):
    """One bucket. Keys are full object names (built by ``tierckpt.protocol.bucket_layout``)."""

    def upload_file(
        self, key: str, fd: int, *, offset: int = 0, length: int | None = None, crc32c: int | None = None
    ) -> ObjectInfo:
        """Resumable upload of bytes ``offset:offset+length`` of the open file ``fd`` (to the end if
        ``length`` is None; the descriptor stays open: the caller opened it confined to its job tree).

        With ``crc32c``, the object must end up with exactly that checksum (GCS also checks it server
        side); otherwise it is deleted and ``UploadCorrupted`` raised. Overwrites an existing object.
        """
        ...

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        create_only: bool = False,
        if_generation: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        """Single-request upload. ``create_only``: ``PreconditionFailed`` if the object exists.
        ``if_generation``: ``PreconditionFailed`` unless the object exists with this generation.
        ``metadata``: the object's custom metadata (sent in the same request)."""
        ...

    def get_bytes(self, key: str, *, max_size: int) -> bytes:
        """A small object's bytes; ``StoreError`` if it is larger than ``max_size``."""
        ...

    def download_to(
        self,
        key: str,
        fd: int,
        *,
        start: int,
        length: int,
        file_offset: int,
        on_bytes: Callable[[int], None] | None = None,
        digest: Digest | None = None,
    ) -> int:
        """Write ``object[start:start+length]`` to ``fd`` at ``file_offset``; return the crc32c of the
        bytes written. ``on_bytes(n)`` is called as bytes arrive; ``digest`` is updated with every byte
        written, in order, once (a resumed download feeds it only what it had not yet)."""
        ...

    def stat(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str, *, delimiter: str | None = None) -> tuple[list[ObjectInfo], list[str]]:
        """Objects under ``prefix`` (with their metadata); with a delimiter also the sub-prefixes
        ("directories"). One request per 1,000 results (``LIST_PAGE``)."""
        ...

    def delete(self, key: str) -> bool:
        """Delete an object; False if it did not exist."""
        ...

    def compose(self, key: str, sources: Sequence[str]) -> ObjectInfo:
        """Concatenate up to 32 objects into ``key`` (server side)."""
        ...
