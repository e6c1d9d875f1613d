"""DCP on the ramdisk: ``RamdiskWriter``/``RamdiskReader`` against DCP's ``FileSystemWriter``/``Reader``.

Both write to the same tmpfs, in one process (``no_dist``), the same state: a few large tensors and
many small ones. Measured per method, best of the repeats (robust to other load on the machine):

* ``save``: ``dcp.save`` wall time (blocking = durable: the step is committed when it returns);
* ``async blocked`` / ``async durable``: ``dcp.async_save`` until it returns / until its future is done;
* ``load``: ``dcp.load`` into preallocated tensors;
* the setup's objects are frozen out of the garbage collector (``gc.freeze``), as in a long-running
  trainer, so a full collection does not land at random inside one method's timings;
* steady state: three untimed saves first (``RamdiskWriter`` then writes into recycled, pre-faulted files;
  ``FileSystemWriter`` always writes new files, which is its steady state);
* floor: one memcpy of the same bytes into pre-faulted memory.

Ratios are FileSystemWriter time / RamdiskWriter time (above 1: the ramdisk plugin is faster). The async
rows use each writer's own staging (both are DCP ``AsyncStager``s; RamdiskWriter reuses its buffers).

    python bench/dcp_bench.py                 # 256 MiB, CI-sized
    python bench/dcp_bench.py --mib 4096 --repeats 5 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tierckpt.dcp import RamdiskReader, RamdiskWriter


def make_state(total_mib: int, small: int) -> dict[str, Any]:
    """``small`` 16 KiB tensors plus 8 large ones making up the rest of ``total_mib``."""
    small_bytes = 16 << 10
    large = max(1, ((total_mib << 20) - small * small_bytes) // 8 // 4)
    state: dict[str, Any] = {f"large.{i}": torch.randn(large) for i in range(8)}
    state.update({f"small.{i}": torch.randn(small_bytes // 4) for i in range(small)})
    state["meta"] = {"step": 1, "note": "bench"}
    return state


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else {"step": 0, "note": ""}
        for k, v in state.items()
    }


def nbytes(state: dict[str, Any]) -> int:
    return sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor))


WARMUP = 3
"""Untimed saves first: steady state, where RamdiskWriter (keep=2) writes into recycled, pre-faulted files."""


def median_time(fn: Callable[[int], Any], repeats: int, first_step: int) -> float:
    for i in range(WARMUP):
        fn(first_step + i)
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        fn(first_step + WARMUP + i)
        times.append(time.perf_counter() - t0)
    return min(times)


def floor(state: dict[str, Any]) -> float:
    src = [v for v in state.values() if isinstance(v, torch.Tensor)]
    dst = [torch.empty_like(t) for t in src]
    torch._foreach_copy_(dst, src)  # fault the pages first
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


class Method:
    """One storage plugin pair: how to make a writer for a step and a reader for it."""

    def __init__(self, name: str, root: Path) -> None:
        self.name, self.root = name, root
        self.writer = RamdiskWriter(root, "bench", keep=2) if name == "ramdisk" else None

    def target(self, step: int) -> dict[str, Any]:
        """``checkpoint_id`` and ``storage_writer`` arguments for saving ``step``."""
        if self.writer is not None:
            return {"checkpoint_id": step, "storage_writer": self.writer}
        shutil.rmtree(self.root / "fs" / f"step-{step - 2}", ignore_errors=True)  # keep two, like the ramdisk
        path = self.root / "fs" / f"step-{step}"
        return {"checkpoint_id": path, "storage_writer": FileSystemWriter(path)}

    def source(self, step: int) -> dict[str, Any]:
        if self.writer is not None:
            return {"checkpoint_id": step, "storage_reader": RamdiskReader(self.root, "bench")}
        path = self.root / "fs" / f"step-{step}"
        return {"checkpoint_id": path, "storage_reader": FileSystemReader(path)}

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def measure(method: Method, state: dict[str, Any], repeats: int) -> dict[str, float]:
    def save(step: int) -> None:
        dcp.save(state, **method.target(step), no_dist=True)

    blocked: list[float] = []

    def async_save(step: int) -> None:
        t0 = time.perf_counter()
        fut = dcp.async_save(state, **method.target(step), no_dist=True)
        blocked.append(time.perf_counter() - t0)
        getattr(fut, "upload_completion", fut).result()

    out = {"save_s": median_time(save, repeats, 100)}
    out["async_durable_s"] = median_time(async_save, repeats, 200)
    out["async_blocked_s"] = min(blocked[WARMUP:])
    last = 200 + WARMUP + repeats - 1
    dest = blank(state)
    out["load_s"] = median_time(lambda _: dcp.load(dest, **method.source(last), no_dist=True), repeats, 0)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(dest[k], v), f"{method.name}: {k} did not load back"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB (default 256)")
    parser.add_argument("--small", type=int, default=1024, help="number of small (16 KiB) tensors")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (best of)")
    parser.add_argument("--dir", default="/dev/shm", help="tmpfs directory to write under (default /dev/shm)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    state = make_state(args.mib, args.small)
    size = nbytes(state)
    gc.collect()
    gc.freeze()  # like a long-running trainer: long-lived objects stop costing full collections
    root = Path(tempfile.mkdtemp(prefix="tierckpt-dcp-bench-", dir=args.dir))
    results: dict[str, dict[str, float]] = {}
    try:
        for name in ("filesystem", "ramdisk"):
            method = Method(name, root)
            try:
                results[name] = measure(method, state, args.repeats)
            finally:
                method.close()
        floor_s = floor(state)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(results, size, floor_s, args)


def report(results: dict[str, dict[str, float]], size: int, floor_s: float, args: argparse.Namespace) -> None:
    fs, rd = results["filesystem"], results["ramdisk"]
    ratios = {k.removesuffix("_s"): fs[k] / rd[k] for k in rd}
    out = {
        "bench": "dcp",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
        "bytes": size,
        "tensors": 8 + args.small,
        "repeats": args.repeats,
        "memcpy_floor_s": floor_s,
        "filesystem_writer": fs,
        "ramdisk_writer": rd,
        "speedup_vs_filesystem_writer": ratios,
        "ramdisk_save_vs_floor": rd["save_s"] / floor_s,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    gb = size / 1e9
    print(
        f"DCP bench: {size / 2**20:.0f} MiB in {out['tensors']} tensors, best of {args.repeats}; "
        f"{out['machine']}"
    )
    print(f"{'metric':<16}{'FileSystemWriter':>18}{'RamdiskWriter':>16}{'speedup':>10}")
    for k in rd:
        print(
            f"{k.removesuffix('_s'):<16}{fs[k]:>15.3f} s{rd[k]:>13.3f} s{ratios[k.removesuffix('_s')]:>9.2f}x"
        )
    print(
        f"memcpy floor: {floor_s:.3f} s ({gb / floor_s:.1f} GB/s); "
        f"RamdiskWriter save = {out['ramdisk_save_vs_floor']:.1f}x floor ({gb / rd['save_s']:.2f} GB/s)"
    )


if __name__ == "__main__":
    main()
