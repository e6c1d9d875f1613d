"""The CPUs this process's background work (checksums, copies, pre-faulting) may use.

A node runs one trainer per GPU: each gets its share of the CPUs it may run on, ``LOCAL_WORLD_SIZE``
(set by torchrun) telling how many trainers share them. ``torch.get_num_threads()`` is no guide:
torchrun sets ``OMP_NUM_THREADS=1`` for the training's own kernels, which says nothing about threads
that only copy memory.

The pools that do bulk work on many cores, checksums and pre-faulting, run at a lower priority
(``lower_priority``, nice +10): while a save's checksums and the next slot's pre-faulting ran on every
core at normal priority, the training thread waited for a core to launch its kernels, and steps between
saves took 5-18 times as long (an H200 host, 16 cores, one trainer). At nice +10 they still take every
core the training thread leaves idle. The single warm-up and commit threads, which mostly wait for those
pools, keep the training thread's priority.
"""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["BACKGROUND_NICE", "cpu_share", "lower_priority"]

BACKGROUND_NICE = 10
"""How much nicer than the training thread the background threads run (capped at 19)."""


def cpu_share() -> int:
    """This process's share of the CPUs it may run on (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    trainers = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, cpus // trainers)


def lower_priority() -> None:
    """Make the calling thread ``BACKGROUND_NICE`` nicer (an initializer for background thread pools).
    Linux schedules threads by their own nice value; elsewhere this does nothing."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        nice = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, nice + BACKGROUND_NICE))
