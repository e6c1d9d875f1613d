"""Replicated items once per node, not once per job (pure: plans in, plans out).

DCP keeps each replicated item (a plain tensor, a ``Replicate`` DTensor shard, a non-tensor object every
rank holds) in the plan of one rank only. On one node that is all a load needs; on several, every other
node would have to read it from that rank's node. ``add_node_copies`` gives it back to one rank of every
node that would lack it: the rank of that node that held it before DCP deduplicated it and has the
fewest planned bytes (greedy, in a fixed order, so every coordinator decides the same). Every rank holds
its replicated state, so ``planner.resolve_data`` serves the copy like any of its own items.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

__all__ = ["NodeCopies", "add_node_copies", "item_bytes"]


def item_bytes(item: WriteItem) -> int:
    """The bytes an item adds to its rank's step (a non-tensor object counts 1: its size is not known yet)."""
    td = item.tensor_data
    if td is None:
        return 1
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class NodeCopies:
    """The plans' items with the copies added, and who holds each item (DCP's writer first)."""

    items: list[list[WriteItem]]
    holders: dict[MetadataIndex, tuple[int, ...]]
    added_bytes: int
    """Bytes of tensor copies beyond DCP's once-per-job (objects count 1 each)."""


def add_node_copies(
    kept: Sequence[Sequence[WriteItem]],
    own: Sequence[Sequence[WriteItem]],
    ranks: Sequence[int],
    nodes: Sequence[str],
) -> NodeCopies:
    """Add a copy of every item a node's ranks held but DCP left to a rank of another node.

    ``kept[i]``: plan ``i``'s items after DCP's deduplication; ``own[i]``: its items before it (what
    that process holds); ``ranks[i]``, ``nodes[i]``: its rank and its node.
    """
    out = [list(items) for items in kept]
    load = [sum(item_bytes(it) for it in items) for items in kept]
    writer: dict[MetadataIndex, int] = {}
    template: dict[MetadataIndex, WriteItem] = {}
    for i, items in enumerate(kept):
        for it in items:
            writer[it.index] = i
            template[it.index] = it
    written_on: dict[str, set[MetadataIndex]] = {}
    for index, i in writer.items():
        written_on.setdefault(nodes[i], set()).add(index)
    members: dict[str, list[int]] = {}
    for i in sorted(range(len(nodes)), key=lambda i: ranks[i]):
        members.setdefault(nodes[i], []).append(i)  # nodes in the order of their lowest rank
    copies: dict[MetadataIndex, list[int]] = {}
    added = 0
    for node, plans in members.items():
        have = written_on.setdefault(node, set())
        holders: dict[MetadataIndex, list[tuple[int, WriteItem]]] = {}
        for i in plans:
            for it in own[i]:
                if it.index in writer and it.index not in have:
                    holders.setdefault(it.index, []).append((i, it))
        for index, candidates in holders.items():
            i, mine = min(candidates, key=lambda c: (load[c[0]], ranks[c[0]]))
            copy = dataclasses.replace(mine, index=template[index].index)  # DCP's index hint
            out[i].append(copy)
            size = item_bytes(copy)
            load[i] += size
            added += size if copy.tensor_data is not None else 0
            have.add(index)
            copies.setdefault(index, []).append(ranks[i])
    holders_out = {index: (ranks[i], *copies.get(index, ())) for index, i in writer.items()}
    return NodeCopies(out, holders_out, added)
