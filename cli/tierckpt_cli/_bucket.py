"""Listing backups in a bucket (``tierckpt ls gs://bucket/prefix``), through tierckpt.protocol.bucket_layout.

google-cloud-storage is imported here only, on first use. ``$STORAGE_EMULATOR_HOST`` points it at
an emulator (fake-gcs-server) with anonymous credentials; otherwise the usual application default
credentials are used. Listing reads only small objects, in parallel (``_READERS`` at once): each job's
completion objects, and for a step still being uploaded one listing of its rank commits, whose metadata
summaries (layout 2) give each rank's world size and bytes (a rank commit an older version wrote,
without one, is read). A partial step of a large world is summarised: how many ranks are uploaded and
which are missing, as ranges; never the data.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from tierckpt.protocol.bucket_layout import (
    SUMMARY_METADATA_KEY,
    BucketLayout,
    RankBackup,
    RankSummary,
    StepBackup,
    complete_read_limit,
    parse_gs_url,
)
from tierckpt.protocol.errors import FormatError
from tierckpt_cli._common import EXIT_FAILED, CliError

T = TypeVar("T")
R = TypeVar("R")

_READERS = 16
"""Small objects read (and listings made) at once."""
_MISSING_SHOWN = 6
"""Ranges of missing ranks named in a partial step's detail."""

__all__ = ["DEFAULT_PREFIX", "BucketStep", "scan_bucket"]

DEFAULT_PREFIX = "tierckpt"
"""The replicator's default ``--gcs-prefix``: tried when the URL names only a bucket."""


@dataclasses.dataclass(frozen=True)
class BucketStep:
    """One step of one job in the bucket."""

    job: str
    step: int
    state: str
    """``complete`` (every rank listed in its completion object), ``partial`` (an upload under way or
    abandoned) or ``corrupt`` (an unreadable completion object)."""
    world_size: int
    ranks: int
    """Ranks whose objects are all uploaded."""
    bytes: int
    age_at: float | None
    url: str
    detail: str = ""


def _client() -> Any:
    import google.cloud.storage as storage
    from google.auth.credentials import AnonymousCredentials
    from google.auth.exceptions import DefaultCredentialsError

    endpoint = os.environ.get("STORAGE_EMULATOR_HOST")
    try:
        if endpoint:
            return storage.Client(
                project="tierckpt",
                credentials=AnonymousCredentials(),
                client_options={"api_endpoint": endpoint},
            )
        return storage.Client()
    except DefaultCredentialsError as exc:
        raise CliError(
            f"no Google Cloud credentials ({exc}); run 'gcloud auth application-default login' "
            "or set STORAGE_EMULATOR_HOST for an emulator",
            EXIT_FAILED,
        ) from None


@dataclasses.dataclass(frozen=True)
class _Lister:
    """List and read calls with one bounded retry policy (google-cloud-storage retries for minutes), and
    pools to make them in parallel: ``pool`` for single calls, ``steps`` for whole steps (which use
    ``pool``: never the other way round, so neither waits on itself)."""

    client: Any
    bucket: str
    timeout: float
    pool: cf.Executor
    steps: cf.Executor

    def _kw(self) -> dict[str, Any]:
        from google.cloud.storage.retry import DEFAULT_RETRY

        return {
            "timeout": (min(5.0, self.timeout), self.timeout),
            "retry": DEFAULT_RETRY.with_deadline(self.timeout),
        }

    def blobs(self, prefix: str, delimiter: str | None = None) -> Any:
        return self.client.list_blobs(self.bucket, prefix=prefix, delimiter=delimiter, **self._kw())

    def read(self, blob: Any, cls: type[T], limit: int = 1 << 20) -> T:
        body = blob.download_as_bytes(start=0, end=limit, **self._kw())
        if len(body) > limit:
            raise FormatError(f"{len(body)} bytes or more, over the {limit} allowed")
        result: T = cls.from_bytes(body)  # type: ignore[attr-defined]
        return result

    def each(self, fn: Callable[[T], R], items: Iterable[T], *, steps: bool = False) -> list[R]:
        """``fn`` of every item, in parallel, in order (the first failure raises); ``steps``: on the
        pool of whole steps (``fn`` may call ``each`` itself)."""
        return list((self.steps if steps else self.pool).map(fn, items))


def _prefixes(ls: _Lister, prefix: str) -> list[str]:
    it = ls.blobs(prefix, delimiter="/")
    for _ in it.pages:
        pass
    return sorted(it.prefixes)


def _job_ids(ls: _Lister, layout: BucketLayout) -> list[str]:
    k8s_root, local_root = layout.jobs_roots()
    jobs = [p[len(local_root) : -1] for p in _prefixes(ls, local_root)]
    names = [n for ns in _prefixes(ls, k8s_root) for n in _prefixes(ls, ns)]
    for uids in ls.each(lambda name: _prefixes(ls, name), names):
        jobs += ["_".join(uid[len(k8s_root) : -1].split("/")) for uid in uids]
    return sorted(jobs)


