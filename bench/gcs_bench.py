"""GCS backup and restore throughput of tierckpt's backup service vs a plain google-cloud-storage transfer.

Baselines, measured in the same run against the same server: one ``blob.upload_from_filename`` of the
same bytes (one file), and one ``blob.download_to_filename``. Ours: ``BackupService.backup_now`` of a
committed step (``--ranks`` x ``--files`` data files holding the same bytes: crc32c-verified parallel
uploads, manifest, rank commits and the completion object), and ``fetch_rank`` of every rank
(parallel ranged downloads, crc32c of every byte, commit into the ramdisk format).

``--transfer-manager`` adds google-cloud-storage's own parallel transfers of the same bytes, in the
same run: ``transfer_manager.download_chunks_concurrently`` (``--range-mib`` chunks, ``--parallelism``
workers, crc32c on; thread and process workers) and ``upload_chunks_concurrently`` (``--slice-mib``
parts; XML multipart upload, which fake-gcs-server does not implement: the error is reported).

By default it starts a fake-gcs-server (memory backend) on loopback; ``--endpoint``/``--bucket`` point
it at another emulator or a real bucket (with ``--real`` it uses your default credentials).

    python bench/gcs_bench.py                     # 256 MiB, 2 ranks x 2 files
    python bench/gcs_bench.py --size-mib 1024 --ranks 1 --files 1 --slice-mib 128 --json
    python bench/gcs_bench.py --size-mib 1024 --ranks 1 --files 1 --slice-mib 64 --transfer-manager
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=256, help="total bytes of the step (default 256 MiB)")
    p.add_argument(
        "--ranks", type=int, default=2, help="ranks of the step, all held by this node (default 2)"
    )
    p.add_argument("--files", type=int, default=2, help="data files per rank (default 2)")
    p.add_argument("--parallelism", type=int, default=8, help="object transfers in flight (default 8)")
    p.add_argument("--chunk-mib", type=int, default=64, help="resumable upload chunk (default 64 MiB)")
    p.add_argument("--slice-mib", type=int, default=256, help="files above this upload as composed slices")
    p.add_argument("--range-mib", type=int, default=64, help="restore download range size (default 64 MiB)")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; the median is reported")
    p.add_argument(
        "--dir", type=Path, default=None, help="where the step lives (default: /dev/shm if present)"
    )
    p.add_argument("--endpoint", default="", help="use this GCS endpoint instead of a local fake-gcs-server")
    p.add_argument("--bucket", default="", help="bucket to use (created on the emulator if missing)")
    p.add_argument("--real", action="store_true", help="real GCS with default credentials (needs --bucket)")
    p.add_argument(
        "--transfer-manager",
        action="store_true",
        help="also time google.cloud.storage.transfer_manager's chunked download and upload",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p.parse_args(argv)


def _write_step(root: Path, job: str, ranks: int, files: int, total: int) -> Path:
    """Commit a step of ``ranks`` ranks with random data files; also write the same bytes as one file."""
    from tierckpt_demo.step_writer import write_step

    per_file = max(1, total // (ranks * files)) // 4096 * 4096
    flat = root.parent / "baseline.bin"
    with open(flat, "wb") as out:
        for r in range(ranks):
            path = write_step(
                root, job, r, 1, world_size=ranks, sizes=(per_file,) * files, files=files, seed=r
            )
            for data in sorted(path.glob("data-*.bin")):
                with open(data, "rb") as f:
                    shutil.copyfileobj(f, out, 8 * MiB)
    return flat


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _run(args: argparse.Namespace, endpoint: str, bucket: str, work: Path) -> dict[str, Any]:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from prometheus_client import CollectorRegistry

    from tierckpt.protocol.format import rank_dir
    from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore
    from tierckpt_replicator.backup.metrics import BackupMetrics
    from tierckpt_replicator.backup.service import BackupService
    from tierckpt_replicator.backup.settings import BackupSettings

    job = "bench"
    root = work / "ramdisk"
    flat = _write_step(root, job, args.ranks, args.files, args.size_mib * MiB)
    nbytes = flat.stat().st_size
    kw: dict[str, Any] = (
        {}
        if args.real
        else {"credentials": AnonymousCredentials(), "client_options": {"api_endpoint": endpoint}}
    )
    client = storage.Client(project="bench", **kw)
    blob = client.bucket(bucket).blob(f"tierckpt-bench-baseline/{uuid.uuid4().hex}")
    out, dest = work / "baseline.out", work / "restored"
    gcs = GcsSettings(
        bucket=bucket,
        endpoint="" if args.real else endpoint,
        chunk_size=args.chunk_mib * MiB,
        pool_size=2 * args.parallelism,
    )
    settings = BackupSettings(
        prefix=f"tierckpt-bench-{uuid.uuid4().hex[:8]}",
        interval_steps=0,
        interval_seconds=0,
        parallelism=args.parallelism,
        slice_size=args.slice_mib * MiB,
        range_size=args.range_mib * MiB,
    )
    svc = BackupService(
        settings, node="bench", root=root, store=GcsStore(gcs), metrics=BackupMetrics(CollectorRegistry())
    )
    loop = asyncio.new_event_loop()

    def restore() -> None:
        for r in range(args.ranks):
            loop.run_until_complete(svc.fetch_rank(job, 1, r, rank_dir(dest, job, r)))

    # Baseline, ours and the library alternate, so load from anything else on the machine hits all alike.
    times: dict[str, list[float]] = {"plain_up": [], "ours_up": [], "plain_down": [], "ours_down": []}
    library = _TransferManager(blob, flat, work / "tm.out", args) if args.transfer_manager else None
    try:
        for _ in range(args.repeat):
            loop.run_until_complete(svc.delete_backups(job))
            times["plain_up"].append(_timed(lambda: blob.upload_from_filename(str(flat))))
            times["ours_up"].append(_timed(lambda: loop.run_until_complete(svc.backup_now(job))))
            shutil.rmtree(dest, ignore_errors=True)
            times["plain_down"].append(_timed(lambda: blob.download_to_filename(str(out))))
            times["ours_down"].append(_timed(restore))
            if library is not None:
                library.run_once(times)
        loop.run_until_complete(svc.delete_backups(job))
        loop.run_until_complete(svc.close())
    finally:
        loop.close()
        blob.delete()
    mbps = lambda seconds: nbytes / seconds / 1e6  # noqa: E731
    plain_up, ours_up, plain_down, ours_down = (
        statistics.median(times[k]) for k in ("plain_up", "ours_up", "plain_down", "ours_down")
    )
    extra: dict[str, Any] = {}
    if library is not None:
        extra = {
            f"{k}_MBps": round(mbps(statistics.median(v)), 1)
            for k, v in times.items()
            if k.startswith("tm_") and v
        }
        extra["tm_upload_error"] = library.upload_error
    return {
        **extra,
        "bytes": nbytes,
        "ranks": args.ranks,
        "files_per_rank": args.files,
        "parallelism": args.parallelism,
        "chunk_mib": args.chunk_mib,
        "slice_mib": args.slice_mib,
        "repeat": args.repeat,
        "plain_upload_MBps": round(mbps(plain_up), 1),
        "backup_MBps": round(mbps(ours_up), 1),
        "backup_vs_plain": round(plain_up / ours_up, 3),
        "plain_download_MBps": round(mbps(plain_down), 1),
        "restore_MBps": round(mbps(ours_down), 1),
        "restore_vs_plain": round(plain_down / ours_down, 3),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
        "server": "real GCS" if args.real else (endpoint if args.endpoint else "fake-gcs-server (memory)"),
    }


class _TransferManager:
    """google.cloud.storage.transfer_manager on the baseline object: chunked download with thread and
    process workers (crc32c checked), and chunked upload (XML multipart) of the same file."""

    def __init__(self, blob: Any, flat: Path, out: Path, args: argparse.Namespace) -> None:
        self.blob, self.flat, self.out, self.args = blob, flat, out, args
        self.upload_error = ""

    def run_once(self, times: dict[str, list[float]]) -> None:
        from google.cloud.storage import transfer_manager as tm

        a = self.args
        for worker in (tm.THREAD, tm.PROCESS):
            self.out.unlink(missing_ok=True)
            times.setdefault(f"tm_download_{worker}", []).append(
                _timed(
                    lambda w=worker: tm.download_chunks_concurrently(
                        self.blob,
                        str(self.out),
                        chunk_size=a.range_mib * MiB,
                        worker_type=w,
                        max_workers=a.parallelism,
                        crc32c_checksum=True,
                    )
                )
            )
        self.out.unlink(missing_ok=True)
        if self.upload_error:
            return
        target = self.blob.bucket.blob(self.blob.name + ".tm-upload")
        try:
            seconds = _timed(
                lambda: tm.upload_chunks_concurrently(
                    str(self.flat),
                    target,
                    chunk_size=a.slice_mib * MiB,
                    worker_type=tm.THREAD,
                    max_workers=a.parallelism,
                )
            )
        except Exception as exc:  # fake-gcs-server has no XML multipart upload
            self.upload_error = f"{type(exc).__name__}: {exc}"[:300]
            return
        times.setdefault("tm_upload_thread", []).append(seconds)
        target.delete()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.real and not args.bucket:
        sys.exit("--real needs --bucket")
    base = args.dir or (Path("/dev/shm") if Path("/dev/shm").is_dir() else None)
    with tempfile.TemporaryDirectory(prefix="tierckpt-gcs-bench-", dir=base) as tmp:
        if args.endpoint or args.real:
            result = _run(args, args.endpoint, args.bucket, Path(tmp))
        else:
            from tierckpt_demo.fakegcs import FakeGcsServer

            with FakeGcsServer(log_level="error") as gcs:
                bucket = args.bucket or "tierckpt-bench"
                gcs.create_bucket(bucket)
                result = _run(args, gcs.url, bucket, Path(tmp))
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"GCS bench: {result['bytes'] / MiB:.0f} MiB as {args.ranks} rank(s) x {args.files} file(s), "
            f"{result['server']}, median of {args.repeat} ({result['machine']})"
        )
        print(f"  upload   plain upload_from_filename {result['plain_upload_MBps']:8.1f} MB/s")
        print(
            f"           tierckpt backup_now        {result['backup_MBps']:8.1f} MB/s   "
            f"({result['backup_vs_plain']:.2f}x plain)"
        )
        print(f"  download plain download_to_filename {result['plain_download_MBps']:8.1f} MB/s")
        print(
            f"           tierckpt fetch_rank        {result['restore_MBps']:8.1f} MB/s   "
            f"({result['restore_vs_plain']:.2f}x plain)"
        )
        for key in sorted(k for k in result if k.startswith("tm_") and k.endswith("_MBps")):
            print(f"           transfer_manager {key[3:-5]:<17} {result[key]:8.1f} MB/s")
        if result.get("tm_upload_error"):
            print(f"           transfer_manager upload failed: {result['tm_upload_error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
