"""Replica groups on the client: which ranks hold identical state, and what each save agrees on.

A replica group is a set of ranks whose tensors are identical: every rank under DDP, the replicate
dimension of HSDP (FSDP2 on a 2-D mesh), the data-parallel dimension of TP x DP. A ``Checkpointer``
given one (``replica_group=[...]`` or ``replica_group_from_mesh(mesh, "replicate")``):

* finds, once, which members share its node: every member reads the job directory's node mark
  (``protocol.replica.node_mark``) and the marks are exchanged over the group; on each node the lowest
  member rank writes, and the others link its files (``Membership``);
* at every save, fingerprints its tensors (``snapshot.fingerprint``) and exchanges the fingerprint,
  with whether it refuses this save (busy, or the step is leased) and its last failed step, in one
  small all-gather over the group (``Membership.agree``). Equal fingerprints: the node's followers link
  the writer's files. Any difference: every member writes its own copy, the save is reported as
  diverged (log, manifest, optionally an exception), and a second exchange names the tensors that
  differ.

Every member of a group must save the same steps together (the exchange is a collective) and use the
same policies. Docs: docs/client.md, "Replica groups".
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from tierckpt.protocol.errors import ContractError
from tierckpt.protocol.replica import group_id, node_mark
from tierckpt.snapshot.fingerprint import fingerprint, tensor_digests

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "BUSY",
    "FAILED",
    "LEASED",
    "Agreement",
    "Membership",
    "ReplicaGroup",
    "replica_group_from_mesh",
]

log = logging.getLogger(__name__)

BUSY = 1
"""A member's previous save is still committing (``on_busy`` is ``skip`` or ``error``)."""
LEASED = 2
"""A member cannot replace the step: a reader leases its existing copy."""
FAILED = 3
"""A member's save failed before the exchange (it raises the error itself)."""
_REFUSALS = {
    BUSY: "its previous save is still committing",
    LEASED: "its copy of the step is leased",
    FAILED: "its save failed",
}
_NAMED_KEYS = 8
"""Tensors named per member in a divergence report."""


@dataclasses.dataclass(frozen=True)
class ReplicaGroup:
    """Ranks holding identical state (this rank among them), and the process group that joins them.

    ``process_group`` None: the default group when the members are every rank, else one created when
    the ``Checkpointer`` starts (``new_group`` among the members only). ``replica_group_from_mesh``
    takes the group of a ``DeviceMesh`` dimension.
    """

    members: tuple[int, ...]
    process_group: Any = None

    def __post_init__(self) -> None:
        members = tuple(sorted({int(m) for m in self.members}))
        if not members or members[0] < 0 or len(members) != len(self.members):
            raise ValueError(f"a replica group is a list of distinct ranks, got {self.members!r}")
        object.__setattr__(self, "members", members)

    @classmethod
    def of(cls, value: ReplicaGroup | Sequence[int]) -> ReplicaGroup:
        return value if isinstance(value, ReplicaGroup) else cls(tuple(value))

    @property
    def id(self) -> str:
        return group_id(self.members)


def replica_group_from_mesh(mesh: DeviceMesh, dim: str | int | Sequence[str | int]) -> ReplicaGroup:
    """This rank's replica group along ``dim`` of ``mesh``: the ranks that differ from it only in that
    dimension (or those dimensions) hold the same shards. HSDP / FSDP2 on a ``("replicate", "shard")``
    mesh: ``"replicate"``; TP x DP: the DP dimension; DDP on a 1-D mesh: ``0``."""
    if isinstance(dim, (str, int)):
        pg = mesh.get_group(dim)
        return ReplicaGroup(tuple(dist.get_process_group_ranks(pg)), pg)
    names = list(mesh.mesh_dim_names or ())
    dims = {names.index(d) if isinstance(d, str) else int(d) for d in dim}
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError("this rank is not part of the mesh")
    grid = mesh.mesh
    index = tuple(slice(None) if i in dims else coordinate[i] for i in range(grid.ndim))
    return ReplicaGroup(tuple(int(r) for r in grid[index].flatten().tolist()))


