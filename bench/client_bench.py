"""Benchmark the tierckpt client's tier 1 (node ramdisk) against the floor and against torch.save and DCP.

Everything is measured in the same run, on the same state, into the same tmpfs directory:

* the floor: on CPU one copy into an already-faulted mapping of a tmpfs file (torch ``copy_`` and
  numpy ``copyto``, the faster counts); on GPU one large pinned device-to-host and host-to-device copy;
* tierckpt ``Checkpointer``: the first save (pays the one-time pre-fault / registration), the warm-up
  saves, steady-state saves (median; blocking time and time until committed), restore (warm: files
  already mapped by this process; cold: a new Checkpointer maps them);
* ``torch.save`` / ``torch.load`` to the same tmpfs;
* DCP ``save`` and ``async_save`` (defaults) with ``FileSystemWriter`` to the same tmpfs.

The state is a realistic mix: a model of a few large bf16 matrices and many small fp32 vectors, plus
Adam's fp32 ``exp_avg``/``exp_avg_sq`` and step counters (about 2,000 tensors).

Run from the repository root: ``PYTHONPATH=client python bench/client_bench.py [--device cuda]``.
Peak tmpfs use is about ``(keep + 1) x size``; host memory needs the state (CPU) or a pinned copy (GPU).
Only torch, numpy and google-crc32c are needed besides the ``tierckpt`` sources.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

GIB = 1 << 30


# ------------------------------------------------------------------------------------------- state


def build_state(total_bytes: int, device: str, *, n_large: int = 8, n_small: int = 512) -> dict[str, Any]:
    """Model (bf16 large + fp32 small parameters) plus Adam state, about ``total_bytes`` in all."""
    small_numel = 4096
    small_bytes = n_small * small_numel * 4 * 3  # param + exp_avg + exp_avg_sq
    large_numel = max(1, (total_bytes - small_bytes) // (n_large * 10))  # bf16 param + 2 fp32 states
    model: dict[str, torch.Tensor] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}

    def param(name: str, numel: int, dtype: torch.dtype) -> None:
        index = len(model)
        model[name] = torch.empty(numel, dtype=dtype, device=device).fill_(0.5)
        state[index] = {
            "step": torch.tensor(float(index)),
            "exp_avg": torch.empty(numel, dtype=torch.float32, device=device).fill_(0.25),
            "exp_avg_sq": torch.empty(numel, dtype=torch.float32, device=device).fill_(0.125),
        }

    for i in range(n_large):
        param(f"layers.{i}.weight", large_numel, torch.bfloat16)
    for i in range(n_small):
        param(f"layers.{i}.norm.weight", small_numel, torch.float32)
    groups = [{"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(state)}]
    return {"model": model, "optim": {"state": state, "param_groups": groups}, "step": 1000}


def state_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    return 0


def count_tensors(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return 1
    if isinstance(state, dict):
        return sum(count_tensors(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(count_tensors(v) for v in state)
    return 0


# ------------------------------------------------------------------------------------------- timing


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@contextlib.contextmanager
def scratch(root: Path, name: str) -> Iterator[Path]:
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        gc.collect()


# ------------------------------------------------------------------------------------------- floors


def _copy_times(dst: torch.Tensor, src: torch.Tensor, repeats: int) -> dict[str, float]:
    dst.copy_(src)  # fault everything once, whatever the kernel
    dst_np, src_np = dst.numpy(), src.numpy()
    torch_copy = [timed(lambda: dst.copy_(src), "cpu")[0] for _ in range(repeats)]
    np_copy = [timed(lambda: np.copyto(dst_np, src_np), "cpu")[0] for _ in range(repeats)]
    read = [timed(lambda: src.copy_(dst), "cpu")[0] for _ in range(repeats)]
    return {
        "torch_copy_s": median(torch_copy),
        "numpy_copyto_s": median(np_copy),
        "write_s": min(median(torch_copy), median(np_copy)),
        "read_s": median(read),
    }


def cpu_floor(nbytes: int, root: Path, repeats: int) -> dict[str, float]:
    """One copy of ``nbytes`` into a pre-faulted mapping of a tmpfs file (and out of it)."""
    with scratch(root, "floor") as d:
        fd = os.open(d / "floor.bin", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes)
            with contextlib.suppress(OSError):
                mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
            out = _copy_times(
                torch.frombuffer(mm, dtype=torch.uint8),
                torch.empty(nbytes, dtype=torch.uint8).fill_(7),
                repeats,
            )
            gc.collect()
            mm.close()
        finally:
            os.close(fd)
    return out


def _transfer_times(dev: torch.Tensor, host: torch.Tensor, repeats: int) -> dict[str, float]:
    host.copy_(dev)
    d2h = [timed(lambda: host.copy_(dev, non_blocking=True), "cuda")[0] for _ in range(repeats)]
    h2d = [timed(lambda: dev.copy_(host, non_blocking=True), "cuda")[0] for _ in range(repeats)]
    return {"d2h_s": median(d2h), "h2d_s": median(h2d)}


def gpu_floor(nbytes: int, repeats: int) -> dict[str, float]:
    """One large pinned device-to-host and host-to-device copy of ``nbytes``."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
    out = _transfer_times(dev, torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), repeats)
    gc.collect()
    torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------------------------------- systems