def _complete_steps(ls: _Lister, layout: BucketLayout, job: str) -> list[BucketStep]:
    listed = ls.blobs(layout.complete_dir(job))
    blobs = [b for b in listed if layout.step_of_complete(job, b.name) is not None]

    def one(blob: Any) -> BucketStep:
        step = layout.step_of_complete(job, blob.name)
        assert step is not None
        url = f"gs://{ls.bucket}/{layout.step_dir(job, step)}"
        try:
            done = ls.read(blob, StepBackup, complete_read_limit(int(blob.size or 0)))
        except FormatError as exc:
            return BucketStep(job, step, "corrupt", 0, 0, 0, None, url, f"completion object: {exc}")
        return BucketStep(
            job, step, "complete", done.world_size, done.world_size, done.total_bytes, done.completed_at, url
        )

    return ls.each(one, blobs)


def _partial_step(ls: _Lister, layout: BucketLayout, job: str, step: int, url: str) -> BucketStep:
    """A step still being uploaded (or abandoned): one listing of its rank commits. Their metadata gives
    each rank's world size and bytes; a commit without it (an older version's) is read."""
    worlds: dict[int, int] = {}
    sizes: dict[int, int] = {}
    newest: float | None = None
    unread = []
    for blob in ls.blobs(layout.rank_commits_dir(job, step)):
        rank = layout.rank_of_commit(job, step, blob.name)
        if rank is None:
            continue
        newest = max(newest or 0.0, blob.updated.timestamp()) if blob.updated is not None else newest
        summary = _summary(blob)
        if summary is None:
            unread.append(blob)
            continue
        worlds[rank], sizes[rank] = summary.world_size, summary.total_bytes
    for commit in ls.each(lambda b: _read_commit(ls, b), unread):
        if commit is not None:
            worlds[commit.rank], sizes[commit.rank] = commit.world_size, commit.total_bytes
    world = max(worlds.values(), default=0)
    detail = f"{len(worlds)}/{world or '?'} ranks uploaded"
    missing = [r for r in range(world) if r not in worlds]
    if missing:
        ranges = _ranges(missing)
        more = f", ... ({len(ranges) - _MISSING_SHOWN} more ranges)" if len(ranges) > _MISSING_SHOWN else ""
        detail += f"; missing {', '.join(ranges[:_MISSING_SHOWN])}{more}"
    return BucketStep(job, step, "partial", world, len(worlds), sum(sizes.values()), newest, url, detail)


def _summary(blob: Any) -> RankSummary | None:
    text = (blob.metadata or {}).get(SUMMARY_METADATA_KEY)
    if not text:
        return None
    try:
        return RankSummary.from_bytes(text)
    except FormatError:
        return None


def _read_commit(ls: _Lister, blob: Any) -> RankBackup | None:
    try:
        return ls.read(blob, RankBackup)
    except FormatError:
        return None


def _ranges(ranks: list[int]) -> list[str]:
    """Sorted ranks as ``a-b`` ranges."""
    out: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if r is not None:
            start = prev = r
    return out


def _partial_steps(ls: _Lister, layout: BucketLayout, job: str, done: set[int]) -> list[BucketStep]:
    found = []
    for step_prefix in _prefixes(ls, layout.steps_dir(job)):
        step = layout.step_of_dir(job, step_prefix)
        if step is not None and step not in done:
            found.append((step, f"gs://{ls.bucket}/{step_prefix}"))
    return ls.each(lambda s: _partial_step(ls, layout, job, *s), found, steps=True)


def _scan(ls: _Lister, prefix: str, job: str | None) -> list[BucketStep]:
    layout = BucketLayout(prefix)
    jobs = [job] if job else _job_ids(ls, layout)
    out: list[BucketStep] = []
    for j in jobs:
        complete = _complete_steps(ls, layout, j)
        out += complete + _partial_steps(ls, layout, j, {s.step for s in complete})
    return sorted(out, key=lambda s: (s.job, s.step))


def scan_bucket(url: str, *, job: str | None = None, timeout: float = 30.0) -> list[BucketStep]:
    """Every step of every job (or of ``job``) under ``gs://bucket/prefix``; each call to the bucket
    gives up after ``timeout`` seconds of retries."""
    bucket, prefix = parse_gs_url(url)
    with (
        cf.ThreadPoolExecutor(_READERS, thread_name_prefix="ls") as pool,
        cf.ThreadPoolExecutor(4, thread_name_prefix="ls-steps") as steps,
    ):
        return _scan_or_fail(_Lister(_client(), bucket, timeout, pool, steps), url, prefix, job)


def _scan_or_fail(ls: _Lister, url: str, prefix: str, job: str | None) -> list[BucketStep]:
    from google.api_core import exceptions as gexc
    from requests.exceptions import RequestException

    try:
        found = _scan(ls, prefix, job)
        if not found and not prefix:
            found = _scan(ls, DEFAULT_PREFIX, job)
    except gexc.NotFound:
        raise CliError(f"{url}: no such bucket", EXIT_FAILED) from None
    except gexc.Forbidden as exc:
        raise CliError(f"{url}: access denied ({exc.message})", EXIT_FAILED) from None
    except (gexc.GoogleAPIError, RequestException) as exc:
        raise CliError(f"{url}: cannot list the bucket ({exc})", EXIT_FAILED) from None
    return found
