"""Helpers for the GCS backup tests: stores and services with test settings, and client-format steps
laid out on several "nodes" as replication would leave them."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from tierckpt.protocol.bucket_layout import BucketLayout, ChunkList, RankBackup, save_name
from tierckpt.protocol.control import PeerAssignment, PeerNode, write_control
from tierckpt.protocol.format import read_commit, replica_rank_dir, step_dir
from tierckpt_demo.step_writer import write_step
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore, RetryPolicy
from tierckpt_replicator.backup.metrics import BackupMetrics
from tierckpt_replicator.backup.service import BackupService
from tierckpt_replicator.backup.settings import BackupSettings
from tierckpt_replicator.backup.store import ObjectStore
from tierckpt_replicator.inventory import PlanOf, no_plan

KiB = 1 << 10
MiB = 1 << 20
FAST_RETRY = RetryPolicy(initial=0.01, maximum=0.05, multiplier=2.0, deadline=3.0)


def make_store(url: str, bucket: str, **overrides: Any) -> GcsStore:
    settings: dict[str, Any] = {
        "bucket": bucket,
        "endpoint": url,
        "chunk_size": 256 * KiB,
        "retry": FAST_RETRY,
        "connect_timeout": 2.0,
        "read_timeout": 5.0,
    }
    settings.update(overrides)
    return GcsStore(GcsSettings(**settings))


TEST_SETTINGS = BackupSettings(
    prefix="t",
    interval_steps=10,
    interval_seconds=0,
    keep_last=3,
    parallelism=4,
    slice_size=0,
    range_size=96 * KiB,
    incomplete_grace=0.0,
)
"""Small transfers (so a few KiB exercise ranges), step-scheduled backups, no grace for abandoned steps."""


def make_service(
    store: ObjectStore,
    root: Path,
    node: str,
    *,
    metrics: BackupMetrics | None = None,
    clock: Callable[[], float] = time.time,
    plan_of: PlanOf = no_plan,
    **settings: Any,
) -> BackupService:
    """A service on ``store`` with ``TEST_SETTINGS``, any ``BackupSettings`` field overridden
    (``plan_of``: the restore plans the node staged, as the daemon's stager gives them)."""
    return BackupService(
        dataclasses.replace(TEST_SETTINGS, **settings),
        node=node,
        root=root,
        store=store,
        metrics=metrics or BackupMetrics(CollectorRegistry()),
        clock=clock,
        plan_of=plan_of,
    )


def write_cluster_step(
    roots: dict[str, Path],
    job: str,
    step: int,
    world_size: int,
    *,
    sizes: tuple[int, ...] = (200 * KiB, 3 * KiB),
    files: int = 2,
) -> dict[int, Path]:
    """Commit ``step`` of every rank, as ``write_peers`` lays them out: node i is primary for the i-th
    contiguous block of ranks and holds a replica of the previous node's block. Returns rank -> primary
    step dir."""
    nodes = sorted(roots)
    per_node = world_size // len(nodes)
    out = {}
    for r in range(world_size):
        i = r // per_node
        primary, replica = nodes[i], nodes[(i + 1) % len(nodes)]
        out[r] = write_step(
            roots[primary],
            job,
            r,
            step,
            world_size=world_size,
            sizes=sizes,
            files=files,
            seed=step * 1000 + r,
        )
        if replica != primary:  # a replica is a byte-for-byte copy of the primary
            shutil.copytree(out[r], step_dir(replica_rank_dir(roots[replica], job, r), step))

    return out


def write_peers(roots: dict[str, Path], job: str, world_size: int) -> None:
    """peers.json as the operator would send it: node i has node rank i and replicates to node i+1."""
    nodes = sorted(roots)
    per_node = world_size // len(nodes)
    assert per_node * len(nodes) == world_size
    assignment = PeerAssignment(
        job=job,
        generation=1,
        nodes={n: PeerNode(name=n, endpoint=f"http://{n}:1") for n in nodes},
        peers={n: (nodes[(i + 1) % len(nodes)],) for i, n in enumerate(nodes)} if len(nodes) > 1 else {},
        node_ranks={n: i for i, n in enumerate(nodes)},
        procs_per_node=per_node,
    )
    for root in roots.values():
        write_control(root, job, PeerAssignment.FILE, assignment)


def saved_as(step_path: Path) -> str:
    """The name of the bucket objects of the save committed at ``step_path`` (bucket layout 4)."""
    return save_name(read_commit(step_path).manifest_crc32c)


def rank_commit(store: ObjectStore, layout: BucketLayout, job: str, step: int, rank: int) -> RankBackup:
    """A rank commit in the bucket, read as it is (no chain checked)."""
    return RankBackup.from_bytes(store.get_bytes(layout.rank_commit_key(job, step, rank), max_size=1 << 20))


def chunk_list(store: ObjectStore, layout: BucketLayout, job: str, step: int, rank: int) -> ChunkList:
    """The chunk list the rank commit of ``rank`` in ``step`` names."""
    commit = rank_commit(store, layout, job, step, rank)
    key = layout.chunk_list_key(job, step, rank, commit.save)
    return ChunkList.from_bytes(store.get_bytes(key, max_size=1 << 24))
