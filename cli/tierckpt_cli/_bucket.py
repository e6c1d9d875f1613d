"""Listing backups in a bucket (``tierckpt ls gs://bucket/prefix``), through tierckpt.protocol.bucket_layout.

google-cloud-storage is imported here only, on first use. ``$STORAGE_EMULATOR_HOST`` points it at
an emulator (fake-gcs-server) with anonymous credentials; otherwise the usual application default
credentials are used. Listing reads only small objects: each job's completion objects and, for
steps still being uploaded, their per-rank commit objects; never the data.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from tierckpt.protocol.bucket_layout import BucketLayout, RankBackup, StepBackup, parse_gs_url
from tierckpt.protocol.errors import FormatError
from tierckpt_cli._common import EXIT_FAILED, CliError

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
    """List and read calls with one bounded retry policy (google-cloud-storage retries for minutes)."""

    client: Any
    bucket: str
    timeout: float

    def _kw(self) -> dict[str, Any]:
        from google.cloud.storage.retry import DEFAULT_RETRY

        return {
            "timeout": (min(5.0, self.timeout), self.timeout),
            "retry": DEFAULT_RETRY.with_deadline(self.timeout),
        }

    def blobs(self, prefix: str, delimiter: str | None = None) -> Any:
        return self.client.list_blobs(self.bucket, prefix=prefix, delimiter=delimiter, **self._kw())

    def read(self, blob: Any, cls: type[Any]) -> Any:
        return cls.from_bytes(blob.download_as_bytes(**self._kw()))


def _prefixes(ls: _Lister, prefix: str) -> list[str]:
    it = ls.blobs(prefix, delimiter="/")
    for _ in it.pages:
        pass
    return sorted(it.prefixes)


def _job_ids(ls: _Lister, layout: BucketLayout) -> list[str]:
    k8s_root, local_root = layout.jobs_roots()
    jobs = [p[len(local_root) : -1] for p in _prefixes(ls, local_root)]
    for ns in _prefixes(ls, k8s_root):
        for name in _prefixes(ls, ns):
            for uid in _prefixes(ls, name):
                jobs.append("_".join(uid[len(k8s_root) : -1].split("/")))
    return sorted(jobs)


def _complete_steps(ls: _Lister, layout: BucketLayout, job: str) -> list[BucketStep]:
    out = []
    for blob in ls.blobs(layout.complete_dir(job)):
        step = layout.step_of_complete(job, blob.name)
        if step is None:
            continue
        url = f"gs://{ls.bucket}/{layout.step_dir(job, step)}"
        try:
            done = ls.read(blob, StepBackup)
        except FormatError as exc:
            out.append(BucketStep(job, step, "corrupt", 0, 0, 0, None, url, f"completion object: {exc}"))
            continue
        out.append(
            BucketStep(
                job,
                step,
                "complete",
                done.world_size,
                len(done.ranks),
                done.total_bytes,
                done.completed_at,
                url,
            )
        )
    return out


def _partial_steps(ls: _Lister, layout: BucketLayout, job: str, done: set[int]) -> list[BucketStep]:
    out = []
    for step_prefix in _prefixes(ls, layout.steps_dir(job)):
        step = layout.step_of_dir(job, step_prefix)
        if step is None or step in done:
            continue
        ranks: list[RankBackup] = []
        for blob in ls.blobs(layout.rank_commits_dir(job, step)):
            if layout.rank_of_commit(job, step, blob.name) is not None:
                try:
                    ranks.append(ls.read(blob, RankBackup))
                except FormatError:
                    continue
        world = max((r.world_size for r in ranks), default=0)
        newest = max((r.uploaded_at for r in ranks), default=None)
        out.append(
            BucketStep(
                job,
                step,
                "partial",
                world,
                len(ranks),
                sum(r.total_bytes for r in ranks),
                newest,
                f"gs://{ls.bucket}/{step_prefix}",
                f"{len(ranks)}/{world or '?'} ranks uploaded",
            )
        )
    return out


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
    from google.api_core import exceptions as gexc
    from requests.exceptions import RequestException

    bucket, prefix = parse_gs_url(url)
    ls = _Lister(_client(), bucket, timeout)
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
