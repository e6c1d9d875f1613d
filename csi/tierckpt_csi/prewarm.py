"""Touch a new node's memory once, before any training pod runs on it.

The first write to a page of a fresh VM's memory is slow: the hypervisor backs the page then. On an H200
VM, pre-faulting the first 11 GiB slot of a trainer cost 0.14 s/GiB and pinning it for DMA up to
0.12 s/GiB, against 0.03 and 0.02 s/GiB once that memory had been used by any process before
(docs/benchmarks.md, "GPU goodput from process start"). A trainer's first saves then wait seconds for
their slots. Pages freed by the guest stay backed, so touching them once at node start is enough.

``prewarm`` does that on the ramdisk when the driver mounts it anew (a node that just booted): it writes
zeros over a hidden file of the ramdisk's free space (bounded by ``limit`` and by a share of
``MemAvailable``), with a few threads, then deletes it. A driver restart adopts the ramdisk and skips
this: its memory was touched already. Nothing here is reachable by a pod: it runs before the driver
serves any request.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import logging
import mmap
import os
import time
from pathlib import Path

from tierckpt.protocol.quantity import format_bytes

__all__ = ["PREWARM_FILE", "Prewarmed", "cgroup_room", "prewarm"]

log = logging.getLogger(__name__)

PREWARM_FILE = ".tierckpt-prewarm"
"""The file written and deleted in the ramdisk's root (no job id starts with a dot)."""
MEMORY_SHARE = 0.8
"""Share of ``MemAvailable`` the prewarm may hold at once (it holds its bytes until it is done)."""
CGROUP_MARGIN = 64 << 20
"""Bytes kept below the memory cgroup's limit."""
_PIECE = 64 << 20
_ALIGN = 2 << 20


@dataclasses.dataclass(frozen=True)
class Prewarmed:
    nbytes: int
    seconds: float


def _mem_available() -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def cgroup_room(
    proc: Path = Path("/proc/self/cgroup"), sys_root: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """Bytes this process's memory cgroup (and each ancestor of it) may still charge, less
    ``CGROUP_MARGIN``; None without a limit. tmpfs pages are charged to the cgroup of the process that
    writes them, so a prewarm beyond this would get the driver OOM-killed."""
    rooms = []
    with contextlib.suppress(OSError, ValueError):
        for line in proc.read_text().splitlines():
            hierarchy, controllers, path = line.split(":", 2)
            if hierarchy == "0":  # cgroup v2: the limit of every level up to the root applies
                level = sys_root / path.lstrip("/")
                while True:
                    limit = level / "memory.max"
                    if limit.exists() and (text := limit.read_text().strip()) != "max":
                        rooms.append(int(text) - int((level / "memory.current").read_text()))
                    if level == sys_root or sys_root not in level.parents:
                        break
                    level = level.parent
            elif "memory" in controllers.split(","):  # cgroup v1
                level = sys_root / "memory" / path.lstrip("/")
                limit_bytes = int((level / "memory.limit_in_bytes").read_text())
                if limit_bytes < 1 << 60:  # "no limit" reads as a huge number there
                    rooms.append(limit_bytes - int((level / "memory.usage_in_bytes").read_text()))
    return max(0, min(rooms) - CGROUP_MARGIN) if rooms else None


def prewarm(path: str | os.PathLike[str], limit: int, *, workers: int = 8) -> Prewarmed:
    """Write zeros over up to ``limit`` bytes of the tmpfs at ``path`` (its free space, at most
    ``MEMORY_SHARE`` of ``MemAvailable`` and what this process's memory cgroup may still charge) and
    free them again. Returns what it touched; touches nothing (and logs why) when there is no room.
    Raises ``OSError`` only for an unusable ``path``."""
    root = Path(path)
    target = root / PREWARM_FILE
    target.unlink(missing_ok=True)  # left by a driver killed while prewarming
    st = os.statvfs(root)
    bounds = {
        "free space": st.f_bavail * st.f_frsize,
        "limit": limit,
        "MemAvailable share": int(_mem_available() * MEMORY_SHARE),
    }
    room = cgroup_room()
    if room is not None:
        bounds["memory cgroup"] = room
    nbytes = min(bounds.values()) // _ALIGN * _ALIGN
    if room is not None and room < min(bounds["free space"], bounds["limit"]):
        log.warning(
            "prewarming at most %s of the node's memory: the container's memory limit allows no more "
            "(tmpfs pages are charged to their writer; run the driver without a memory limit to prewarm "
            "the whole ramdisk)",
            format_bytes(room),
        )
    if nbytes <= 0:
        log.info(
            "did not prewarm the node's memory: no room (%s)",
            ", ".join(f"{k} {format_bytes(v)}" for k, v in bounds.items()),
        )
        return Prewarmed(0, 0.0)
    start = time.perf_counter()
    fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(target)  # the pages live while the descriptor does; nothing is left if this process dies
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            log.warning(
                "did not prewarm the node's memory: reserving %s failed (%s)", format_bytes(nbytes), exc
            )
            return Prewarmed(0, 0.0)
        with mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
            base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # valid while the mapping is
            with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="prewarm") as pool:
                for _ in pool.map(  # ctypes calls release the GIL: the threads write in parallel
                    lambda offset: ctypes.memset(base + offset, 0, min(_PIECE, nbytes - offset)),
                    range(0, nbytes, _PIECE),
                ):
                    pass
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    log.info(
        "prewarmed the node's memory: wrote %s of the ramdisk once in %.1f s (%.3f s/GiB), then freed it",
        format_bytes(nbytes),
        seconds,
        seconds / (nbytes / (1 << 30)),
    )
    return Prewarmed(nbytes, seconds)
