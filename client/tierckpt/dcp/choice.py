"""Which step a DCP load without a step reads: the newest one that every rank can load from its node.

``RamdiskReader`` without a step asks ``newest_loadable`` in ``read_metadata``, before DCP plans
anything, so a damaged step costs a fallback and nothing else. Every rank of the load's process group
takes part (a collective when distributed) and every rank gets the same answer, as with
``Checkpointer.load``: a file missing on one rank's node makes every rank fall back together.

1. The ranks exchange which node they run on and the steps it holds; the candidates are all those
   steps, newest first.
2. For each candidate, every rank checks it on its node (the reader's ``check``: the metadata, a copy of
   every item, each data file those copies are in). The ranks of one node share out the crc32c pass over
   those files (``NodeShare``), so each file is read once per node. The ranks exchange what they found:
   the first step no rank found a problem with is the answer; a step some rank could not load is
   skipped with a warning that names the rank and the problem.
3. No candidate left: ``CorruptShardError`` when some step was damaged, else ``MissingCheckpointError``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tierckpt.protocol.errors import CorruptShardError, FormatError, MissingCheckpointError

__all__ = ["NodeShare", "Problem", "newest_loadable"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_SHOWN = 3
"""Problems a log line or an error message spells out (the rest are counted)."""


@dataclasses.dataclass(frozen=True)
class NodeShare:
    """This rank's part of the work the ranks of its node split between them."""

    index: int
    size: int

    def of(self, items: Sequence[T]) -> list[T]:
        """Every ``size``-th of ``items`` (the same sequence on every rank of the node), from ``index``."""
        return list(items[self.index :: self.size])


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why one rank cannot load a step from its node."""

    rank: int
    message: str
    corrupt: bool
    """Damaged data (a missing, short or corrupt file, a metadata or manifest that does not check out);
    False: the step is not (wholly) on this rank's node."""
    path: str | None = None

    @classmethod
    def of(cls, rank: int, exc: Exception) -> Problem:
        if isinstance(exc, MissingCheckpointError):
            return cls(rank, str(exc), corrupt=False)
        if isinstance(exc, (FormatError, OSError)):  # an unreadable file of a committed step is damaged
            path = getattr(exc, "path", None) or getattr(exc, "filename", None)
            return cls(rank, str(exc), corrupt=True, path=None if path is None else str(path))
        return cls(rank, f"{type(exc).__name__}: {exc}", corrupt=False)


def _describe(problems: Sequence[Problem]) -> str:
    shown = "; ".join(f"rank {p.rank}: {p.message}" for p in problems[:_SHOWN])
    more = len(problems) - _SHOWN
    return shown + (f"; and {more} more rank(s)" if more > 0 else "")


def newest_loadable(
    steps: Sequence[int],
    check: Callable[[int, NodeShare], object],
    *,
    rank: int,
    node: str,
    gather: Callable[[Any], list[Any]],
    where: str,
) -> int:
    """The newest step no rank finds a problem with: the same answer on every rank.

    A collective: every rank calls it. ``steps`` are the steps this rank's node holds, ``node`` names the
    node (ranks with the same one split the work), ``check(step, share)`` raises what keeps this rank from
    loading ``step``, ``gather(obj)`` is every rank's ``obj`` (``snapshot.agree.all_gather``; ``[obj]``
    for one process). ``where`` names the checkpoint in messages.
    """
    gathered: list[tuple[int, str, Sequence[int]]] = gather((rank, node, tuple(steps)))
    peers = sorted(r for r, n, _ in gathered if n == node)
    share = NodeShare(peers.index(rank), len(peers))
    candidates = sorted({s for _, _, held in gathered for s in held}, reverse=True)
    skipped: dict[int, list[Problem]] = {}
    for step in candidates:
        try:
            check(step, share)
            mine: Problem | None = None
        except Exception as exc:  # reported, never raised here: every rank must reach the exchange
            mine = Problem.of(rank, exc)
        problems = [p for p in gather(mine) if p is not None]
        if not problems:
            if skipped:
                log.warning(
                    "rank %d: loading DCP step %d of %s, since the newer step(s) %s cannot be loaded",
                    rank,
                    step,
                    where,
                    sorted(skipped, reverse=True),
                )
            return step
        skipped[step] = problems
        log.warning(
            "rank %d: DCP step %d of %s cannot be loaded (%s); %s",
            rank,
            step,
            where,
            _describe(problems),
            "trying an older step" if step != candidates[-1] else "no older step is left",
        )
    raise _nothing_loadable(skipped, where)


def _nothing_loadable(skipped: dict[int, list[Problem]], where: str) -> Exception:
    if not skipped:
        return MissingCheckpointError(f"no DCP checkpoint under {where}")
    detail = " | ".join(f"step {s}: {_describe(ps)}" for s, ps in skipped.items())
    corrupt = [p for ps in skipped.values() for p in ps if p.corrupt]
    if corrupt:
        path = next((p.path for p in corrupt if p.path), where)
        return CorruptShardError(f"no DCP step under {where} can be loaded: {detail}", path=path)
    return MissingCheckpointError(f"no complete DCP checkpoint under {where}: {detail}")
