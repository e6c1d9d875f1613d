"""Agreement between ranks at load time (torch.distributed collectives, no-ops without a process group).

Saves need no collective: each rank commits on its own. Loads do: every rank must restore the same
step, so ranks exchange the steps they hold and take the newest one that *every* rank holds, and after
loading they exchange success flags so that a corrupt shard on one rank makes all ranks fall back
together (or all raise).
"""

from __future__ import annotations

from typing import Any

__all__ = ["all_gather", "all_ok", "distributed"]


def distributed(group: Any = None) -> bool:
    """Whether ``group`` (None: the default group) joins more than this process."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def all_gather(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, in the order of their ranks in ``group`` (None: the default group); just
    ``[obj]`` without a process group."""
    if not distributed(group):
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_ok(ok: bool) -> tuple[bool, list[int]]:
    """Whether every rank reports success, and which ranks did not."""
    flags = all_gather(bool(ok))
    failed = [r for r, f in enumerate(flags) if not f]
    return not failed, failed
