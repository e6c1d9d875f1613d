"""What this node holds: committed primaries, replicas and erasure-coded fragments per job and rank, as
a ``NodeInventory``.

Scanning reads only directory listings and COMMIT markers, confined to each job's tree
(``stepio.open_job``: a ``rank-*`` entry or step directory that is a symlink is refused, never
followed); a step's world size comes from its manifest, read once and cached by the manifest's crc32c
(which the COMMIT marker records). A step saved in a replica group is reported with the content key
recomputed from that manifest (``StepContent``), so peers compare copies by what the files hold, not
by what the record claims.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from tierckpt.planning.common_step import current_ranks, newest_common_step
from tierckpt.protocol.control import NodeInventory, RankHoldings, RestorePlan, StepContent
from tierckpt.protocol.errors import FormatError
from tierckpt.protocol.format import (
    STATE_DIR_NAME,
    Manifest,
    check_job_id,
    committed_steps,
    read_commit,
    read_manifest,
)
from tierckpt.protocol.replica import content_key
from tierckpt.protocol.safefs import Beneath
from tierckpt_replicator.stepio import Copy, open_job, rank_trees, step_name

__all__ = ["Holdings", "InventoryScanner", "PlanOf", "list_jobs", "no_plan"]

log = logging.getLogger(__name__)


def list_jobs(root: Path) -> list[str]:
    """Job ids with a directory under ``root`` or state of the replicator's (names that are not valid
    job ids, and entries that are not directories themselves, are ignored)."""
    out = set()
    for parent in (root, root / STATE_DIR_NAME / "jobs"):
        try:
            entries = list(os.scandir(parent))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            with contextlib.suppress(FormatError, OSError):
                if entry.is_dir(follow_symlinks=False):
                    out.add(check_job_id(entry.name))
    return sorted(out)


@dataclasses.dataclass(frozen=True)
class Holdings:
    """One job's committed steps on this node, with sizes and world sizes."""

    ranks: dict[int, RankHoldings]
    world_sizes: dict[int, int]
    local_bytes: int
    replica_bytes: int
    newest_commit_at: dict[int, float]
    """Rank -> commit time of its newest local step (for replication lag)."""
    contents: tuple[StepContent, ...] = ()
    """The steps above that saved in a replica group, with their recomputed content keys."""
    newest_bytes: dict[int, int] = dataclasses.field(default_factory=dict)
    """Rank -> bytes its newest local step's COMMIT declares (checked against the job's quota)."""
    newest_world: dict[int, int] = dataclasses.field(default_factory=dict)
    """Rank -> the world size its newest local step was saved with."""
    left: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Rank -> its local steps the run the job went back from saved (``RestorePlan.left_behind``): held
    (in ``ranks``) until the client's first commit retires them, but none is the rank's newest."""

    def saved(self, rank: int) -> tuple[int, ...]:
        """The rank's local steps but those left behind, oldest first."""
        left = self.left.get(rank, ())
        return tuple(s for s in self.ranks[rank].local if s not in left)

    def newest_local(self) -> dict[int, int]:
        """Rank -> its newest local step (not one the run the job went back from saved)."""
        return {r: steps[-1] for r in self.ranks if (steps := self.saved(r))}

    def newest_common(self) -> int | None:
        """The newest step every local rank the job still saves here has committed
        (``planning.common_step.current_ranks``: not the ranks of a world size it left)."""
        current = current_ranks(
            {r: (self.newest_commit_at.get(r, 0.0), w) for r, w in self.newest_world.items()}
        )
        return newest_common_step(steps for r in self.ranks if r in current and (steps := self.saved(r)))


PlanOf = Callable[[str], RestorePlan | None]
"""A job -> the restore plan this node staged for it last (``stores.NodeStores.plans``, which the
daemon's ``restore.stage.Stager`` keeps)."""

FragmentScan = Callable[[Beneath], dict[int, dict[int, tuple[tuple[int, int], int]]]]
"""A job tree -> rank -> step -> ((fragment index, k), world size) of the erasure-coded fragments held
(``replication.fragments.FragmentScanner``, given by the daemon: it sits in a layer above this one)."""


def _no_fragments(_: Beneath) -> dict[int, dict[int, tuple[tuple[int, int], int]]]:
    return {}


def no_plan(_: str) -> RestorePlan | None:
    """The ``PlanOf`` of a node that staged no restore (tools and tests): no step is left behind."""
    return None


