"""The bucket scale rig: many lightweight nodes (real ``BackupService``s on small synthetic steps, no
training, many per process) back up and restore one job, while every request they send is counted.

* ``CountingStore`` wraps a node's ``ObjectStore`` and counts the HTTP requests ``GcsStore`` sends for
  each call (``requests_of``: one per call, one per page of 1,000 for a listing, the resumable upload's
  extra requests for a file over 8 MiB). Over the real fake-gcs-server behind a ``FaultProxy`` the
  proxy's own count must equal this model's (``test_bucket_scale.py`` checks it at 1,024 ranks), so
  the larger runs can count on ``MemoryBucket``, an in-memory bucket with the semantics the protocol
  relies on (generations, create-only and generation-conditional writes, ordered prefix listings with
  sub-prefixes, metadata, compose, crc32c).
* ``ScaleRig`` lays out ``nodes`` x ``ranks_per_node`` ranks as replication leaves them (every node
  the primary of its block and the holder of its ring predecessor's replicas, ``peers.json`` as the
  operator sends a big job: each node its neighbourhood only), runs the backup of a step, polls, and a
  whole-job restore from the bucket, and returns the counts of each phase (``Phase``).

Used by ``tests/backup/test_bucket_scale.py`` (1,024 and 10,240 ranks in CI) and by
``bench/bucket_scale_bench.py`` (32,768 and 102,400 ranks, documented in docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import dataclasses
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from tierckpt.protocol.bucket_layout import BucketLayout
from tierckpt.protocol.control import PeerAssignment, PeerNode, write_control
from tierckpt.protocol.format import rank_dir, replica_rank_dir, step_dir
from tierckpt.protocol.integrity import crc32c
from tierckpt_demo.step_writer import step_files, write_step
from tierckpt_replicator.backup.metrics import BackupMetrics
from tierckpt_replicator.backup.service import BackupPools, BackupService
from tierckpt_replicator.backup.settings import BackupSettings
from tierckpt_replicator.backup.store import (
    LIST_PAGE,
    Digest,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    StoreError,
)

MULTIPART_MAX = 8 << 20
"""google-cloud-storage sends an object up to this size in one multipart request."""

KINDS = ("read", "list", "write", "delete")


# ------------------------------------------------------------------------------------ the bucket


@dataclasses.dataclass
class _Object:
    data: bytes
    generation: int
    updated: float
    metadata: dict[str, str]
    crc: int


class MemoryBucket:
    """An in-memory bucket (thread-safe) with the GCS semantics the backup protocol relies on."""

    def __init__(self, name: str = "scale-rig") -> None:
        self.bucket = name
        self._objects: dict[str, _Object] = {}
        self._names: list[str] = []
        self._lock = threading.Lock()
        self._generation = 0

    def _info(self, name: str, o: _Object) -> ObjectInfo:
        return ObjectInfo(name, len(o.data), o.crc, o.generation, o.updated, dict(o.metadata))

    def _store(self, key: str, data: bytes, metadata: Mapping[str, str] | None = None) -> ObjectInfo:
        self._generation += 1
        if key not in self._objects:
            bisect.insort(self._names, key)
        o = _Object(data, self._generation, time.time(), dict(metadata or {}), crc32c(data))
        self._objects[key] = o
        return self._info(key, o)

    def upload_file(
        self, key: str, fd: int, *, offset: int = 0, length: int | None = None, crc32c: int | None = None
    ) -> ObjectInfo:
        size = os.fstat(fd).st_size - offset if length is None else length
        data = os.pread(fd, size, offset)
        with self._lock:
            info = self._store(key, data)
        if crc32c is not None and info.crc32c != crc32c:
            self.delete(key)
            raise StoreError(f"{key}: crc32c mismatch")
        return info

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        create_only: bool = False,
        if_generation: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        with self._lock:
            have = self._objects.get(key)
            if create_only and have is not None:
                raise PreconditionFailed(f"{key}: exists")
            if if_generation is not None and (have is None or have.generation != if_generation):
                raise PreconditionFailed(f"{key}: not in generation {if_generation}")
            return self._store(key, bytes(data), metadata)

    def get_bytes(self, key: str, *, max_size: int) -> bytes:
        with self._lock:
            o = self._objects.get(key)
        if o is None:
            raise ObjectNotFound(f"{key}: not found")
        if len(o.data) > max_size:
            raise StoreError(f"{key} is larger than the {max_size} bytes allowed")
        return o.data

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
        with self._lock:
            o = self._objects.get(key)
        if o is None:
            raise ObjectNotFound(f"{key}: not found")
        block = o.data[start : start + length]
        os.pwrite(fd, block, file_offset)
        if digest is not None:
            digest.update(block)
        if on_bytes is not None:
            on_bytes(len(block))
        return crc32c(block)

    def stat(self, key: str) -> ObjectInfo | None:
        with self._lock:
            o = self._objects.get(key)
            return None if o is None else self._info(key, o)

    def list(self, prefix: str, *, delimiter: str | None = None) -> tuple[list[ObjectInfo], list[str]]:
        with self._lock:
            i = bisect.bisect_left(self._names, prefix)
            objects: list[ObjectInfo] = []
            prefixes: set[str] = set()
            while i < len(self._names) and self._names[i].startswith(prefix):
                name = self._names[i]
                cut = name.find(delimiter, len(prefix)) if delimiter else -1
                if cut < 0:
                    objects.append(self._info(name, self._objects[name]))
                    i += 1
                    continue
                sub = name[: cut + 1]
                prefixes.add(sub)  # skip the rest of the sub-prefix: a listing of steps/ costs its steps
                i = bisect.bisect_left(self._names, sub[:-1] + chr(ord(delimiter[0]) + 1), i)
        return objects, sorted(prefixes)

    def delete(self, key: str) -> bool:
        with self._lock:
            if self._objects.pop(key, None) is None:
                return False
            del self._names[bisect.bisect_left(self._names, key)]
            return True

    def compose(self, key: str, sources: Sequence[str]) -> ObjectInfo:
        with self._lock:
            data = b"".join(self._objects[s].data for s in sources)
            return self._store(key, data)

    def __len__(self) -> int:
        return len(self._objects)


# ------------------------------------------------------------------------------------ counting


@dataclasses.dataclass
class Counts:
    """Requests per node and kind (``KINDS``), and the completion object's stats (restores)."""

    by_node: dict[str, collections.Counter[str]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    completion_stats: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    by_object: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    """``"<kind> <what>"`` -> requests (``what``: the kind of object, or of directory listed)."""
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, node: str, kind: str, n: int = 1, what: str = "") -> None:
        with self.lock:
            self.by_node[node][kind] += n
            self.by_object[f"{kind} {what}"] += n

    def total(self, *kinds: str) -> int:
        kinds = kinds or KINDS
        return sum(c[k] for c in self.by_node.values() for k in kinds)

    def node_totals(self, *kinds: str) -> dict[str, int]:
        kinds = kinds or KINDS
        return {n: sum(c[k] for k in kinds) for n, c in self.by_node.items()}

    def reset(self) -> None:
        with self.lock:
            self.by_node.clear()
            self.completion_stats.clear()
            self.by_object.clear()