def bench_tierckpt(state: dict[str, Any], root: Path, device: str, repeats: int, keep: int) -> dict[str, Any]:
    from tierckpt import Checkpointer

    out: dict[str, Any] = {}
    with scratch(root, "tierckpt") as d:
        with Checkpointer(root=d, job="bench", rank=0, world_size=1, keep=keep) as ck:

            def save(step: int) -> tuple[float, float]:
                sync(device)
                start = time.perf_counter()
                handle = ck.save(step, state)
                blocking = time.perf_counter() - start
                handle.wait()
                return blocking, time.perf_counter() - start

            out["first_blocking_s"], out["first_committed_s"] = save(0)
            warm = [save(step) for step in range(1, keep + 2)]
            out["warmup_blocking_s"] = [b for b, _ in warm]
            steady = [save(step) for step in range(keep + 2, keep + 2 + repeats)]
            out["steady_blocking_s"] = median([b for b, _ in steady])
            out["steady_committed_s"] = median([c for _, c in steady])
            out["steady_blocking_all_s"] = [b for b, _ in steady]
            restore = [timed(lambda: ck.load(state), device)[0] for _ in range(repeats)]
            out["restore_warm_s"] = median(restore)
            restore = [timed(lambda: ck.load(state, verify=False), device)[0] for _ in range(repeats)]
            out["restore_warm_noverify_s"] = median(restore)
        with Checkpointer(root=d, job="bench", rank=0, world_size=1, keep=keep) as ck:
            out["restore_cold_s"] = timed(lambda: ck.load(state), device)[0]
    return out


def bench_torch_save(state: dict[str, Any], root: Path, device: str, repeats: int) -> dict[str, Any]:
    saves, loads = [], []
    with scratch(root, "torch-save") as d:
        for i in range(repeats):
            path = d / f"state-{i}.pt"
            saves.append(timed(lambda p=path: torch.save(state, p), device)[0])
            loads.append(
                timed(lambda p=path: torch.load(p, map_location=device, weights_only=True), device)[0]
            )
            path.unlink()
    return {"save_s": median(saves), "load_s": median(loads)}


def bench_dcp(state: dict[str, Any], root: Path, device: str, repeats: int) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    saves, async_blocking, async_done, loads = [], [], [], []
    with warnings.catch_warnings(), scratch(root, "dcp") as d:
        warnings.simplefilter("ignore")
        for i in range(repeats):
            path = d / f"sync-{i}"
            saves.append(timed(lambda p=path: dcp.save(state, storage_writer=FileSystemWriter(p)), device)[0])
            loads.append(timed(lambda p=path: dcp.load(state, storage_reader=FileSystemReader(p)), device)[0])
            shutil.rmtree(path)
            path = d / f"async-{i}"
            sync(device)
            start = time.perf_counter()
            future = dcp.async_save(state, storage_writer=FileSystemWriter(path))
            async_blocking.append(time.perf_counter() - start)
            (future.result() if hasattr(future, "result") else future.upload_completion.result())
            async_done.append(time.perf_counter() - start)
            shutil.rmtree(path)
    return {
        "save_s": median(saves),
        "load_s": median(loads),
        "async_blocking_s": median(async_blocking),
        "async_done_s": median(async_done),
    }


# ------------------------------------------------------------------------------------------- report