class InventoryScanner:
    def __init__(
        self,
        root: Path,
        *,
        node: str,
        endpoint: str,
        domain: str = "",
        max_manifest_bytes: int = 64 << 20,
        fragments: FragmentScan = _no_fragments,
        plan_of: PlanOf = no_plan,
    ) -> None:
        self.root, self.node, self.endpoint, self.domain = root, node, endpoint, domain
        self.fragments, self.plan_of = fragments, plan_of
        self.max_manifest_bytes = max_manifest_bytes
        self._steps: dict[tuple[str, int], _StepFacts] = {}

    def holdings(self, job: str) -> Holdings:
        ranks: dict[int, RankHoldings] = {}
        world_sizes: dict[int, int] = {}
        sizes = {"local": 0, "replica": 0}
        newest_at: dict[int, float] = {}
        newest_bytes: dict[int, int] = {}
        newest_world: dict[int, int] = {}
        left: dict[int, tuple[int, ...]] = {}
        contents: list[StepContent] = []
        try:
            tree = open_job(self.root, job)
        except (FileNotFoundError, NotADirectoryError):
            return Holdings(ranks, world_sizes, 0, 0, newest_at)
        plan = self.plan_of(job)
        with tree:
            tiers: tuple[tuple[Literal["local", "replica"], Copy], ...] = (
                ("local", "primary"),
                ("replica", "replica"),
            )
            for kind, copy in tiers:
                for rank, parent in rank_trees(tree, copy).items():
                    steps = []
                    for step in committed_steps(parent):
                        info = self._step_info(parent.at(step_name(step)))
                        if info is None:
                            continue
                        total, facts, committed_at = info
                        steps.append(step)
                        sizes[kind] += total
                        world_sizes.setdefault(step, facts.world_size)
                        if kind == "local" and plan is not None and plan.left_behind(step, committed_at):
                            left[rank] = (*left.get(rank, ()), step)
                        elif kind == "local":
                            newest_at[rank], newest_bytes[rank] = committed_at, total
                            newest_world[rank] = facts.world_size
                        if facts.content is not None:
                            found = dataclasses.replace(facts.content, rank=rank, step=step, copy=kind)
                            contents.append(found)
                    h = ranks.get(rank, RankHoldings())
                    ranks[rank] = dataclasses.replace(h, **{kind: tuple(steps)})  # type: ignore[arg-type]
            for rank, held in self.fragments(tree).items():
                for step, (_, ws) in held.items():
                    world_sizes.setdefault(step, ws)
                fragments = {step: index_k for step, (index_k, _) in held.items()}
                ranks[rank] = dataclasses.replace(ranks.get(rank, RankHoldings()), fragments=fragments)
        return Holdings(
            ranks,
            world_sizes,
            sizes["local"],
            sizes["replica"],
            newest_at,
            tuple(contents),
            newest_bytes,
            newest_world,
            left,
        )

    def _step_info(self, step: Beneath) -> tuple[int, _StepFacts, float] | None:
        try:
            marker = read_commit(step)
            if marker is None:
                return None
            key = (step.where, marker.manifest_crc32c)
            facts = self._steps.get(key)
            if facts is None:
                facts = _facts(read_manifest(step, limit=self.max_manifest_bytes))
                self._steps[key] = facts
            return marker.total_bytes, facts, marker.committed_at
        except (FormatError, OSError) as exc:
            log.warning("skipping unreadable step %s: %s", step.where, exc)
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
            contents=h.contents,
        )

    def forget(self, job: str) -> None:
        prefix = f"{self.root / check_job_id(job)}/"
        self._steps = {k: v for k, v in self._steps.items() if not k[0].startswith(prefix)}


@dataclasses.dataclass(frozen=True)
class _StepFacts:
    """What the inventory needs of a step's manifest (cached by the manifest's crc32c)."""

    world_size: int
    content: StepContent | None


def _facts(manifest: Manifest) -> _StepFacts:
    """World size and, for a step saved in a replica group, its ``StepContent`` (rank, step and copy
    are filled in by the caller). The content key is recomputed here; a record whose own key disagrees
    is reported as diverged (and logged): its copies are never deduplicated."""
    record = manifest.replica
    if record is None or not record.known:
        return _StepFacts(manifest.world_size, None)
    key = content_key(manifest.files, manifest.tensors)
    if key != record.content:
        log.warning(
            "%s rank %d step %d: the replica record's content key %s does not match its manifest (%s); "
            "not deduplicating it",
            manifest.job,
            manifest.rank,
            manifest.step,
            record.content,
            key,
        )
    content = StepContent(
        rank=manifest.rank,
        step=manifest.step,
        copy="local",
        group=record.group,
        members=record.members,
        content=key,
        diverged=record.diverged or key != record.content,
        written_bytes=record.written_bytes,
        logical_bytes=record.logical_bytes,
    )
    return _StepFacts(manifest.world_size, content)