@dataclasses.dataclass(frozen=True)
class Agreement:
    """What the members of a group agreed on for one save."""

    fingerprint: str
    """This rank's fingerprint, as hex."""
    refused: dict[int, int]
    """Members refusing this save (``BUSY``, ``LEASED``): then no member saves."""
    failed: dict[int, int]
    """Each member's last failed save step (-1: none)."""
    diverged: bool
    differs: tuple[int, ...]
    """Members whose fingerprint differs from this rank's."""
    classes: tuple[tuple[int, ...], ...]
    """The members grouped by equal fingerprints (one class unless diverged)."""
    differing_keys: dict[int, list[str]]
    """Per differing member, the first tensors that differ (empty when the structures differ)."""
    source: int | None
    """The member whose files this rank links for this save (None: it writes its own)."""
    fingerprint_s: float
    exchange_s: float

    def refusal_text(self) -> str:
        return "; ".join(
            f"rank {m}: {_REFUSALS.get(c, f'refusal {c}')}" for m, c in sorted(self.refused.items())
        )


@dataclasses.dataclass
class Membership:
    """This rank's place in its replica group, resolved when its ``Checkpointer`` starts."""

    group: ReplicaGroup
    process_group: Any
    rank: int
    order: tuple[int, ...]
    """Members in the process group's rank order (how collectives list them)."""
    node: str
    nodes: dict[int, str]
    """Each member's node mark."""
    source: int | None
    """The member that writes for this rank's node, when it is not this rank."""

    @property
    def id(self) -> str:
        return self.group.id

    @property
    def writer(self) -> bool:
        return self.source is None

    @classmethod
    def resolve(
        cls,
        group: ReplicaGroup,
        *,
        rank: int,
        world_size: int,
        job_path: Path,
        rank_path_of: Callable[[int], Path],
    ) -> Membership:
        """Set up the group's process group, exchange node marks, and pick this node's writer.

        A collective over the group: every member constructs its ``Checkpointer`` together.
        ``rank_path_of(rank)`` is a member's rank directory as this process sees it.
        """
        if rank not in group.members:
            raise ContractError(f"rank {rank} is not a member of its replica group {list(group.members)}")
        if group.members[-1] >= world_size:
            raise ContractError(
                f"replica group {list(group.members)} names ranks beyond world size {world_size}"
            )
        mark = node_mark(job_path)
        if len(group.members) == 1:
            return cls(group, None, rank, group.members, mark, {rank: mark}, None)
        if not (dist.is_available() and dist.is_initialized()):
            raise ContractError("a replica group of several ranks needs torch.distributed initialised")
        pg = group.process_group
        if pg is None and group.members != tuple(range(dist.get_world_size())):
            pg = dist.new_group(list(group.members), use_local_synchronization=True)
        order = tuple(dist.get_process_group_ranks(pg)) if pg is not None else tuple(range(world_size))
        if tuple(sorted(order)) != group.members:
            raise ContractError(
                f"the replica group's process group holds ranks {sorted(order)}, not {group.members}"
            )
        marks: list[Any] = [None] * len(order)
        dist.all_gather_object(marks, mark, group=pg)
        nodes = dict(zip(order, (str(m) for m in marks), strict=True))
        writer = min(m for m in group.members if nodes[m] == mark)
        source = None if writer == rank else writer
        if source is not None and not (Path(rank_path_of(source)) / ".writer.lock").exists():
            log.warning(
                "replica group %s: rank %d shares this node with rank %d but cannot see its rank directory; "
                "writing its own copies",
                group.id,
                rank,
                source,
            )
            source = None
        membership = cls(group, pg, rank, order, mark, nodes, source)
        on_node = sorted(m for m in group.members if nodes[m] == mark)
        log.info(
            "replica group %s %s: rank %d %s (members on this node: %s)",
            group.id,
            list(group.members),
            rank,
            "writes for this node" if source is None else f"links the files of rank {source}",
            on_node,
        )
        return membership

    # ------------------------------------------------------------------------------------- collectives

    def exchange_device(self) -> torch.device:
        """Where the group's collectives take their tensors: the current CUDA device for NCCL."""
        if self.process_group is None and not dist.is_initialized():
            return torch.device("cpu")
        backend = str(dist.get_backend(self.process_group))
        if "nccl" in backend and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in self.order]
        dist.all_gather(out, tensor, group=self.process_group)
        return out

    def all_gather_object(self, obj: Any) -> dict[int, Any]:
        """Every member's ``obj``, by member rank."""
        if len(self.order) == 1:
            return {self.rank: obj}
        out: list[Any] = [None] * len(self.order)
        dist.all_gather_object(out, obj, group=self.process_group)
        return dict(zip(self.order, out, strict=True))

    def agree(
        self,
        keys: Sequence[str],
        tensors: Sequence[torch.Tensor],
        *,
        structure: int,
        refusal: int,
        last_failed: int,
    ) -> Agreement:
        """Fingerprint this rank's tensors and agree with the other members on this save (a collective)."""
        start = time.perf_counter()
        fp = fingerprint(keys, tensors, structure=structure)
        if len(self.order) == 1:
            rows = {self.rank: fp.vector(torch.device("cpu"), (refusal, last_failed)).tolist()}
            fingerprinted = exchanged = time.perf_counter()
        else:
            vector = fp.vector(self.exchange_device(), (refusal, last_failed))
            fingerprinted = time.perf_counter()
            gathered = torch.stack(self._all_gather(vector)).cpu().tolist()
            rows = dict(zip(self.order, gathered, strict=True))
            exchanged = time.perf_counter()
        words = {m: tuple(r[2:]) for m, r in rows.items()}
        mine_words = words[self.rank]
        refused = {m: int(r[0]) for m, r in rows.items() if r[0]}
        failed = {m: int(r[1]) for m, r in rows.items()}
        differs = tuple(m for m in self.group.members if words[m] != mine_words)
        by_words: dict[tuple[int, ...], list[int]] = {}
        for m in self.group.members:
            by_words.setdefault(words[m], []).append(m)
        classes = tuple(sorted(tuple(c) for c in by_words.values()))
        diverged = len(classes) > 1
        named: dict[int, list[str]] = {}
        if diverged and not refused and len({w[0] for w in words.values()}) == 1:
            named = self._name_differences(keys, tensors, differs)
        digest = hashlib.blake2b(
            b"".join(int(w).to_bytes(8, "little", signed=True) for w in mine_words), digest_size=16
        ).hexdigest()
        source = self.source if not diverged and not refused else None
        return Agreement(
            fingerprint=digest,
            refused=refused,
            failed=failed,
            diverged=diverged,
            differs=differs,
            classes=classes,
            differing_keys=named,
            source=source,
            fingerprint_s=fingerprinted - start,
            exchange_s=exchanged - fingerprinted,
        )

    def _name_differences(
        self, keys: Sequence[str], tensors: Sequence[torch.Tensor], differs: Sequence[int]
    ) -> dict[int, list[str]]:
        """The slow path after a divergence: exchange per-tensor digests, name what differs (a collective
        every member enters, since all saw the same divergence)."""
        table = tensor_digests(tensors, self.exchange_device())
        gathered = dict(zip(self.order, (t.cpu() for t in self._all_gather(table)), strict=True))
        mine = gathered[self.rank]
        out = {}
        for m in differs:
            rows = (gathered[m] != mine).any(dim=1).nonzero().flatten().tolist()
            out[m] = [keys[i] for i in rows[:_NAMED_KEYS]] + (
                [f"... {len(rows) - _NAMED_KEYS} more"] if len(rows) > _NAMED_KEYS else []
            )
        return out