class CountingStore:
    """A node's view of the bucket that counts the requests ``GcsStore`` would send for each call."""

    def __init__(
        self,
        inner: ObjectStore,
        node: str,
        counts: Counts,
        *,
        chunk_size: int = 64 << 20,
        layout: BucketLayout = BucketLayout("scale"),
    ) -> None:
        self.inner, self.node, self.counts, self.chunk_size = inner, node, counts, chunk_size
        self.layout = layout
        self.bucket = str(getattr(inner, "bucket", "?"))

    def _count(self, kind: str, n: int = 1, key: str = "") -> None:
        self.counts.add(self.node, kind, n, _what(self.layout, key))

    def upload_file(
        self, key: str, fd: int, *, offset: int = 0, length: int | None = None, crc32c: int | None = None
    ) -> ObjectInfo:
        size = os.fstat(fd).st_size - offset if length is None else length
        self._count("write", 1 if size <= MULTIPART_MAX else 1 + -(-size // self.chunk_size), key)
        return self.inner.upload_file(key, fd, offset=offset, length=length, crc32c=crc32c)

    def put_bytes(self, key: str, data: bytes, **kw: Any) -> ObjectInfo:
        self._count("write", 1, key)
        return self.inner.put_bytes(key, data, **kw)

    def get_bytes(self, key: str, *, max_size: int) -> bytes:
        self._count("read", 1, key)
        return self.inner.get_bytes(key, max_size=max_size)

    def download_to(self, key: str, fd: int, **kw: Any) -> int:
        self._count("read", 1, key)
        return self.inner.download_to(key, fd, **kw)

    def stat(self, key: str) -> ObjectInfo | None:
        self._count("read", 1, key)
        if "/complete/" in key:
            with self.counts.lock:
                self.counts.completion_stats[self.node] += 1
        return self.inner.stat(key)

    def list(self, prefix: str, *, delimiter: str | None = None) -> tuple[list[ObjectInfo], list[str]]:
        objects, prefixes = self.inner.list(prefix, delimiter=delimiter)
        self._count("list", max(1, -(-(len(objects) + len(prefixes)) // LIST_PAGE)), prefix)
        return objects, prefixes

    def delete(self, key: str) -> bool:
        self._count("delete", 1, key)
        return self.inner.delete(key)

    def compose(self, key: str, sources: Sequence[str]) -> ObjectInfo:
        self._count("write", 1, key)
        return self.inner.compose(key, sources)


def _what(layout: BucketLayout, key: str) -> str:
    """What an object key (or a listed prefix, ending in ``/``) is, for the counts' breakdown."""
    if key.endswith("/"):
        return key.rstrip("/").rsplit("/", 1)[-1].split("-")[0] + "/"
    parsed = layout.parse(key)
    return parsed.kind if parsed is not None else "?"


# ------------------------------------------------------------------------------------ the rig


@dataclasses.dataclass(frozen=True)
class Phase:
    """What one phase of the rig cost."""

    name: str
    seconds: float
    total: int
    by_kind: dict[str, int]
    node_max: int
    """The most requests one node sent (deletes not counted: ``node_deletes_max``)."""
    node_max_name: str
    per_node: dict[str, int]
    """Node -> its requests, deletes not counted."""
    node_deletes_max: int
    by_object: dict[str, int] = dataclasses.field(default_factory=dict)
    completion_stats_max: int = 0
    external: int | None = None
    """What ``ScaleRig(external=...)`` counted during the phase (the proxy's requests)."""


RIG_SETTINGS = BackupSettings(
    prefix="scale",
    interval_steps=10,
    interval_seconds=0,
    keep_last=1,
    parallelism=4,
    slice_size=0,
    range_size=0,
    incomplete_grace=3600.0,
    writer_ttl=600.0,
    lease_ttl=600.0,
    takeover_after=3600.0,
    catalog_max_age=3600.0,
    chunks=False,
)
"""A step schedule; one complete step kept (each backup retires the previous one); long leases and
takeover windows (the rig's passes are slow on a loaded box, not dead). Layout 2 (whole objects): the
budgets are layout 2's; layout 3's chunks are not measured here yet (docs/bucket-layout.md, "Request
budgets")."""


class ScaleRig:
    """``nodes`` x ``ranks_per_node`` ranks of one job in ``base``, each node a ``BackupService`` on
    ``CountingStore(store_for(node))``; ``files`` data files of ``file_bytes`` each per rank.
    ``external``: another count of requests (a proxy's), recorded per phase next to the rig's."""

    def __init__(
        self,
        base: Path,
        store_for: Callable[[str], ObjectStore],
        *,
        nodes: int,
        ranks_per_node: int,
        files: int = 1,
        file_bytes: int = 256,
        job: str = "team_scale_0123abcd",
        concurrency: int = 32,
        settings: BackupSettings = RIG_SETTINGS,
        external: Callable[[], int] | None = None,
    ) -> None:
        self.base, self.job = base, job
        self.n, self.r, self.files, self.file_bytes = nodes, ranks_per_node, files, file_bytes
        self.world = nodes * ranks_per_node
        self.names = [f"node-{i:05d}" for i in range(nodes)]
        self.roots = {name: base / name for name in self.names}
        self.counts = Counts()
        self.concurrency = concurrency
        self.pools = BackupPools.make(parallelism=16, passes=concurrency)
        metrics = BackupMetrics(CollectorRegistry())
        self.services = {
            name: BackupService(
                settings,
                node=name,
                root=self.roots[name],
                store=CountingStore(store_for(name), name, self.counts),
                metrics=metrics,
                pools=self.pools,
            )
            for name in self.names
        }
        self.phases: list[Phase] = []
        self.external = external
        self._write_peers()

    # -- layout

    def primaries(self, i: int) -> range:
        return range(i * self.r, (i + 1) * self.r)

    def _write_peers(self) -> None:
        """peers.json as the operator sends a big job: node i replicates to i+1, and knows itself, its
        peer, the node that sends to it, and that node's peers."""
        for i, name in enumerate(self.names):
            view = sorted({(i - 1) % self.n, i, (i + 1) % self.n})
            nodes = {self.names[j]: PeerNode(name=self.names[j], endpoint=f"http://{j}:1") for j in view}
            senders = sorted({i, (i - 1) % self.n}) if self.n > 1 else [i]
            peers = {self.names[j]: (self.names[(j + 1) % self.n],) for j in senders} if self.n > 1 else {}
            assignment = PeerAssignment(
                job=self.job,
                generation=1,
                nodes=nodes,
                peers=peers,
                node_ranks={self.names[j]: j for j in view},
                procs_per_node=self.r,
            )
            self.roots[name].mkdir(parents=True, exist_ok=True)
            write_control(self.roots[name], self.job, PeerAssignment.FILE, assignment)

    def write_step(self, step: int) -> None:
        """Commit ``step`` of every rank on its primary node, and a replica (hard links) on the next."""
        for i, name in enumerate(self.names):
            peer = self.names[(i + 1) % self.n]
            for rank in self.primaries(i):
                src = write_step(
                    self.roots[name],
                    self.job,
                    rank,
                    step,
                    world_size=self.world,
                    sizes=(self.file_bytes,) * self.files,
                    files=self.files,
                    seed=step * 1_000_003 + rank,
                )
                if peer != name:
                    dst = step_dir(replica_rank_dir(self.roots[peer], self.job, rank), step)
                    shutil.copytree(src, dst, copy_function=os.link)

    def drop_step(self, step: int) -> None:
        """The ramdisks' retention: the step is gone from every node."""
        for name in self.names:
            for path in (self.roots[name] / self.job).glob(f"*/*/step-{step}"):
                shutil.rmtree(path)

    # -- phases

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.counts.reset()
        started = time.monotonic()
        before = self.external() if self.external is not None else 0
        yield
        per_node = self.counts.node_totals("read", "list", "write")
        top = max(per_node, key=lambda n: per_node[n], default="")
        self.phases.append(
            Phase(
                name=name,
                seconds=time.monotonic() - started,
                total=self.counts.total(),
                by_kind={k: self.counts.total(k) for k in KINDS},
                node_max=per_node.get(top, 0),
                node_max_name=top,
                per_node=per_node,
                node_deletes_max=max(self.counts.node_totals("delete").values(), default=0),
                by_object=dict(self.counts.by_object),
                completion_stats_max=max(self.counts.completion_stats.values(), default=0),
                external=self.external() - before if self.external is not None else None,
            )
        )

    async def _each(self, call: Callable[[int, str], Any]) -> None:
        slots = asyncio.Semaphore(self.concurrency)

        async def one(i: int, name: str) -> None:
            async with slots:
                await call(i, name)

        await asyncio.gather(*(one(i, name) for i, name in enumerate(self.names)))

    async def back_up(self, step: int) -> Phase:
        """Every node's commit of ``step`` (each backs up its share, the last completes the step), then
        one poll round (each node sees the new step and deletes its ranks of the retired one)."""
        with self.phase(f"backup of step {step}"):
            await self._each(lambda i, name: self.services[name].on_step_committed(self.job, step, [], {}))
            await self._each(lambda i, name: self.services[name].poll(self.job))
        return self.phases[-1]

    async def idle(self, polls: int) -> Phase:
        with self.phase(f"{polls} idle polls"):
            for _ in range(polls):
                await self._each(lambda i, name: self.services[name].poll(self.job))
        return self.phases[-1]

    async def restore(self, step: int, dest: Path) -> Phase:
        """A whole-job restore from the bucket: every node fetches its ranks into a fresh ramdisk."""

        async def one(i: int, name: str) -> None:
            svc = self.services[name]
            for rank in self.primaries(i):
                await svc.fetch_rank(self.job, step, rank, rank_dir(dest / name, self.job, rank))

        with self.phase(f"restore of step {step}"):
            await self._each(one)
        return self.phases[-1]

    def check_restored(self, step: int, dest: Path, sample: Sequence[int] | None = None) -> int:
        """Compare restored ranks with the originals, byte for byte; returns how many were compared."""
        ranks = range(self.world) if sample is None else sample
        for rank in ranks:
            name = self.names[rank // self.r]
            original = step_dir(rank_dir(self.roots[name], self.job, rank), step)
            restored = step_dir(rank_dir(dest / name, self.job, rank), step)
            assert step_files(restored) == step_files(original), f"rank {rank} differs"
        return len(ranks)

    async def close(self) -> None:
        for svc in self.services.values():
            await svc.close()
        self.pools.shutdown()


def budget(rig: ScaleRig) -> dict[str, int]:
    """The formulas of docs/benchmarks.md ("Requests per backup step") for this rig: F data files a
    rank, R ranks a node, N nodes."""
    f, r, n, world = rig.files, rig.r, rig.n, rig.world
    pages = -(-world // LIST_PAGE)
    return {
        "total": (f + 5) * world + 24 * n + n * -(-n // LIST_PAGE),
        "node": (f + 5) * r + 40 + 2 * -(-n // LIST_PAGE) + 3 * pages,
        "deletes": (f + 5) * world + 4 * n,
        "node_deletes": (f + 4) * r + 8,
        "restore": (f + 3) * world + 4 * n,
    }
