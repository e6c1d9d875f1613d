"""Bucket layout 3: content-addressed chunks, compression, and deleting chunks no step needs.

Pure parts (the chunk plan, the codecs, the checks a reader makes) are tested directly. The retention
property runs real ``BackupService``s on an in-memory bucket with GCS's semantics (``MemoryBucket``,
every request delayed a random moment so that nodes interleave): two nodes back up successive steps
whose tensors partly change, retention retires old steps and sweeps chunks while the other node
uploads, and a purge comes at a random moment. Everything else runs against the real fake-gcs-server
through google-cloud-storage: a frozen fine-tune saved by the real ``Checkpointer`` (uploads after the
first, against a layout 2 upload of the same steps, and a bit-exact restore), a corrupt and a missing
chunk, a rotted local shard, and layout 2 steps restored by this version.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.backup.helpers import KiB, chunk_list, make_service, make_store, saved_as, write_peers
from tests.backup.scale_rig import MemoryBucket
from tierckpt import Checkpointer
from tierckpt.protocol.bucket_layout import BucketLayout, ChunkList, ChunkRef, FileChunks, RankBackup
from tierckpt.protocol.chunks import (
    CHUNK_SIZE,
    MAX_CHUNK_SIZE,
    MIN_CUT,
    TENSOR_CHUNK_SIZE,
    chunk_name,
    group_bytes,
    plan_chunks,
    ungroup_bytes,
)
from tierckpt.protocol.errors import CorruptShardError, FormatError
from tierckpt.protocol.format import (
    FileEntry,
    Manifest,
    TensorEntry,
    commit_step,
    rank_dir,
    replica_rank_dir,
    step_dir,
)
from tierckpt.protocol.integrity import crc32c
from tierckpt.protocol.replica import ReplicaRecord, content_key, group_id
from tierckpt_demo.chaos.tiers import BucketView
from tierckpt_demo.fakegcs import FakeGcsServer
from tierckpt_demo.step_writer import step_files
from tierckpt_replicator.backup import chunkstore
from tierckpt_replicator.backup.chunkcodec import decode, encode
from tierckpt_replicator.backup.chunkstore import check_chunks
from tierckpt_replicator.backup.service import BackupService
from tierckpt_replicator.backup.spread import data_rank
from tierckpt_replicator.backup.store import ObjectInfo, ObjectNotFound

JOB = "default_chunks_0123abcd"
LAYOUT = BucketLayout("t")


# --------------------------------------------------------------------------------------------- pure parts


def test_large_tensors_start_and_end_chunks_and_small_ones_between_share_one() -> None:
    big, small = 5 << 20, 1000
    spans = [(0, big), (big, small), (big + small, small), (big + 2 * small, big)]
    plan = plan_chunks(2 * big + 2 * small, spans, tensor_chunk_size=CHUNK_SIZE)
    assert plan == [
        (0, CHUNK_SIZE),
        (CHUNK_SIZE, big - CHUNK_SIZE),
        (big, 2 * small),  # both small tensors, and nothing of a large one
        (big + 2 * small, CHUNK_SIZE),
        (big + 2 * small + CHUNK_SIZE, big - CHUNK_SIZE),
    ]
    assert plan_chunks(0) == [] and plan_chunks(10, [(5, 100 << 20)]) == [(0, 10)]  # a span past the end


def test_chunks_inside_a_large_tensor_are_larger_than_between_tensors() -> None:
    """Inside a large tensor a chunk ends every ``TENSOR_CHUNK_SIZE`` bytes (fewer requests a GiB);
    the small tensors between large ones, and a file without large ones, keep ``CHUNK_SIZE``."""
    mib = 1 << 20
    big, small = 2 * TENSOR_CHUNK_SIZE + 3 * mib, 1000
    gap = 9 * mib  # many small tensors: no large one to cut at
    spans = [(0, big), *((big + i * small, small) for i in range(gap // small)), (big + gap, 5 * mib)]
    plan = plan_chunks(big + gap + 5 * mib, spans)
    assert plan == [
        (0, TENSOR_CHUNK_SIZE),
        (TENSOR_CHUNK_SIZE, TENSOR_CHUNK_SIZE),
        (2 * TENSOR_CHUNK_SIZE, 3 * mib),
        (big, CHUNK_SIZE),
        (big + CHUNK_SIZE, CHUNK_SIZE),
        (big + 2 * CHUNK_SIZE, gap - 2 * CHUNK_SIZE),
        (big + gap, 5 * mib),  # one chunk: the whole tensor
    ]
    assert plan_chunks(9 * mib) == [(0, CHUNK_SIZE), (CHUNK_SIZE, CHUNK_SIZE), (2 * CHUNK_SIZE, mib)]


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 4099])
def test_byte_grouping_round_trips(width: int, n: int) -> None:
    data = random.Random(n).randbytes(n)
    assert ungroup_bytes(group_bytes(data, width), width) == data


def test_every_codec_round_trips_and_a_chunk_that_does_not_shrink_is_stored_raw() -> None:
    weights = torch.randn(1 << 16).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    noise = random.Random(1).randbytes(1 << 16)
    for policy in ("off", "zstd", "grouped"):
        codec, blob = encode(weights, policy, 2)  # type: ignore[arg-type]
        assert decode(blob, codec, len(weights), what="w") == weights
        assert (codec == "raw") == (policy == "off") and len(blob) <= len(weights)
        assert encode(noise, policy, 2)[0] == "raw"  # type: ignore[arg-type]
    assert encode(weights, "grouped", 2)[0] == "g2zst"


def test_a_chunk_decoding_to_other_than_its_declared_size_is_corrupt() -> None:
    codec, blob = encode(bytes(1 << 20), "zstd", 1)
    with pytest.raises(CorruptShardError):
        decode(blob, codec, 1000, what="bomb")  # a reader never inflates past the declared size
    with pytest.raises(CorruptShardError):
        decode(blob[:-3], codec, 1 << 20, what="torn")
    with pytest.raises(CorruptShardError):
        decode(blob, "lz4", 1 << 20, what="unknown codec")


def test_a_chunk_list_must_cover_its_file_with_bounded_chunks() -> None:
    entry = FileEntry(name="data-00000.bin", size=300, crc32c=0)

    def ref(size: int, stored: int | None = None, name: str = "a" * 64, codec: str = "raw") -> ChunkRef:
        return ChunkRef(
            name=name, codec=codec, size=size, stored=size if stored is None else stored, crc32c=0
        )

    assert check_chunks(entry, FileChunks(name=entry.name, chunks=(ref(200), ref(100))), 256) == [0, 200]
    assert check_chunks(entry, FileChunks(name=entry.name, chunks=(ref(300),)), 300) == [0]
    with pytest.raises(FormatError, match="chunk size"):  # a list may not raise every chunk's bound
        check_chunks(entry, FileChunks(name=entry.name, chunks=(ref(300),)), MAX_CHUNK_SIZE + 1)
    for bad in (
        (ref(200),),  # short of the file
        (ref(300),),  # over the chunk size
        (ref(200), ref(100, stored=10 << 20)),  # a stored size no codec produces
        (ref(200), ref(100, name="../x")),
        (ref(200), ref(100, codec="gzip")),
    ):
        with pytest.raises(FormatError):
            check_chunks(entry, FileChunks(name=entry.name, chunks=bad), 256)


# --------------------------------------------------------------------------------------------- steps


def write_tensor_step(
    root: Path,
    rank: int,
    step: int,
    tensors: list[bytes],
    world_size: int,
    *,
    group: tuple[int, ...] = (),
    objects: bytes = b"",
) -> Path:
    """Commit ``step`` of ``rank``: the given tensors back to back in one data file (saved in the
    replica group ``group`` if given: its members hold the same tensors), and ``objects`` as
    ``objects.pkl`` if given."""
    path = step_dir(rank_dir(root, JOB, rank), step)
    path.mkdir(parents=True)
    entries, offset = [], 0
    with open(path / "data-00000.bin", "wb") as f:
        for i, t in enumerate(tensors):
            f.write(t)
            entries.append(
                TensorEntry(f"t{i}", "uint8", (len(t),), "data-00000.bin", offset, len(t), crc32c(t))
            )
            offset += len(t)
    data = (path / "data-00000.bin").read_bytes()
    if objects:
        (path / "objects.pkl").write_bytes(objects)
    manifest = Manifest(
        job=JOB,
        rank=rank,
        world_size=world_size,
        step=step,
        created_at=time.time(),
        files=(
            FileEntry(name="data-00000.bin", size=len(data), crc32c=crc32c(data)),
            *((FileEntry(name="objects.pkl", size=len(objects), crc32c=crc32c(objects)),) if objects else ()),
        ),
        tensors=tuple(entries),
        tree={"t": [{"tensor": i} for i in range(len(tensors))]},
    )
    if group:
        record = ReplicaRecord(
            version=1,
            group=group_id(group),
            members=group,
            role="writer",
            source=rank,
            node="0" * 32,
            fingerprint="ab",
            diverged=False,
            differs=(),
            content=content_key(manifest.files, manifest.tensors),
            written_bytes=manifest.total_bytes,
            logical_bytes=manifest.total_bytes,
        )
        manifest = dataclasses.replace(manifest, replica=record)
    commit_step(path, manifest)
    return path


def fine_tune_tensors(rank: int, step: int, *, frozen: int = 4, size: int = 300 * KiB) -> list[bytes]:
    """``frozen`` tensors that never change (a frozen base), then one that changes at every step."""
    base = [random.Random(rank * 100 + i).randbytes(size) for i in range(frozen)]
    return [*base, random.Random(rank * 100_000 + step).randbytes(4 * KiB)]


def chunks_needed(store: Any) -> dict[int, set[str]]:
    """Complete step -> the chunk keys its ranks' chunk lists name (read along the chain)."""
    out: dict[int, set[str]] = {}
    for info in store.list(LAYOUT.complete_dir(JOB))[0]:
        step = LAYOUT.step_of_complete(JOB, info.name)
        assert step is not None
        keys: set[str] = set()
        for commit_info in store.list(LAYOUT.rank_commits_dir(JOB, step))[0]:
            rank = LAYOUT.rank_of_commit(JOB, step, commit_info.name)
            assert rank is not None
            commit = RankBackup.from_bytes(store.get_bytes(commit_info.name, max_size=1 << 20))
            if commit.chunks is None:
                continue
            listed = ChunkList.from_bytes(
                store.get_bytes(LAYOUT.chunk_list_key(JOB, step, rank, commit.save), max_size=1 << 24)
            )
            keys |= {LAYOUT.chunk_key(JOB, n, c) for n, c in listed.names()}
        out[step] = keys
    return out