def verdicts(r: dict[str, Any], device: str) -> list[dict[str, Any]]:
    t, floor = r["tierckpt"], r["floor"]
    checks = []

    def check(name: str, value: float, target: str, ok: bool) -> None:
        checks.append({"check": name, "value": round(value, 3), "target": target, "pass": bool(ok)})

    blocking = t["steady_blocking_s"]
    if device == "cpu":
        ratio = blocking / floor["write_s"]
        check("steady blocking / memcpy floor", ratio, "<= 1.3", ratio <= 1.3)
        if "torch_save" in r:
            speedup = r["torch_save"]["save_s"] / blocking
            check("torch.save / steady blocking", speedup, ">= 5", speedup >= 5)
        check(
            "warm restore / memcpy floor (read)", t["restore_warm_s"] / floor["read_s"], "(no target)", True
        )
    else:
        limit = 1.15 * floor["d2h_s"] + 0.010
        check(
            "steady blocking vs 1.15 x D2H floor + 10 ms (s)", blocking, f"<= {limit:.3f}", blocking <= limit
        )
        if "dcp" in r:
            speedup = r["dcp"]["async_blocking_s"] / blocking
            check("DCP async_save blocking / steady blocking", speedup, ">= 20", speedup >= 20)
        ratio = t["restore_warm_s"] / floor["h2d_s"]
        check("warm restore / H2D floor", ratio, "<= 1.2", ratio <= 1.2)
    return checks


def print_report(r: dict[str, Any]) -> None:
    nbytes = r["bytes"]

    def row(name: str, seconds: float) -> None:
        print(f"  {name:<44} {seconds:9.3f} s  {nbytes / seconds / 1e9:7.2f} GB/s")

    print(f"state: {nbytes / GIB:.2f} GiB in {r['tensors']} tensors on {r['device']} ({r['machine']})")
    print("floor:")
    for k, v in r["floor"].items():
        row(k, v)
    t = r["tierckpt"]
    print("tierckpt:")
    row("first save, blocking (pre-fault/register)", t["first_blocking_s"])
    row("first save, committed", t["first_committed_s"])
    print(f"  {'warm-up saves, blocking':<44} {', '.join(f'{x:.3f}' for x in t['warmup_blocking_s'])} s")
    row("steady save, blocking (median)", t["steady_blocking_s"])
    row("steady save, committed (median)", t["steady_committed_s"])
    row("restore, warm (verified)", t["restore_warm_s"])
    row("restore, warm (verify=False)", t["restore_warm_noverify_s"])
    row("restore, cold (new Checkpointer, verified)", t["restore_cold_s"])
    if "torch_save" in r:
        print("torch.save / torch.load:")
        row("torch.save", r["torch_save"]["save_s"])
        row("torch.load", r["torch_save"]["load_s"])
    if "dcp" in r:
        print("DCP FileSystemWriter:")
        row("dcp.save", r["dcp"]["save_s"])
        row("dcp.async_save, blocking", r["dcp"]["async_blocking_s"])
        row("dcp.async_save, done", r["dcp"]["async_done_s"])
        row("dcp.load", r["dcp"]["load_s"])
    print("targets:")
    for c in r["checks"]:
        print(f"  {c['check']:<50} {c['value']:>9} (target {c['target']})  {'PASS' if c['pass'] else 'MISS'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--size-gib", type=float, default=1.0, help="state size in GiB (default 1; try 4 or 16)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the state lives")
    p.add_argument("--repeats", type=int, default=3, help="measured repetitions per figure (median)")
    p.add_argument("--keep", type=int, default=2, help="Checkpointer keep (the pool holds keep + 1 slots)")
    p.add_argument("--root", type=Path, default=None, help="tmpfs directory to write into (default /dev/shm)")
    p.add_argument("--skip-torch-save", action="store_true", help="skip the torch.save/torch.load baseline")
    p.add_argument("--skip-dcp", action="store_true", help="skip the DCP baselines")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    base = args.root or Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="tierckpt-bench-", dir=base))
    try:
        state = build_state(int(args.size_gib * GIB), args.device)
        nbytes = state_bytes(state)
        machine = f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
        if args.device == "cuda":
            machine += f", {torch.cuda.get_device_name()}"
        r: dict[str, Any] = {"device": args.device, "bytes": nbytes, "tensors": count_tensors(state)}
        r["machine"], r["repeats"], r["keep"] = machine, args.repeats, args.keep
        r["floor"] = (
            cpu_floor(nbytes, root, args.repeats) if args.device == "cpu" else gpu_floor(nbytes, args.repeats)
        )
        if not args.skip_torch_save:
            r["torch_save"] = bench_torch_save(state, root, args.device, min(args.repeats, 2))
        if not args.skip_dcp:
            r["dcp"] = bench_dcp(state, root, args.device, min(args.repeats, 2))
        r["tierckpt"] = bench_tierckpt(state, root, args.device, args.repeats, args.keep)
        r["checks"] = verdicts(r, args.device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
    else:
        print_report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
