"""What this node holds: committed primaries and replicas per job and rank, as a ``NodeInventory``.

Scanning reads only directory listings and COMMIT markers; a step's world size comes from its manifest,
read once and cached by the manifest's crc32c (which the COMMIT marker records).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from tierckpt.protocol.control import NodeInventory, RankHoldings
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import (
    check_job_id,
    committed_steps,
    job_dir,
    rank_dir,
    ranks_in,
    read_commit,
    read_manifest,
    replica_rank_dir,
    step_dir,
)

__all__ = ["Holdings", "InventoryScanner", "list_jobs"]

log = logging.getLogger(__name__)


def list_jobs(root: Path) -> list[str]:
    """Job ids with a directory under ``root`` (names that are not valid job ids are ignored)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in sorted(names):
        with contextlib.suppress(FormatError):
            if (root / check_job_id(name)).is_dir():
                out.append(name)
    return out


@dataclasses.dataclass(frozen=True)
class Holdings:
    """One job's committed steps on this node, with sizes and world sizes."""

    ranks: dict[int, RankHoldings]
    world_sizes: dict[int, int]
    local_bytes: int
    replica_bytes: int
    newest_commit_at: dict[int, float]
    """Rank -> commit time of its newest local step (for replication lag)."""

    def newest_local(self) -> dict[int, int]:
        return {r: h.local[-1] for r, h in self.ranks.items() if h.local}


class InventoryScanner:
    def __init__(self, root: Path, *, node: str, endpoint: str, domain: str = "") -> None:
        self.root, self.node, self.endpoint, self.domain = root, node, endpoint, domain
        self._world_sizes: dict[tuple[str, int], int] = {}

    def holdings(self, job: str) -> Holdings:
        ranks: dict[int, RankHoldings] = {}
        world_sizes: dict[int, int] = {}
        sizes = {"local": 0, "replica": 0}
        newest_at: dict[int, float] = {}
        base = job_dir(self.root, job)
        tiers: tuple[tuple[str, Callable[[int], Path], Path], ...] = (
            ("local", lambda r: rank_dir(self.root, job, r), base),
            ("replica", lambda r: replica_rank_dir(self.root, job, r), base / "replicas"),
        )
        for kind, parent_of, parent in tiers:
            for rank in ranks_in(parent):
                steps = []
                for step in committed_steps(parent_of(rank)):
                    info = self._step_info(step_dir(parent_of(rank), step))
                    if info is None:
                        continue
                    total, ws, committed_at = info
                    steps.append(step)
                    sizes[kind] += total
                    world_sizes.setdefault(step, ws)
                    if kind == "local":
                        newest_at[rank] = committed_at
                h = ranks.get(rank, RankHoldings())
                ranks[rank] = dataclasses.replace(h, **{kind: tuple(steps)})
        return Holdings(ranks, world_sizes, sizes["local"], sizes["replica"], newest_at)

    def _step_info(self, path: Path) -> tuple[int, int, float] | None:
        try:
            marker = read_commit(path)
            if marker is None:
                return None
            key = (str(path), marker.manifest_crc32c)
            ws = self._world_sizes.get(key)
            if ws is None:
                ws = read_manifest(path).world_size
                self._world_sizes[key] = ws
            return marker.total_bytes, ws, marker.committed_at
        except (FormatError, OSError) as exc:
            log.warning("skipping unreadable step %s: %s", path, exc)
            return None

    def inventory(self, job: str, *, gcs: tuple[int, ...] = (), now: float | None = None) -> NodeInventory:
        h = self.holdings(job)
        return NodeInventory(
            job=job,
            node=self.node,
            endpoint=self.endpoint,
            updated_at=time.time() if now is None else now,
            ranks=h.ranks,
            world_sizes=h.world_sizes,
            gcs=tuple(sorted(gcs)),
            domain=self.domain,
        )

    def forget(self, job: str) -> None:
        prefix = str(job_dir(self.root, job)) + os.sep
        self._world_sizes = {k: v for k, v in self._world_sizes.items() if not k[0].startswith(prefix)}