# --------------------------------------------------------------------------------------------- retention


class JitteryBucket(MemoryBucket):
    """A ``MemoryBucket`` whose every request waits a random moment first, so nodes interleave."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)

    def _jitter(self) -> None:
        time.sleep(self.rng.random() * 0.002)

    def put_bytes(self, key: str, data: bytes, **kw: Any) -> ObjectInfo:
        self._jitter()
        if "/chunks/" in key:
            print("PUT", key, len(data))  # uploads take a while: other nodes' passes run meanwhile
            time.sleep(self.rng.random() * 0.05)
        return super().put_bytes(key, data, **kw)

    def delete(self, key: str) -> bool:
        self._jitter()
        return super().delete(key)

    def list(self, prefix: str, *, delimiter: str | None = None) -> tuple[list[ObjectInfo], list[str]]:
        self._jitter()
        return super().list(prefix, delimiter=delimiter)

    def stat(self, key: str) -> ObjectInfo | None:
        self._jitter()
        return super().stat(key)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**16),
    keep_last=st.integers(1, 2),
    steps=st.integers(3, 6),
    purge_at=st.one_of(st.none(), st.integers(1, 5)),
    lag=st.booleans(),
)
def test_retention_never_deletes_a_chunk_a_retained_step_needs(
    tmp_path_factory: pytest.TempPathFactory,
    seed: int,
    keep_last: int,
    steps: int,
    purge_at: int | None,
    lag: bool,
) -> None:
    """Two nodes back up steps 1..``steps`` of 4 ranks concurrently (each its own ranks; the frozen
    tensors are shared chunks across steps), retention keeps ``keep_last`` and sweeps chunks while the
    other node may be uploading; with ``lag`` node-b uploads its share of each step while node-a
    uploads the next one (reusing the chunks of a step node-b's completion retires); a purge may come
    in the middle. After every step: every chunk any
    complete step names is in the bucket. After a quiet sweep: no chunk is left that no step names.
    After the purge: nothing of the job is left."""
    tmp = tmp_path_factory.mktemp("prop")
    roots = {n: tmp / n for n in ("node-a", "node-b")}
    write_peers(roots, JOB, 4)
    bucket = JitteryBucket(seed)
    rng = random.Random(seed)

    async def run() -> None:
        services = {
            n: make_service(
                bucket, roots[n], n, keep_last=keep_last, interval_steps=1, writer_ttl=5.0, chunks=True
            )
            for n in roots
        }
        purged = False
        for step in range(1, steps + 1):
            for i, n in enumerate(sorted(roots)):
                for rank in (2 * i, 2 * i + 1):
                    tensors = fine_tune_tensors(rank, step if rng.random() < 0.8 else 0)
                    src = write_tensor_step(roots[n], rank, step, tensors, 4)
                    replica = roots[sorted(roots)[1 - i]]  # as replication leaves it: a copy on the peer
                    shutil.copytree(src, step_dir(replica_rank_dir(replica, JOB, rank), step))
            order = sorted(roots, key=lambda _: rng.random())
            behind = step - 1 if lag else step  # node-b a step behind: its share of the previous step
            tasks = [services["node-a"].on_step_committed(JOB, step, [0, 1], {})]  # completes it while
            if behind >= 1:  # node-a uploads this one, reusing chunks of a step that retention may retire
                tasks.append(services["node-b"].on_step_committed(JOB, behind, [2, 3], {}))
            rng.shuffle(tasks)
            if purge_at == step:  # the job is deleted: every node fenced, one purges, uploads in flight

                async def purge(purger: BackupService, other: BackupService, delay: float) -> None:
                    await asyncio.sleep(delay)
                    other.fences.fence_here(JOB)
                    await purger.delete_backups(JOB)

                tasks.append(purge(services[order[0]], services[order[1]], rng.random() * 0.05))
                purged = True
            await asyncio.gather(*tasks, return_exceptions=True)
            if purged:
                break
            if lag and step == steps:
                await services["node-b"].on_step_committed(JOB, step, [2, 3], {})
            for n in order:  # retention and the sweep, as each pass's housekeeping does
                await services[n].poll(JOB)
            missing = {
                s: k
                for s, keys in chunks_needed(bucket).items()
                if (k := {x for x in keys if bucket.stat(x) is None})
            }
            assert not missing, f"complete steps lost chunks: {missing}"
        if purged:
            assert bucket.list(LAYOUT.job(JOB))[0] == [], "the purge left objects of the job"
        else:
            for n in sorted(roots):  # retired steps' ranks deleted by their nodes
                await services[n].poll(JOB)
            svc = services["node-a"]
            with svc.fences.writing(JOB, steps) as lease:  # nothing else writes now: a sweep runs
                assert svc.sweeper.sweep(JOB, lease.key) is not None
            present = {o.name for o in bucket.list(LAYOUT.chunks_dir(JOB))[0]}
            listed = [o.name for o in bucket.list(LAYOUT.steps_dir(JOB))[0] if "/chunklists/" in o.name]
            named = {
                LAYOUT.chunk_key(JOB, n, c)
                for key in listed
                for n, c in ChunkList.from_bytes(bucket.get_bytes(key, max_size=1 << 24)).names()
            }
            assert present == named, "a quiet sweep left chunks no chunk list names, or deleted named ones"
            assert set().union(*chunks_needed(bucket).values()) <= present
        for svc in services.values():
            await svc.close()

    asyncio.run(run())


# --------------------------------------------------------------------------------------------- end to end


class CountingStore:
    """Counts the bytes every upload sends, on the way to the real store."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.sent = inner, 0

    def put_bytes(self, key: str, data: bytes, **kw: Any) -> ObjectInfo:
        if "/writers/" not in key:
            self.sent += len(data)
        return self.inner.put_bytes(key, data, **kw)

    def upload_file(self, key: str, fd: int, **kw: Any) -> ObjectInfo:
        info = self.inner.upload_file(key, fd, **kw)
        self.sent += info.size
        return info

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Adapted(torch.nn.Module):
    """A frozen bf16 linear layer with a trainable low-rank adapter (fp32)."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, dim) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(dim, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x.to(torch.bfloat16)).float() + x @ self.a.T @ self.b.T


def fine_tune_model(
    layers: int = 4, dim: int = 1024, rank: int = 1
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Adapted(dim, rank) for _ in range(layers)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


@pytest.mark.e2e
async def test_a_frozen_fine_tune_uploads_under_2_percent_after_the_first_backup_and_restores_bit_exact(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """A frozen bf16 base (99.8% of the parameters) with fp32 adapters trained by AdamW, saved by the real
    ``Checkpointer`` and backed up at every step, in layout 3 and (another bucket, same steps) layout 2:
    every backup after the first sends at most 2% of what the layout 2 one sends, and the newest step
    restores from the chunks bit-exact into a fresh ``Checkpointer``."""
    gcs_server.create_bucket(bucket + "-full")
    model, opt = fine_tune_model()
    root = tmp_path / "ramdisk"
    chunked = CountingStore(make_store(gcs_server.url, bucket, chunk_size=8 << 20))
    whole = CountingStore(make_store(gcs_server.url, bucket + "-full", chunk_size=8 << 20))
    svc = make_service(chunked, root, "n", keep_last=2, chunks=True)
    full = make_service(whole, root, "n-full", chunks=False, keep_last=2)
    sent: list[tuple[int, int]] = []
    with Checkpointer(root=root, job="finetune", keep=2) as ck:
        for step in range(1, 4):
            x = torch.randn(16, 1024)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, blocking=True)
            before = (chunked.sent, whole.sent)
            assert await svc.backup_now("finetune") == step
            assert await full.backup_now("finetune") == step
            sent.append((chunked.sent - before[0], whole.sent - before[1]))
    first, later = sent[0], sent[1:]
    assert first[0] <= first[1] * 1.01  # the first backup costs what a full one does
    for mine, theirs in later:
        assert mine <= 0.02 * theirs, sent
    dest = tmp_path / "restored"
    reader = make_service(make_store(gcs_server.url, bucket), dest, "reader", range_size=8 << 20, chunks=True)
    await reader.fetch_rank("finetune", 3, 0, rank_dir(dest, "finetune", 0))
    assert step_files(step_dir(rank_dir(dest, "finetune", 0), 3)) == step_files(
        step_dir(rank_dir(root, "finetune", 0), 3)
    )
    restored, ropt = fine_tune_model()
    with Checkpointer(root=dest, job="finetune") as ck:
        state = {"model": restored.state_dict(), "optim": ropt.state_dict()}
        assert ck.load(state) == 3
    for (k, want), got in zip(model.state_dict().items(), state["model"].values(), strict=True):
        assert torch.equal(want, got), k
    for svc_ in (svc, full, reader):
        await svc_.close()


async def _two_steps(gcs_server: FakeGcsServer, bucket: str, root: Path) -> BackupService:
    """Steps 1 and 2 of one rank backed up: step 2 shares its frozen tensors' chunks with step 1."""
    svc = make_service(make_store(gcs_server.url, bucket), root, "n", keep_last=3, chunks=True)
    for step in (1, 2):
        write_tensor_step(root, 0, step, fine_tune_tensors(0, step), 1)
        assert await svc.backup_now(JOB) == step
    return svc


def _changed_chunk(store: Any) -> str:
    """The key of a chunk step 2 names and step 1 does not."""
    needed = chunks_needed(store)
    (key,) = needed[2] - needed[1]
    return key


@pytest.mark.e2e
@pytest.mark.parametrize("damage", ["flip", "delete"])
async def test_a_corrupt_or_missing_chunk_fails_its_step_and_the_older_one_restores(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path, damage: str
) -> None:
    svc = await _two_steps(gcs_server, bucket, tmp_path / "n")
    store = make_store(gcs_server.url, bucket)
    key = _changed_chunk(store)
    if damage == "flip":  # same size, one byte flipped: only the content check can tell
        blob = gcs_server.client().bucket(bucket).blob(key)
        data = bytearray(blob.download_as_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.upload_from_string(bytes(data))
    else:
        store.delete(key)
    dest = tmp_path / "out"
    with pytest.raises((CorruptShardError, ObjectNotFound)):
        await svc.fetch_rank(JOB, 2, 0, rank_dir(dest, JOB, 0))
    assert not step_dir(rank_dir(dest, JOB, 0), 2).exists()
    assert not list(rank_dir(dest, JOB, 0).glob(".incoming-*"))
    await svc.fetch_rank(JOB, 1, 0, rank_dir(dest, JOB, 0))  # the older complete step
    assert step_files(step_dir(rank_dir(dest, JOB, 0), 1)) == step_files(
        step_dir(rank_dir(tmp_path / "n", JOB, 0), 1)
    )
    await svc.close()


@pytest.mark.e2e
async def test_a_chunk_whose_content_is_not_its_name_is_refused(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """A chunk object replaced by other bytes of the same size (GCS's own crc32c of the new object is
    consistent): refused, its bytes are not the ones its chunk list names."""
    svc = await _two_steps(gcs_server, bucket, tmp_path / "n")
    store = make_store(gcs_server.url, bucket)
    key = _changed_chunk(store)
    name, _, codec = key.rpartition("/")[2].partition(".")
    assert codec == "raw" and chunk_name(store.get_bytes(key, max_size=1 << 24)) == name
    store.put_bytes(key, random.Random(5).randbytes(store.stat(key).size))  # type: ignore[union-attr]
    with pytest.raises(CorruptShardError, match=r"not its name|chunk list says"):
        await svc.fetch_rank(JOB, 2, 0, tmp_path / "out")
    await svc.close()


@pytest.mark.e2e
async def test_a_rotted_local_shard_is_never_committed_as_chunks(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    root = tmp_path / "n"
    src = write_tensor_step(root, 0, 4, fine_tune_tensors(0, 4), 1)
    with open(src / "data-00000.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)[0]
        f.seek(100)
        f.write(bytes([byte ^ 0xFF]))
    svc = make_service(make_store(gcs_server.url, bucket), root, "n", chunks=True)
    with pytest.raises(CorruptShardError, match="manifest says"):
        await svc.backup_now(JOB)
    store = make_store(gcs_server.url, bucket)
    assert store.stat(LAYOUT.rank_commit_key(JOB, 4, 0)) is None
    assert store.list(LAYOUT.chunk_lists_of(JOB, 4, 0))[0] == []
    assert await svc.complete_steps(JOB) == ()
    await svc.close()


@pytest.mark.e2e
async def test_layout_2_steps_stay_restorable_and_the_next_step_goes_up_as_chunks(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """Step 1 uploaded as whole objects (layout 2, as the previous version wrote it), step 2 by this
    version as chunks, compressed: both restore bit-exact, step 1 with no chunk read."""
    root = tmp_path / "n"
    first = write_tensor_step(root, 0, 1, fine_tune_tensors(0, 1), 1)
    old = make_service(make_store(gcs_server.url, bucket), root, "n", chunks=False)
    assert await old.backup_now(JOB) == 1
    await old.close()
    store = make_store(gcs_server.url, bucket)
    assert store.stat(LAYOUT.rank_file_key(JOB, 1, 0, "data-00000.bin", saved_as(first))) is not None
    svc = make_service(store, root, "n", compression="grouped", chunks=True)
    write_tensor_step(root, 0, 2, fine_tune_tensors(0, 2), 1)
    assert await svc.backup_now(JOB) == 2
    assert store.list(LAYOUT.chunks_dir(JOB))[0]  # step 2 is chunks (none reused: step 1 has none)
    for step in (1, 2):
        dest = tmp_path / f"out-{step}"
        await svc.fetch_rank(JOB, step, 0, dest)
        assert step_files(step_dir(dest, step)) == step_files(step_dir(rank_dir(root, JOB, 0), step))
    await svc.close()


async def test_raw_chunks_are_verified_as_they_stream_in_not_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore takes each raw chunk's SHA-256 and crc32c from the bytes as they arrive: no chunk is
    read back from the staging file, but for a chunk the file holds twice (copied from its first place,
    and checked again). The step restores bit-exact."""
    root = tmp_path / "n"
    frozen = random.Random(1).randbytes(MIN_CUT)
    tensors = [frozen, random.Random(2).randbytes(300 * KiB), frozen, random.Random(3).randbytes(5 * KiB)]
    write_tensor_step(root, 0, 1, tensors, 1)
    bucket = MemoryBucket()
    svc = make_service(bucket, root, "n", chunks=True)
    assert await svc.backup_now(JOB) == 1
    read_back: list[int] = []
    real_pread = chunkstore.os.pread

    def pread(fd: int, n: int, offset: int) -> bytes:
        read_back.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(chunkstore.os, "pread", pread)
    await svc.fetch_rank(JOB, 1, 0, tmp_path / "out")
    assert step_files(step_dir(tmp_path / "out", 1)) == step_files(step_dir(rank_dir(root, JOB, 0), 1))
    assert read_back == [MIN_CUT]  # the frozen tensor's second place only
    await svc.close()


class ObjectsFirst(MemoryBucket):
    """A ``MemoryBucket`` whose chunk downloads wait (up to 5 s) until ``objects.pkl`` was asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()

    def download_to(self, key: str, fd: int, **kw: Any) -> int:
        if key.endswith("/objects.pkl"):
            self.asked.set()
        elif key.startswith(LAYOUT.chunks_dir(JOB)) and not self.asked.wait(5):
            raise TimeoutError(f"{key} was asked for before objects.pkl")
        return super().download_to(key, fd, **kw)


async def test_a_chunked_ranks_other_files_download_with_its_chunks_not_after_them(tmp_path: Path) -> None:
    """``objects.pkl`` (a whole object) is asked for while the rank's chunks download: not one round
    trip after the last of them."""
    root = tmp_path / "n"
    write_tensor_step(root, 0, 1, fine_tune_tensors(0, 1), 1, objects=random.Random(4).randbytes(3000))
    bucket = ObjectsFirst()
    svc = make_service(bucket, root, "n", chunks=True)
    assert await svc.backup_now(JOB) == 1
    await svc.fetch_rank(JOB, 1, 0, tmp_path / "out")
    assert step_files(step_dir(tmp_path / "out", 1)) == step_files(step_dir(rank_dir(root, JOB, 0), 1))
    await svc.close()


@pytest.mark.e2e
async def test_layout_3_steps_of_4_mib_chunks_stay_restorable_and_the_next_step_reuses_what_it_can(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path
) -> None:
    """Step 1 as the previous layout 3 writer cut it (4 MiB chunks inside large tensors too), step 2 by
    this version (up to ``TENSOR_CHUNK_SIZE`` inside large tensors): both restore bit-exact; step 2's
    large frozen tensor is new chunks once, its small tensors' chunks are reused."""
    root = tmp_path / "n"
    big = random.Random(7).randbytes(TENSOR_CHUNK_SIZE // 2 + 3 * KiB)
    small = [random.Random(8).randbytes(4 * KiB), random.Random(9).randbytes(6 * KiB)]
    store = make_store(gcs_server.url, bucket)
    old = make_service(store, root, "n", chunks=True)
    assert old.uploader.chunks is not None
    old.uploader.chunks.tensor_chunk_size = CHUNK_SIZE
    write_tensor_step(root, 0, 1, [*small, big], 1)
    assert await old.backup_now(JOB) == 1
    await old.close()
    svc = make_service(store, root, "n", chunks=True)
    write_tensor_step(root, 0, 2, [*small, big], 1)
    assert await svc.backup_now(JOB) == 2
    lists = {step: chunk_list(store, LAYOUT, JOB, step, 0) for step in (1, 2)}
    assert [c.size for c in lists[1].files[0].chunks] == [10 * KiB, CHUNK_SIZE, CHUNK_SIZE, 3 * KiB]
    assert [c.size for c in lists[2].files[0].chunks] == [10 * KiB, len(big)]
    assert lists[1].files[0].chunks[0] == lists[2].files[0].chunks[0]
    for step in (1, 2):
        dest = tmp_path / f"out-{step}"
        await svc.fetch_rank(JOB, step, 0, dest)
        assert step_files(step_dir(dest, step)) == step_files(step_dir(rank_dir(root, JOB, 0), step))
    await svc.close()


class ChunkPuts(MemoryBucket):
    """A ``MemoryBucket`` that counts the bytes of chunk objects put."""

    def __init__(self) -> None:
        super().__init__()
        self.chunk_bytes = 0

    def put_bytes(self, key: str, data: bytes, **kw: Any) -> ObjectInfo:
        if key.startswith(LAYOUT.chunks_dir(JOB)):
            self.chunk_bytes += len(data)
        return super().put_bytes(key, data, **kw)


async def test_a_replica_group_uploads_each_shard_once_as_chunks_and_reuses_them_as_its_data_rank_rotates(
    tmp_path: Path,
) -> None:
    """Ranks 0 and 1 of a replica group hold the same tensors (a frozen base and a small tensor that
    changes at every step). At every step one member (its data rank, rotating over steps) uploads the
    chunks and the other refers to it; after the first step only the changed tensor goes up, also at
    a step whose data rank was not the previous step's (its chunks are found through the previous
    step's reference); both ranks of the newest step restore bit-exact from the one upload."""
    root = tmp_path / "n"
    write_peers({"n": root}, JOB, 2)
    group = (0, 1)
    bucket = ChunkPuts()
    svc = make_service(bucket, root, "n", chunks=True, keep_last=2)
    steps = range(1, 7)
    carriers = [data_rank(JOB, step, group) for step in steps]
    assert len(set(carriers)) == 2  # the upload rotates over the members within these steps
    for step in steps:
        tensors = fine_tune_tensors(0, step)
        for rank in group:
            write_tensor_step(root, rank, step, tensors, 2, group=group)
        before = bucket.chunk_bytes
        assert await svc.backup_now(JOB) == step
        sent = bucket.chunk_bytes - before
        assert sent == (sum(map(len, tensors)) if step == 1 else len(tensors[-1])), step
        commits = {
            r: RankBackup.from_bytes(bucket.get_bytes(LAYOUT.rank_commit_key(JOB, step, r), max_size=1 << 20))
            for r in group
        }
        carrier = data_rank(JOB, step, group)
        other = group[1 - group.index(carrier)]
        assert commits[carrier].chunks is not None and commits[carrier].data is None
        assert commits[other].chunks is None and commits[other].data is not None
        assert commits[other].data.rank == carrier
    for rank in group:
        dest = tmp_path / f"out-{rank}"
        await svc.fetch_rank(JOB, steps[-1], rank, dest)
        assert step_files(step_dir(dest, steps[-1])) == step_files(
            step_dir(rank_dir(root, JOB, rank), steps[-1])
        )
    await svc.close()


@pytest.mark.e2e
@pytest.mark.parametrize("chunks", [True, False])
async def test_the_chaos_harness_finds_a_missing_chunk_or_data_object_of_a_complete_step(
    gcs_server: FakeGcsServer, bucket: str, tmp_path: Path, chunks: bool
) -> None:
    """The soak's own look at the bucket (``BucketView.torn``) follows the chain of a complete step
    through its index chunks to every data object, or in layout 3 every chunk: whole steps pass, and
    a step one of whose chunks (or data objects) was deleted is reported."""
    svc = make_service(make_store(gcs_server.url, bucket), tmp_path / "n", "n", keep_last=3, chunks=chunks)
    for step in (1, 2):
        path = write_tensor_step(tmp_path / "n", 0, step, fine_tune_tensors(0, step), 1)
        assert await svc.backup_now(JOB) == step
    await svc.close()
    store = make_store(gcs_server.url, bucket)
    view = BucketView(gcs_server.client().bucket(bucket), prefix="t")
    assert view.torn(JOB) == []
    gone = (
        _changed_chunk(store) if chunks else LAYOUT.rank_file_key(JOB, 2, 0, "data-00000.bin", saved_as(path))
    )
    store.delete(gone)
    (problem,) = BucketView(gcs_server.client().bucket(bucket), prefix="t").torn(JOB)
    assert problem.startswith("step 2: rank 0: data-00000.bin") and "missing" in problem


def test_settings_refuse_an_unknown_compression(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="compression"):
        make_service(MemoryBucket(), tmp_path, "n", compression="lzma", chunks=True)
