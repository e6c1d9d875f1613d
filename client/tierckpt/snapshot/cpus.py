"""The CPUs this process's background work (checksums, copies, pre-faulting) may use.

A node runs one trainer per GPU: each gets its share of the CPUs it may run on, ``LOCAL_WORLD_SIZE``
(set by torchrun) telling how many trainers share them. ``torch.get_num_threads()`` is no guide:
torchrun sets ``OMP_NUM_THREADS=1`` for the training's own kernels, which says nothing about threads
that only copy memory.
"""

from __future__ import annotations

import os

__all__ = ["cpu_share"]


def cpu_share() -> int:
    """This process's share of the CPUs it may run on (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    trainers = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, cpus // trainers)
