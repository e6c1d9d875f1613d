"""GcsStore against the real fake-gcs-server through the real google-cloud-storage client, with the
fault proxy in front for 5xx, stalls and resets; paths the emulator cannot produce use explicit fakes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from google.api_core import exceptions as api_exceptions
from google.cloud.storage.exceptions import DataCorruption

from tests.backup.helpers import FAST_RETRY, KiB, MiB, make_store
from tierckpt.protocol.integrity import crc32c
from tierckpt_demo.fakegcs import FakeGcsServer, FaultProxy, FaultRule
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore, RetryPolicy, crc32c_b64, crc32c_from_b64
from tierckpt_replicator.backup.store import (
    ObjectInfo,
    ObjectNotFound,
    PreconditionFailed,
    StoreError,
    TransientStoreError,
    UploadCorrupted,
)

pytestmark = pytest.mark.e2e


@pytest.fixture
def blob_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(8 * MiB + 300 * KiB + 17)  # over 8 MiB: a resumable upload of 256 KiB chunks
    path = tmp_path / "data-00000.bin"
    path.write_bytes(data)
    return path, data


def _upload(store: GcsStore, key: str, path: Path, **kw: Any) -> ObjectInfo:
    """``upload_file`` of a whole file (the store reads the descriptor the caller opened)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return store.upload_file(key, fd, **kw)
    finally:
        os.close(fd)


def _download(store: GcsStore, key: str, size: int, tmp_path: Path, start: int = 0) -> tuple[bytes, int]:
    out = tmp_path / f"dl-{start}"
    out.write_bytes(b"\0" * size)
    fd = os.open(out, os.O_WRONLY)
    try:
        crc = store.download_to(key, fd, start=start, length=size, file_offset=0)
    finally:
        os.close(fd)
    return out.read_bytes(), crc


def test_resumable_upload_crc_checked_and_ranged_download(store: GcsStore, blob_file, tmp_path: Path) -> None:
    path, data = blob_file
    info = _upload(store, "a/b/data", path, crc32c=crc32c(data))
    assert (info.size, info.crc32c) == (len(data), crc32c(data))
    region = _upload(store, "a/b/region", path, offset=1000, length=300 * KiB)
    assert region.crc32c == crc32c(data[1000 : 1000 + 300 * KiB])
    got, crc = _download(store, "a/b/data", len(data), tmp_path)
    assert got == data and crc == crc32c(data)
    got, crc = _download(store, "a/b/data", 5000, tmp_path, start=777)
    assert got == data[777:5777] and crc == crc32c(data[777:5777])


