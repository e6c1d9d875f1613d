"""Purging a job's backups while nodes may still be writing them: the local fence, the bucket's purge
fence and the writers' leases (spec: docs/bucket-layout.md, "Purging a job").

On one node a purge fences the job first (``Fences.fence_here``): every write of the job's objects goes
through ``Fences.store``, which refuses it from then on, so the pass in flight stops at its next write
and no pass starts (the service waits for the running one before it deletes anything).

Across nodes nothing can be refused: GCS has no transaction over several objects and no write
conditional on another object, so an upload another node has in flight may land after the purge listed
the job. The two sides meet through objects each writes before it relies on the other's:

* A **writer** (a pass writing objects of step ``s``: ``Fences.writing``) creates its lease
  ``writers/<s>/<writer>.json``, then reads ``purging.json``. If that exists it deletes its lease and
  writes nothing (``JobFenced``). While it writes, a thread rewrites the lease every ``ttl / 5`` seconds,
  conditional on its generation (a lease the purge declared dead cannot come back), and reads
  ``purging.json`` again (a purge elsewhere stops the writer at its next write). The lease is *valid*
  until ``ttl / 2`` after the send of the last rewrite answered within ``ttl / 4`` (the create counts
  too). No write starts after that. A write that returns after it is deleted again by the writer if
  its lease is gone (only a purge deletes another's lease): it may have landed after the purge's last
  sweep. The lease is deleted once the last write returned.
* The **purge** (``Fences.purge``) creates ``purging.json``, deletes the completion objects (the job's
  steps vanish for readers at once), then every other object but the leases. It waits until every lease
  is gone, or has kept its generation for ``ttl`` seconds of the purge's clock, or was last written
  ``ttl`` before ``purging.json`` by the bucket's clock (a dead writer's). Then it deletes everything
  again, and ``purging.json`` last.

Why nothing of the job is left (GCS is strongly consistent: a read or listing sees every write that
completed before it began):

* A writer that did not see ``purging.json`` read it before the purge created it, and created its lease
  before that, so the purge's listings see the lease and the purge waits. If the writer deletes its
  lease, every write it made had returned before, so the last sweep, listed after, deletes them. If the
  purge declares the lease dead, its validity had ended before: the rewrite that wrote the generation
  seen was sent before the purge first saw it, so it ends the validity ``ttl / 2`` later; a later rewrite
  that extends the validity lands within ``ttl / 4`` of being sent, hence before the purge's last look,
  which would have seen its generation. So each of the writer's writes either returned while the lease
  was valid (it landed before the purge's last look, and the last sweep deletes it), or returned later:
  then the writer finds its lease gone and deletes the write (had it found the lease, the purge would
  have deleted the lease later still, and swept after that).
* A writer that saw ``purging.json`` writes nothing.

Not covered: a writer process that dies between a write that returned after its lease lapsed (a single
request outliving the lease by ``ttl / 2``) and deleting that write again, or that cannot read its
lease then (the bucket failing past the retries).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import logging
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from tierckpt.protocol.bucket_layout import BucketLayout, PurgeFence, WriterLease, job_from_prefix
from tierckpt.protocol.errors import TierckptError
from tierckpt_replicator.backup.store import (
    Digest,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    PreconditionFailed,
    StoreError,
    TransientStoreError,
)

__all__ = ["Fences", "JobFenced", "Lease"]

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class JobFenced(TierckptError):
    """Writes of the job's objects must stop: a purge of it began on this node, or on another
    (``elsewhere``: seen through the bucket, or it took this writer's lease away)."""

    def __init__(self, message: str, *, elsewhere: bool = False) -> None:
        super().__init__(message)
        self.elsewhere = elsewhere


class Lease:
    """One writer's lease on writing objects of ``step`` of ``job`` (see the module docstring): created
    by ``begin``, renewed in a thread, deleted by ``end``. ``check`` before a write, ``lapsed`` after."""

    def __init__(
        self,
        store: ObjectStore,
        layout: BucketLayout,
        job: str,
        step: int,
        node: str,
        ttl: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.job, self.step, self.node, self.ttl = store, job, step, node, ttl
        self.key = layout.writer_key(job, step, f"{_SAFE.sub('-', node)[:100]}.{secrets.token_hex(4)}")
        self._fence = layout.purge_fence_key(job)
        self._clock = clock
        self._lock = threading.Lock()
        self._generation = 0
        self._sent: list[bytes] = []
        """Bodies written since the last answered write (one may have landed unanswered)."""
        self._valid_until = float("-inf")
        self._stopped = ""
        """Why no write may start any more ("" while they may)."""
        self._elsewhere = False
        self._done = threading.Event()
        self._renewer: threading.Thread | None = None

    def begin(self) -> None:
        """Create the lease, then look for a purge (``JobFenced`` if one is under way: nothing written)."""
        sent = self._clock()
        try:
            info = self._put(create_only=True)
        except PreconditionFailed:  # the answer to our create was lost and the retry found it
            found = self._ours_after_all()
            if found is None:
                raise
            info = found
        with self._lock:
            self._generation, self._valid_until = info.generation, sent + self.ttl / 2
        try:
            purging = self._purging()
        except BaseException:
            self._discard()
            raise
        if purging:
            self._discard()
            raise JobFenced(f"job {self.job} is being purged from the bucket by another node", elsewhere=True)
        self._renewer = threading.Thread(target=self._renew_loop, name="backup-lease", daemon=True)
        self._renewer.start()

    def end(self) -> None:
        """After the last write returned: stop renewing, look for a purge once more (``raise_if_purged``
        tells), delete the lease."""
        self._done.set()
        if self._renewer is not None:
            self._renewer.join()
        try:
            if self._purging():
                self._stop(f"job {self.job} is being purged from the bucket by another node", elsewhere=True)
        except StoreError as exc:
            log.warning(
                "job %s: could not look for a purge after writing step %d: %s", self.job, self.step, exc
            )
        self._discard()

    def check(self) -> None:
        """Raise unless a write may start now: ``JobFenced`` (a purge), ``TransientStoreError`` (the lease
        lapsed: the bucket did not answer its renewals in time)."""
        with self._lock:
            stopped, elsewhere, lapsed = self._stopped, self._elsewhere, self._clock() >= self._valid_until
        if stopped:
            raise JobFenced(stopped, elsewhere=elsewhere)
        if lapsed:
            raise TransientStoreError(
                f"writer lease {self.key} lapsed: the bucket did not answer its renewals in time"
            )

    def lapsed(self) -> bool:
        """Whether the lease's validity has ended (a write returning now may have landed after a purge)."""
        with self._lock:
            return self._clock() >= self._valid_until

    def taken_away(self) -> bool:
        """Whether the lease object is gone: a purge declared this writer dead (only a purge deletes
        another writer's lease, and never writes one)."""
        return self.store.stat(self.key) is None

    def raise_if_purged(self) -> None:
        """``JobFenced`` (``elsewhere``) if a purge of the job was seen while or after writing."""
        with self._lock:
            stopped, elsewhere = self._stopped, self._elsewhere
        if elsewhere:
            raise JobFenced(stopped, elsewhere=True)

    # ------------------------------------------------------------------------------------ renewing

    def _renew_loop(self) -> None:
        """Renew until ``end``, also once writes must stop: a purge then waits for the write in flight
        to return instead of taking this writer for gone."""
        while not self._done.wait(self.ttl / 5):
            try:
                if not self._renew():
                    return
            except StoreError as exc:  # the validity runs out by itself if this goes on
                log.warning("job %s: renewing writer lease %s failed: %s", self.job, self.key, exc)

    def _renew(self) -> bool:
        """Rewrite the lease (and look for a purge); False if the lease is gone."""
        if self._purging():
            self._stop(f"job {self.job} is being purged from the bucket by another node", elsewhere=True)
        sent = self._clock()
        try:
            info: ObjectInfo | None = self._put(if_generation=self._generation)
        except PreconditionFailed:
            info = self._ours_after_all()
        if info is None:
            self._stop(f"writer lease {self.key} was deleted by a purge", elsewhere=True)
            return False
        answered = self._clock()
        with self._lock:
            self._generation = info.generation
            if answered - sent <= self.ttl / 4:  # answered in time: it landed before its validity counts
                self._valid_until = max(self._valid_until, sent + self.ttl / 2)
        return True

    def _ours_after_all(self) -> ObjectInfo | None:
        """After a 412: the lease as one of our own rewrites left it (its answer was lost, and the retry
        found the new generation), or None (the lease is gone)."""
        info = self.store.stat(self.key)
        if info is None:
            return None
        try:
            body = self.store.get_bytes(self.key, max_size=max(map(len, self._sent), default=0) + 1)
        except ObjectNotFound:
            return None
        if body not in self._sent:
            return None
        self._sent = []
        return info

    def _put(self, *, create_only: bool = False, if_generation: int | None = None) -> ObjectInfo:
        lease = WriterLease(
            job=self.job, step=self.step, node=self.node, renewed_at=time.time(), ttl=self.ttl
        )
        body = lease.to_bytes()
        self._sent.append(body)
        info = self.store.put_bytes(self.key, body, create_only=create_only, if_generation=if_generation)
        self._sent = []
        return info

    def _purging(self) -> bool:
        return self.store.stat(self._fence) is not None

    def _stop(self, why: str, *, elsewhere: bool) -> None:
        with self._lock:
            if not self._stopped:
                self._stopped, self._elsewhere = why, elsewhere
        log.info("job %s: writes of step %d stop: %s", self.job, self.step, why)

    def _discard(self) -> None:
        try:
            self.store.delete(self.key)
        except StoreError as exc:  # a purge waits until it has not changed for ttl
            log.warning("job %s: could not delete writer lease %s: %s", self.job, self.key, exc)


class Fences:
    """One service's side of purges: the jobs fenced on this node, the leases of the writes in flight,
    ``store`` (the bucket as the service's passes write it: every write of a job's object checked
    against both), and the purge itself. ``ttl``: the writer leases' (``BackupSettings.writer_ttl``);
    ``wait_limit``: how long a purge waits for writers before it gives up (leaving the job fenced)."""

    def __init__(
        self,
        store: ObjectStore,
        layout: BucketLayout,
        node: str,
        pool: cf.Executor,
        *,
        ttl: float,
        wait_limit: float,
    ) -> None:
        self.raw, self.layout, self.node, self.pool = store, layout, node, pool
        self.ttl, self.wait_limit = ttl, wait_limit
        self.store: ObjectStore = _FencedStore(self)
        self._fenced: set[str] = set()
        self._purges: dict[str, int] = {}
        self._leases: dict[str, Lease] = {}

    # ------------------------------------------------------------------------------------ this node

    def fenced(self, job: str) -> bool:
        return job in self._fenced

    def fence_here(self, job: str) -> None:
        """From now on no write of ``job``'s objects starts on this node (the one in flight finishes)."""
        self._fenced.add(job)
        self._purges[job] = self._purges.get(job, 0) + 1

    def purges(self, job: str) -> int:
        """How many times ``job`` was fenced here: a call that saw another count before it waited for
        its turn was queued when a purge began, and must not run (not even after the fence lifted)."""
        return self._purges.get(job, 0)

    def lift(self, job: str) -> None:
        self._fenced.discard(job)

    @contextlib.contextmanager
    def writing(self, job: str, step: int) -> Iterator[Lease]:
        """Hold a writer lease on ``step`` of ``job`` for the writes of the block. Raises ``JobFenced``
        (before any write) if the job is fenced here or being purged elsewhere, and after the block if a
        purge elsewhere was seen meanwhile."""
        if job in self._fenced:
            raise JobFenced(f"job {job} is being purged on this node")
        if job in self._leases:
            raise RuntimeError(f"job {job} already has a writer on this node")
        lease = Lease(self.raw, self.layout, job, step, self.node, self.ttl)
        lease.begin()
        self._leases[job] = lease
        try:
            yield lease
        finally:
            self._leases.pop(job, None)
            lease.end()
        lease.raise_if_purged()

    def write(self, key: str, op: Callable[[], ObjectInfo]) -> ObjectInfo:
        """Run the write ``op`` of ``key`` if its job's lease allows it; undo it if it returned (or
        failed) after the lease lapsed and a purge took the lease away."""
        lease = self._lease_for(key)
        lease.check()
        try:
            info = op()
        except BaseException:
            self._undo_if_late(lease, key)
            raise
        if self._undo_if_late(lease, key):
            raise JobFenced(
                f"{key} landed after a purge of job {lease.job} took its writer for gone", elsewhere=True
            )
        return info

    def _lease_for(self, key: str) -> Lease:
        found = job_from_prefix(self.layout.prefix, key)
        if found is None:
            raise RuntimeError(f"{key} is no job's object")
        job = found[0]
        if job in self._fenced:
            raise JobFenced(f"job {job} is being purged on this node")
        lease = self._leases.get(job)
        if lease is None:
            raise RuntimeError(f"write of {key} outside a writer lease of job {job}")
        return lease

    def _undo_if_late(self, lease: Lease, key: str) -> bool:
        """After a write of ``key`` returned: if the lease had lapsed and a purge took it away, the write
        may have landed after the purge's last sweep: delete it. True if so. (A lapsed lease that is
        still there means no purge swept since: its next sweep deletes the write, which may also be an
        identical object another node uploaded and committed, so it stays.)"""
        if not lease.lapsed():
            return False
        try:
            if not lease.taken_away():
                return False
        except StoreError as exc:
            log.error("%s returned after its writer lease lapsed, and the lease cannot be read: %s", key, exc)
            return False
        log.warning("%s returned after its writer lease lapsed and a purge took it away: deleting it", key)
        with contextlib.suppress(StoreError):
            self.raw.delete(key)
        return True

    # ------------------------------------------------------------------------------------ the bucket

    def uploading(self, job: str) -> set[int]:
        """Steps of ``job`` that some node holds a writer lease on, written within ``ttl`` (bucket time
        against this node's clock: a hint, not a proof)."""
        leases, _ = self.raw.list(self.layout.writers_dir(job))
        now = time.time()
        steps = {self.layout.step_of_writer(job, o.name) for o in leases if now - o.updated < self.ttl}
        return {s for s in steps if s is not None}

    def purge(self, job: str) -> int:
        """Delete every object of ``job`` (the job must be fenced here): ``purging.json``, completion
        objects, the rest but the leases, wait for the writers, everything again, ``purging.json``.
        Returns the objects deleted. Raises ``TransientStoreError`` if writers are still active after
        ``wait_limit`` seconds: ``purging.json`` stays, so they write nothing new, and a purge retried
        later finishes."""
        fence_key = self.layout.purge_fence_key(job)
        fence = PurgeFence(job=job, purged_by=self.node, started_at=time.time())
        placed = self.raw.put_bytes(fence_key, fence.to_bytes())  # over a stale one of a purge that died
        deleted = self._sweep(job, keep_leases=True)
        deleted += self._wait_for_writers(job, placed)
        deleted += self._sweep(job, keep_leases=False)
        self.raw.delete(fence_key)
        log.info("purged job %s from the bucket (%d objects)", job, deleted)
        return deleted

    def _sweep(self, job: str, *, keep_leases: bool) -> int:
        """Delete the completion objects, then every other object of the job but ``purging.json`` (and
        the writer leases, with ``keep_leases``)."""
        complete, _ = self.raw.list(self.layout.complete_dir(job))
        deleted = sum(self.pool.map(lambda o: self.raw.delete(o.name), complete))
        rest, _ = self.raw.list(self.layout.job(job))
        fence, leases = self.layout.purge_fence_key(job), self.layout.writers_dir(job)
        doomed = [o.name for o in rest if o.name != fence and not (keep_leases and o.name.startswith(leases))]
        return deleted + sum(self.pool.map(self.raw.delete, doomed))

    def _wait_for_writers(self, job: str, fence: ObjectInfo) -> int:
        """Wait until no writer lease of ``job`` is live; delete the dead ones. Returns how many."""
        seen: dict[str, tuple[int, float]] = {}
        deadline = time.monotonic() + self.wait_limit
        deleted = 0
        while True:
            sent = time.monotonic()
            leases, _ = self.raw.list(self.layout.writers_dir(job))
            answered = time.monotonic()
            live: list[str] = []
            for o in leases:
                generation, since = seen.get(o.name, (None, answered))
                if o.updated <= fence.updated - self.ttl or (
                    generation == o.generation and sent - since >= self.ttl
                ):
                    log.warning(
                        "purge of %s: writer lease %s not renewed for %.0fs: its writer is gone",
                        job,
                        o.name,
                        max(fence.updated - o.updated, sent - since),
                    )
                    deleted += int(self.raw.delete(o.name))
                    continue
                if generation != o.generation:
                    seen[o.name] = (o.generation, answered)
                live.append(o.name)
            if not live:
                return deleted
            if time.monotonic() >= deadline:
                raise TransientStoreError(
                    f"purge of {job}: {len(live)} writer(s) still active after {self.wait_limit:.0f}s "
                    f"({', '.join(live[:3])}); purging.json stays, so they write nothing new: purge again"
                )
            log.info("purge of %s: waiting for %d writer(s) to stop: %s", job, len(live), ", ".join(live[:3]))
            time.sleep(min(1.0, self.ttl / 10))


class _FencedStore:
    """The bucket as a service's passes see it: reads pass through, every write of a job's object goes
    through ``Fences.write`` (the job's lease held, the job not fenced here)."""

    def __init__(self, fences: Fences) -> None:
        self._fences, self._raw = fences, fences.raw
        self.bucket = str(getattr(fences.raw, "bucket", "?"))

    def upload_file(
        self, key: str, fd: int, *, offset: int = 0, length: int | None = None, crc32c: int | None = None
    ) -> ObjectInfo:
        return self._fences.write(
            key, lambda: self._raw.upload_file(key, fd, offset=offset, length=length, crc32c=crc32c)
        )

    def put_bytes(
        self,
        key: str,
        data: bytes,
        *,
        create_only: bool = False,
        if_generation: int | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> ObjectInfo:
        return self._fences.write(
            key,
            lambda: self._raw.put_bytes(
                key, data, create_only=create_only, if_generation=if_generation, metadata=metadata
            ),
        )

    def compose(self, key: str, sources: Sequence[str]) -> ObjectInfo:
        return self._fences.write(key, lambda: self._raw.compose(key, sources))

    def get_bytes(self, key: str, *, max_size: int) -> bytes:
        return self._raw.get_bytes(key, max_size=max_size)

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
        return self._raw.download_to(
            key, fd, start=start, length=length, file_offset=file_offset, on_bytes=on_bytes, digest=digest
        )

    def stat(self, key: str) -> ObjectInfo | None:
        return self._raw.stat(key)

    def list(self, prefix: str, *, delimiter: str | None = None) -> tuple[list[ObjectInfo], list[str]]:
        return self._raw.list(prefix, delimiter=delimiter)

    def delete(self, key: str) -> bool:
        return self._raw.delete(key)
