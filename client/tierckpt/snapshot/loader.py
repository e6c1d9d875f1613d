"""Loading one rank's step for ``Checkpointer.load``: which steps to try, and reading one of them.

``candidates`` waits for the replicator's staging (``restore_wait``), then agrees with the other ranks
(``agree``) on the steps every rank holds, newest first. ``StepLoader.load`` reads one step into the
caller's state dict through the slot pool's mappings (so the pages are shared with later saves and
pinned for CUDA), reusing manifests this process already decoded and, for a destination of the same
structure, the destinations of its tensors (``bindings``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tierckpt import cuda
from tierckpt.planning.common_step import common_steps
from tierckpt.protocol.errors import (
    CorruptShardError,
    FormatError,
    MissingCheckpointError,
    WorldSizeMismatchError,
)
from tierckpt.protocol.format import MANIFEST_NAME, CommitMarker, Manifest, read_commit, read_manifest
from tierckpt.protocol.integrity import crc32c
from tierckpt.settings import Settings
from tierckpt.snapshot import agree, restore_wait
from tierckpt.snapshot.bindings import BindingCache
from tierckpt.snapshot.pool import SlotPool
from tierckpt.snapshot.rankdir import scan_steps
from tierckpt.snapshot.restore import load_into, open_data_files
from tierckpt.snapshot.shardfile import MappedFile
from tierckpt.snapshot.upload import RestoreStaging

__all__ = ["ManifestCache", "StepLoader", "candidates"]

log = logging.getLogger(__name__)


def candidates(settings: Settings, rank_path: Path, step: int | None, *, fallback: bool) -> list[int]:
    """Steps to try, newest first: the same list on every rank (a collective when distributed)."""
    s = settings
    status = restore_wait.wait_for_restore(
        s.root, s.job, s.rank, expect_replicator=bool(s.replicator_url), stall_timeout=s.restore_wait
    )
    scan = scan_steps(rank_path)
    present = sorted({*scan.committed, *scan.corrupt})
    target = restore_wait.restore_target(status, scan.newest_commit_at) if step is None else step
    gathered = agree.all_gather((present, target))
    common = common_steps(p for p, _ in gathered)
    targets = {t for _, t in gathered}
    if len(targets) == 1 and (only := next(iter(targets))) != restore_wait.USE_LOCAL:
        if only is None:
            return []  # the job-wide restore plan says: start fresh
        if only not in common and not fallback:
            raise MissingCheckpointError(f"step {only} is not committed on every rank (ranks hold {common})")
        return [t for t in common if t <= only]
    return common


class ManifestCache:
    """Decoded manifests of recent steps, keyed by the size and crc32c their COMMIT records."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: collections.OrderedDict[int, tuple[int, int, Manifest]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, manifest: Manifest, marker: CommitMarker) -> None:
        with self._lock:
            self._items[manifest.step] = (marker.manifest_size, marker.manifest_crc32c, manifest)
            self._items.move_to_end(manifest.step)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def read(self, path: Path, step: int) -> Manifest:
        """``format.read_manifest``, without decoding again a manifest whose bytes are known."""
        with self._lock:
            cached = self._items.get(step)
        marker = read_commit(path)
        if cached is None or marker is None or (marker.manifest_size, marker.manifest_crc32c) != cached[:2]:
            manifest = read_manifest(path)
            if marker is not None:
                self.remember(manifest, marker)
            return manifest
        try:
            body = (path / MANIFEST_NAME).read_bytes()
        except FileNotFoundError as exc:
            raise FormatError(f"{path}: committed but {MANIFEST_NAME} is missing") from exc
        if len(body) != marker.manifest_size or crc32c(body) != marker.manifest_crc32c:
            raise FormatError(f"{path / MANIFEST_NAME}: does not match its commit marker (corrupt)")
        return cached[2]


class StepLoader:
    """Reads committed steps of one rank into state dicts."""

    def __init__(self, settings: Settings, pool: SlotPool, manifests: ManifestCache) -> None:
        self.settings = settings
        self.pool = pool
        self.manifests = manifests
        self.staging = RestoreStaging()
        self.bindings = BindingCache()
        self.last_timings: dict[str, float] = {}
        """Phases of the last load in seconds: manifest, map, bind, tree, h2d, verify_wait, copy, total."""

    def check_identity(self, path: Path, step: int, manifest: Manifest, *, strict: bool) -> None:
        s = self.settings
        if (manifest.job, manifest.rank, manifest.step) != (s.job, s.rank, step):
            raise FormatError(
                f"{path}: manifest is job {manifest.job} rank {manifest.rank} step {manifest.step}, "
                f"expected job {s.job} rank {s.rank} step {step}"
            )
        if manifest.world_size != s.world_size:
            if strict:
                raise WorldSizeMismatchError(
                    f"step {step} was saved with world size {manifest.world_size}, the job now has "
                    f"{s.world_size}: rank {s.rank}'s shard holds another partition of the state "
                    "(load(..., strict=False) loads it as is)"
                )
            log.warning(
                "step %d was saved with world size %d, the job now has %d; loading rank %d's shard as is "
                "(strict=False)",
                step,
                manifest.world_size,
                s.world_size,
                s.rank,
            )

    def load(
        self,
        state_dict: dict[Any, Any],
        step: int,
        path: Path,
        *,
        verify: bool,
        device: torch.device | str | None,
        strict: bool = True,
    ) -> None:
        """Fill ``state_dict`` from ``step`` at ``path``. A missing or short data file raises
        ``CorruptShardError``; ``strict``: a step of another world size raises
        ``WorldSizeMismatchError``."""
        start = time.perf_counter()
        timings = self.last_timings = {}
        manifest = self.manifests.read(path, step)
        self.check_identity(path, step, manifest, strict=strict)
        timings["manifest_s"] = time.perf_counter() - start
        if cuda.in_use() and not self.pool.register_cuda:
            self.pool.use_cuda(cuda.current_device())  # pinned later, off the restore path (pool.warm)
        opened: dict[str, MappedFile] = {}
        slot = self.pool.slot_of(step) or self.pool.adopt_step(step, path, manifest, register=False)
        if slot is not None:
            files = {f.path.name: f for f in slot.files}
            for entry in manifest.files:
                f = files.get(entry.name)
                if f is not None and f.disk_size() != entry.size:  # reading past a truncation would SIGBUS
                    raise CorruptShardError(
                        f"{f.path}: {f.disk_size()} bytes, manifest says {entry.size}", path=str(f.path)
                    )
        else:
            files = opened = open_data_files(path, manifest, populate=not self.pool.register_cuda)
        timings["map_s"] = time.perf_counter() - start - timings["manifest_s"]
        s = self.settings
        try:
            load_into(
                state_dict,
                path,
                manifest,
                files,
                verify=verify,
                device=device,
                views=None if slot is None else slot.read_views(manifest),
                staging=self.staging,
                pack_bytes=s.pack_bytes,
                pack_limit=s.pack_limit,
                timings=timings,
                bindings=self.bindings,
                strict=strict,
            )
            timings["total_s"] = time.perf_counter() - start
        finally:
            for f in opened.values():
                f.close()