def test_create_only_and_small_objects(store: GcsStore) -> None:
    store.put_bytes("x/c.json", b"{}", create_only=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("x/c.json", b"{1}", create_only=True)
    assert store.get_bytes("x/c.json", max_size=10) == b"{}"
    store.put_bytes("x/c.json", b"[1,2,3]")  # overwrite allowed without create_only
    with pytest.raises(StoreError, match="larger than"):
        store.get_bytes("x/c.json", max_size=3)
    with pytest.raises(ObjectNotFound):
        store.get_bytes("x/missing", max_size=10)
    assert store.stat("x/missing") is None
    assert store.stat("x/c.json").size == 7  # type: ignore[union-attr]


def test_list_delete_compose(store: GcsStore, tmp_path: Path) -> None:
    for key in ("p/s/1/a", "p/s/1/b", "p/s/2/a", "p/t"):
        store.put_bytes(key, key.encode())
    objects, dirs = store.list("p/s/", delimiter="/")
    assert objects == [] and dirs == ["p/s/1/", "p/s/2/"]
    objects, _ = store.list("p/")
    assert [o.name for o in objects] == ["p/s/1/a", "p/s/1/b", "p/s/2/a", "p/t"]
    info = store.compose("p/joined", ["p/s/1/a", "p/s/2/a"])
    assert info.crc32c == crc32c(b"p/s/1/ap/s/2/a") and info.size == 14
    assert store.delete("p/t") is True and store.delete("p/t") is False


def test_5xx_and_resets_are_retried_with_backoff(
    gcs_server: FakeGcsServer, bucket: str, proxy: FaultProxy, blob_file, tmp_path: Path
) -> None:
    path, data = blob_file
    store = make_store(proxy.url, bucket)
    proxy.add_rule(FaultRule(action="status", status=503, method="POST", times=2))
    proxy.add_rule(FaultRule(action="reset_midway", method="PUT", after_bytes=100 * KiB, skip=1, times=1))
    proxy.add_rule(FaultRule(action="status", status=500, method="PUT", skip=3, times=1))
    assert _upload(store, "k", path, crc32c=crc32c(data)).crc32c == crc32c(data)
    proxy.add_rule(FaultRule(action="status", status=502, method="GET", times=2))
    proxy.add_rule(FaultRule(action="reset", method="GET", times=1))
    assert _download(store, "k", len(data), tmp_path)[0] == data
    actions = [h.action for h in proxy.hits]
    assert actions.count("status") == 5 and "reset_midway" in actions and "reset" in actions


def test_a_download_cut_short_resumes_from_the_last_byte(
    bucket: str, proxy: FaultProxy, blob_file, tmp_path: Path
) -> None:
    path, data = blob_file
    store = make_store(proxy.url, bucket)
    _upload(store, "big", path)
    proxy.add_rule(FaultRule(action="cut_response", method="GET", path="alt=media", after_bytes=3 * MiB + 5))
    got, crc = _download(store, "big", len(data) - 100, tmp_path, start=50)
    assert got == data[50:-50] and crc == crc32c(data[50:-50])
    media = [h for h in proxy.hits if "alt=media" in h.target]
    assert [h.action for h in media] == ["cut_response", "forward"]
    assert "generation=" in media[1].target  # resumed on the same object generation


def test_a_stalled_request_times_out_and_is_retried(bucket: str, proxy: FaultProxy) -> None:
    store = make_store(proxy.url, bucket, read_timeout=0.3)
    proxy.add_rule(FaultRule(action="stall", seconds=10, method="POST", times=1))
    store.put_bytes("s", b"hello", create_only=True)
    assert store.get_bytes("s", max_size=100) == b"hello"
    posts = [h.action for h in proxy.hits if h.method == "POST"]
    assert posts == ["stall", "forward"]


def test_an_ambiguous_create_only_write_reads_as_precondition_failed(bucket: str, proxy: FaultProxy) -> None:
    """The server stored it but the answer was lost; the retry finds the object (412). Callers of
    create-only writes must then compare the object with what they meant to write."""
    store = make_store(proxy.url, bucket)
    proxy.add_rule(FaultRule(action="drop_response", method="POST", path="uploadType=multipart", times=1))
    with pytest.raises(PreconditionFailed):
        store.put_bytes("once", b"mine", create_only=True)
    assert store.get_bytes("once", max_size=10) == b"mine"


def test_persistent_failure_surfaces_as_transient_after_the_deadline(bucket: str, proxy: FaultProxy) -> None:
    store = make_store(proxy.url, bucket, retry=RetryPolicy(initial=0.01, maximum=0.05, deadline=0.5))
    proxy.add_rule(FaultRule(action="status", status=503, times=None))
    with pytest.raises(TransientStoreError):
        store.put_bytes("never", b"x")
    with pytest.raises(TransientStoreError):
        store.list("any/")
    assert len(proxy.hits) > 2  # it did retry


def test_unreachable_endpoint_is_transient(bucket: str) -> None:
    store = make_store(
        "http://127.0.0.1:9", bucket, retry=RetryPolicy(initial=0.01, maximum=0.02, deadline=0.2)
    )
    with pytest.raises(TransientStoreError):
        store.stat("x")


def test_crc_helpers_round_trip() -> None:
    for value in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        assert crc32c_from_b64(crc32c_b64(value)) == value
    assert crc32c_from_b64(None) is None


# ------------------------------------------------------------------ paths the emulator cannot produce


class _RejectingBlob:
    """A blob whose upload fails the way real GCS fails when the declared crc32c does not match."""

    def __init__(self, exc: Exception) -> None:
        self.exc, self.crc32c, self.name = exc, None, "k"

    def upload_from_file(self, *a: object, **k: object) -> None:
        raise self.exc


class _FakeBucket:
    def __init__(self, blob: object) -> None:
        self._blob = blob

    def blob(self, *a: object, **k: object) -> object:
        return self._blob

    def delete_blob(self, *a: object, **k: object) -> None:
        raise api_exceptions.NotFound("gone")


class _FakeClient:
    def __init__(self, blob: object) -> None:
        self._bucket = _FakeBucket(blob)

    def bucket(self, name: str) -> _FakeBucket:
        return self._bucket


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (api_exceptions.BadRequest("Provided CRC32C doesn't match calculated CRC32C"), StoreError),
        (DataCorruption(None, "Checksum mismatch while uploading"), UploadCorrupted),
        (api_exceptions.PreconditionFailed("exists"), PreconditionFailed),
        (api_exceptions.ServiceUnavailable("down"), TransientStoreError),
        (api_exceptions.Forbidden("no access"), StoreError),
    ],
)
def test_server_side_rejections_are_translated(blob_file, exc: Exception, expected: type) -> None:
    path, data = blob_file
    store = GcsStore(GcsSettings(bucket="b", retry=FAST_RETRY), client=_FakeClient(_RejectingBlob(exc)))
    with pytest.raises(expected):
        _upload(store, "k", path, crc32c=crc32c(data))


def test_a_stored_object_with_the_wrong_crc_is_deleted_and_refused(store: GcsStore, blob_file) -> None:
    """A precondition or server check GCS would apply is missing in the emulator (it accepts any declared
    crc32c and computes its own), so the store's own comparison is what catches a rotted local file."""
    path, data = blob_file
    with pytest.raises(UploadCorrupted):
        _upload(store, "rotten", path, crc32c=crc32c(data) ^ 1)
    assert store.stat("rotten") is None


class _RecordingBlob:
    """Records how the store asks for an upload (the emulator ignores preconditions on resumable ones)."""

    def __init__(self) -> None:
        self.kwargs: dict[str, object] = {}
        self.name, self.size, self.generation, self.updated, self.crc32c = "k", 0, 1, None, None
        self.metadata: dict[str, str] | None = None

    def upload_from_string(self, data: bytes, **kwargs: object) -> None:
        self.kwargs = kwargs
        self.size, self.crc32c = len(data), crc32c_b64(crc32c(data))


def test_create_only_writes_carry_the_precondition_whatever_their_size() -> None:
    """Above 8 MiB the client switches to a resumable upload, where real GCS still enforces
    ``ifGenerationMatch`` (fake-gcs-server would not); the store must always pass it."""
    blob = _RecordingBlob()
    store = GcsStore(GcsSettings(bucket="b", retry=FAST_RETRY), client=_FakeClient(blob))
    store.put_bytes("complete/000000000001.json", b"x" * (9 * MiB), create_only=True)
    assert blob.kwargs["if_generation_match"] == 0
    store.put_bytes("steps/000000000001/rank-00000/COMMIT", b"{}")
    assert blob.kwargs["if_generation_match"] is None
