"""Admission of a job onto the node ramdisk: reservations must fit the ramdisk, and growth must fit RAM.

Pure: the caller gathers the facts (ramdisk size and use, each active job's reservation and bytes, the
node's MemAvailable) and gets back a verdict with a message fit for a pod event. Two rules:

1. **Reservations fit the ramdisk.** Every job with a published volume on the node holds a reservation
   (its ``tierckpt.io/ramdisk-reservation`` attribute, by default the whole ramdisk). The sum over active
   jobs, plus the new job's, must not exceed the ramdisk's size.
2. **What may still be written fits in memory.** tmpfs pages are RAM. Bytes already in the ramdisk are
   already out of MemAvailable; what the active jobs and the new one may still write (each up to its
   reservation, all together up to the ramdisk's free space) must fit in MemAvailable less a headroom
   kept for the training processes and the system.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tierckpt.protocol.quantity import format_bytes as _b

__all__ = ["Admission", "JobUse", "admit", "mem_available"]


@dataclasses.dataclass(frozen=True)
class JobUse:
    """One job on the node: the bytes it reserved and the bytes its directory holds now."""

    reservation: int
    used: int

    @property
    def growth(self) -> int:
        return max(self.reservation - self.used, 0)


@dataclasses.dataclass(frozen=True)
class Admission:
    admitted: bool
    reason: str
    reserved_after: int
    """Sum of reservations if admitted."""
    growth: int
    """Bytes the ramdisk may still grow by if admitted."""


def admit(
    job: str,
    new: JobUse,
    active: Mapping[str, JobUse],
    *,
    ramdisk_size: int,
    ramdisk_used: int,
    mem_available: int,
    headroom: int,
) -> Admission:
    """May ``job`` (using ``new``) join the ``active`` jobs on this node's ramdisk?"""
    others = {j: u for j, u in active.items() if j != job}
    reserved = sum(u.reservation for u in others.values()) + new.reservation
    growth = min(sum(u.growth for u in others.values()) + new.growth, max(ramdisk_size - ramdisk_used, 0))
    if new.reservation > ramdisk_size:
        why = f"job {job} reserves {_b(new.reservation)} but the node ramdisk is only {_b(ramdisk_size)}"
        return Admission(False, why, reserved, growth)
    if reserved > ramdisk_size:
        left = ramdisk_size - (reserved - new.reservation)
        holders = ", ".join(f"{j} ({_b(u.reservation)})" for j, u in sorted(others.items()))
        why = (
            f"node ramdisk overcommitted: job {job} reserves {_b(new.reservation)} but only {_b(left)} of "
            f"{_b(ramdisk_size)} is unreserved (held by {holders})"
        )
        return Admission(False, why, reserved, growth)
    budget = mem_available - headroom
    if growth > budget:
        why = (
            f"node memory overcommitted: the ramdisk may still grow by {_b(growth)} (size "
            f"{_b(ramdisk_size)}, used {_b(ramdisk_used)}) but the node has MemAvailable "
            f"{_b(mem_available)} with {_b(headroom)} kept as headroom; lower the job's reservation or "
            "the ramdisk size, or use a bigger node"
        )
        return Admission(False, why, reserved, growth)
    return Admission(True, "admitted", reserved, growth)


def mem_available(meminfo_path: str = "/proc/meminfo") -> int:
    """The kernel's estimate of memory available for new work, in bytes."""
    with open(meminfo_path, encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{meminfo_path} has no MemAvailable line")
