"""Benchmark the tierckpt client's tier 1 (node ramdisk) against the floor and against torch.save and DCP.

Everything is measured in the same run, on the same state, into the same tmpfs directory:

* the floor: on CPU one copy (torch ``copy_``) of the whole state as one buffer into an already-faulted
  mapping of a tmpfs file; on GPU one large pinned device-to-host and host-to-device copy. Every steady
  save and warm restore is paired with a floor copy just before it, and the median ratio is reported
  (robust on a shared, noisy machine);
* tierckpt ``Checkpointer``: the first save (pays the one-time pre-fault / registration), the warm-up
  saves, steady-state saves (median; blocking time and time until committed), restore (warm: files
  already mapped by this process; cold: a new Checkpointer maps them);
* ``torch.save`` / ``torch.load`` to the same tmpfs;
* DCP ``save`` and ``async_save`` (defaults) with ``FileSystemWriter`` to the same tmpfs.

The state is a realistic mix: a model of a few large bf16 matrices and many small fp32 vectors, plus
Adam's fp32 ``exp_avg``/``exp_avg_sq`` and step counters (about 2,000 tensors).

Run from the repository root: ``PYTHONPATH=client python bench/client_bench.py [--device cuda]``.
Peak tmpfs use is about ``(keep + 2) x size`` (the slots and the floor mapping); host memory also holds
the state (CPU) or a pinned floor buffer (GPU). Use ``--keep 1`` for the largest sizes.
Only torch, numpy and google-crc32c are needed besides the ``tierckpt`` sources.

Two more modes:

* ``--train``: a training loop saving every N steps (``bench/client_train.py``): overhead against no
  checkpoints for plain, overlap and device-staged saves and DCP ``async_save``, the blocking time of
  every save from a cold start; ``--check`` verifies every saved step byte for byte instead of timing.
* ``--prefault``: the one-time cost of a slot per GiB (pre-fault, ``cudaHostRegister``), a restarted
  writer's re-mapping of existing pages, a save's D2H into the mapping, and ``Checkpointer`` first and
  steady saves, on a tmpfs mounted ``huge=never`` and one mounted ``huge=within_size`` (needs root;
  ``tierckpt_demo`` on the path for the mounts).
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


class CpuFloor:
    """A pre-faulted mapping of a tmpfs file and a source buffer: one copy in (write) or out (read)."""

    def __init__(self, nbytes: int, directory: Path) -> None:
        self._fd = os.open(directory / "floor.bin", os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(self._fd, 0, nbytes)
        self._mm = mmap.mmap(self._fd, nbytes)
        with contextlib.suppress(OSError):
            self._mm.madvise(getattr(mmap, "MADV_POPULATE_WRITE", 23))
        self.dst = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        self.dst.copy_(self.src)  # every page faulted once, whatever the kernel

    def write(self) -> float:
        """One ``copy_`` of the whole buffer into the mapping (torch's parallel memcpy: on an idle
        machine it beats a single-threaded ``memcpy``/``np.copyto``, so it is the stricter floor)."""
        return timed(lambda: self.dst.copy_(self.src), "cpu")[0]

    def read(self) -> float:
        return timed(lambda: self.src.copy_(self.dst), "cpu")[0]

    def close(self) -> None:
        del self.dst, self.src
        gc.collect()
        self._mm.close()
        os.close(self._fd)


class GpuFloor:
    """A device buffer and a pinned host buffer: one large D2H (write) or H2D (read) copy."""

    def __init__(self, nbytes: int, directory: Path) -> None:
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(7)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host.copy_(self.dev)

    def write(self) -> float:
        return timed(lambda: self.host.copy_(self.dev, non_blocking=True), "cuda")[0]

    def read(self) -> float:
        return timed(lambda: self.dev.copy_(self.host, non_blocking=True), "cuda")[0]

    def close(self) -> None:
        del self.dev, self.host
        gc.collect()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- systems


def bench_tierckpt(
    state: dict[str, Any],
    root: Path,
    device: str,
    repeats: int,
    keep: int,
    floor: CpuFloor | GpuFloor,
    baseline: Callable[[], float] | None = None,
) -> dict[str, Any]:
    """Saves and restores. Each steady save is paired with a floor copy just before it and, if given,
    a ``baseline`` save (e.g. ``torch.save``) just after it; each warm restore with a floor read."""
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
            out["warmup_blocking_s"] = [save(step)[0] for step in range(1, keep + 2)]
            pairs, ratios = [], []
            for step in range(keep + 2, keep + 2 + repeats):
                pairs.append((floor.write(), *save(step)))
                if baseline is not None:
                    ratios.append(baseline() / pairs[-1][1])
            if ratios:
                out["baseline_vs_steady"] = median(ratios)
            out["steady_blocking_s"] = median([b for _, b, _ in pairs])
            out["steady_committed_s"] = median([c for _, _, c in pairs])
            out["steady_blocking_all_s"] = [b for _, b, _ in pairs]
            out["steady_vs_floor"] = median([b / f for f, b, _ in pairs])
            out["paired_floor_write_s"] = median([f for f, _, _ in pairs])
            pairs = [(floor.read(), timed(lambda: ck.load(state), device)[0]) for _ in range(repeats)]
            out["restore_warm_s"] = median([r for _, r in pairs])
            out["restore_vs_floor"] = median([r / f for f, r in pairs])
            out["paired_floor_read_s"] = median([f for f, _ in pairs])
            out["restore_warm_phases"] = _rounded(ck.last_load_timings)
            if os.environ.get("PROFILE_LOAD"):  # where a warm load's CPU time goes (20 loads)
                import cProfile
                import io
                import pstats

                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(20):
                    timed(lambda: ck.load(state), device)
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
                out["load_profile"] = text.getvalue()
            restore = [timed(lambda: ck.load(state, verify=False), device)[0] for _ in range(repeats)]
            out["restore_warm_noverify_s"] = median(restore)
            out["device_staging_bytes"] = ck.device_staging_bytes
        start = time.perf_counter()
        with Checkpointer(root=d, job="bench", rank=0, world_size=1, keep=keep) as ck:
            out["cold_open_s"] = time.perf_counter() - start
            out["restore_cold_s"] = timed(lambda: ck.load(state), device)[0]
            out["restore_cold_phases"] = _rounded(ck.last_load_timings)
            out["restore_cold_vs_floor"] = out["restore_cold_s"] / out["paired_floor_read_s"]
            if ck._registering is not None:  # background pinning after a cold load (not on the restore path)
                out["cold_background_register_s"] = timed(ck._registering.result, "cpu")[0]
    return out


def _rounded(phases: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 5) for k, v in phases.items()}


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


def torch_save_once(state: dict[str, Any], directory: Path) -> Callable[[], float]:
    """A ``torch.save`` of ``state`` into ``directory`` (file removed afterwards), timed."""

    def run() -> float:
        path = directory / "paired.pt"
        seconds = timed(lambda: torch.save(state, path), "cpu")[0]
        path.unlink()
        return seconds

    return run


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


# ------------------------------------------------------------------------------------------- huge pages


def _meminfo(*names: str) -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in names:
                out[key] = int(value.split()[0]) << 10
    return out


def bench_prefault(root: Path, gib: float, device: str, repeats: int) -> dict[str, Any]:
    """Per tmpfs ``huge=`` option: pre-fault, registration, re-mapping after a restart, D2H/H2D into the
    mapping, and ``Checkpointer`` first/steady save blocking for a state of ``gib``."""
    from tierckpt_demo.tmpfs import mount_tmpfs, unmount

    out: dict[str, Any] = {"bytes": int(gib * GIB)}
    with contextlib.suppress(OSError):
        out["shmem_enabled"] = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text().strip()
    for huge in ("never", "within_size"):
        mount = mount_tmpfs(root / f"huge-{huge}", f"{int(4 * gib) + 4}g", huge=huge)
        try:
            r = _prefault_one(mount, gib, device, repeats)
        except (OSError, RuntimeError) as exc:
            r = {"error": repr(exc)}
        finally:
            shutil.rmtree(mount, ignore_errors=True)
            unmount(mount)
        out[huge] = {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
    return out


def _prefault_one(mount: Path, gib: float, device: str, repeats: int) -> dict[str, Any]:
    from tierckpt import Checkpointer
    from tierckpt.snapshot.shardfile import MappedFile

    nbytes = int(gib * GIB)
    cuda = device == "cuda"
    index = torch.cuda.current_device() if cuda else None
    r: dict[str, Any] = {}
    path = mount / "slot.bin"
    start = time.perf_counter()
    f = MappedFile.create(path, nbytes)
    r["fault_s_per_gib"] = (time.perf_counter() - start) / gib
    r["shmem_huge_bytes"] = _meminfo("ShmemHugePages").get("ShmemHugePages", 0)
    if cuda:
        start = time.perf_counter()
        r["registered"] = f.register(index)
        r["register_s_per_gib"] = (time.perf_counter() - start) / gib
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(3)
        host = f.buffer
        d2h = [timed(lambda: host.copy_(src, non_blocking=True), device)[0] for _ in range(repeats)]
        h2d = [timed(lambda: src.copy_(host, non_blocking=True), device)[0] for _ in range(repeats)]
        r["d2h_gbps"] = nbytes / median(d2h) / 1e9
        r["h2d_gbps"] = nbytes / median(h2d) / 1e9
        del src, host
    f.close()
    start = time.perf_counter()  # a restarted writer adopts the file: its pages exist
    f = MappedFile.open(path, populate=False)
    f.populate()
    r["remap_s_per_gib"] = (time.perf_counter() - start) / gib
    if cuda:
        start = time.perf_counter()
        f.register(index)
        r["reregister_s_per_gib"] = (time.perf_counter() - start) / gib
    f.close(unlink=True)
    state = build_state(nbytes, device)
    with Checkpointer(root=mount / "ck", job="bench", rank=0, world_size=1, keep=2) as ck:
        start = time.perf_counter()
        ck.save(0, state).wait()
        r["first_save_s"] = time.perf_counter() - start
        start = time.perf_counter()
        if ck._registering is not None:
            ck._registering.result()
        r["spares_ready_s"] = time.perf_counter() - start
        r["warm_up_slot"] = dict(ck._pool.last_warm_up)
        steady = []
        for step in range(1, 2 + repeats):
            sync(device)
            start = time.perf_counter()
            handle = ck.save(step, state)
            steady.append(time.perf_counter() - start)
            handle.wait()
        r["steady_save_s"] = median(steady[1:])
    return r


# ------------------------------------------------------------------------------------------- report


def verdicts(r: dict[str, Any], device: str) -> list[dict[str, Any]]:
    """Ratios against the targets; floor ratios pair each measurement with a floor copy just before it."""
    t = r["tierckpt"]
    checks = []

    def check(name: str, value: float, target: str, ok: bool) -> None:
        checks.append({"check": name, "value": round(value, 3), "target": target, "pass": bool(ok)})

    blocking = t["steady_blocking_s"]
    if device == "cpu":
        check("steady blocking / memcpy floor", t["steady_vs_floor"], "<= 1.3", t["steady_vs_floor"] <= 1.3)
        if "baseline_vs_steady" in t:
            speedup = t["baseline_vs_steady"]
            check("torch.save / steady blocking", speedup, ">= 5", speedup >= 5)
        check("warm restore / memcpy floor (read)", t["restore_vs_floor"], "(no target)", True)
    else:
        limit = 1.15 * t["paired_floor_write_s"] + 0.010
        check(
            "steady blocking (s) vs 1.15 x D2H floor + 10 ms", blocking, f"<= {limit:.3f}", blocking <= limit
        )
        if "dcp" in r:
            speedup = r["dcp"]["async_blocking_s"] / blocking
            check("DCP async_save blocking / steady blocking", speedup, ">= 20", speedup >= 20)
        check("warm restore / H2D floor", t["restore_vs_floor"], "<= 1.2", t["restore_vs_floor"] <= 1.2)
        cold = t["restore_cold_vs_floor"]
        check("cold restore (new process, verified) / H2D floor", cold, "(no target)", True)
    return checks


def print_report(r: dict[str, Any]) -> None:
    nbytes = r["bytes"]

    def row(name: str, seconds: float) -> None:
        print(f"  {name:<44} {seconds:9.3f} s  {nbytes / seconds / 1e9:7.2f} GB/s")

    print(f"state: {nbytes / GIB:.2f} GiB in {r['tensors']} tensors on {r['device']} ({r['machine']})")
    print("floor:")
    row("write (one copy into the mapping / D2H)", r["floor"]["write_s"])
    row("read (one copy out of the mapping / H2D)", r["floor"]["read_s"])
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
    for name in ("restore_warm_phases", "restore_cold_phases"):
        phases = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f}" for k, v in t.get(name, {}).items())
        print(f"  {name.replace('_', ' ') + ' (ms)':<44} {phases}")
    if t.get("device_staging_bytes"):
        staged = t["device_staging_bytes"] / 2**20
        print(f"  {'device staging for packed small tensors':<44} {staged:.1f} MiB")
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
    p.add_argument("--train", action="store_true", help="training-loop mode (bench/client_train.py)")
    p.add_argument("--check", action="store_true", help="with --train: verify every saved step, no timings")
    p.add_argument("--layers", type=int, default=18, help="with --train: transformer blocks (18: ~0.94 B)")
    p.add_argument("--every", default="10,100", help="with --train: save every N steps, comma-separated")
    p.add_argument("--steps", default="60,100", help="with --train: timed steps for each N")
    p.add_argument(
        "--dcp-steps", default="20,0", help="with --train: timed steps of the DCP run per N (0: none)"
    )
    p.add_argument("--modes", default="plain,overlap,device,dcp", help="with --train: savers to run")
    p.add_argument("--budget", default="0.5", help="with --train: device_budget (fraction, or bytes)")
    p.add_argument(
        "--prefault", action="store_true", help="pre-fault/registration with and without huge pages"
    )
    p.add_argument("--freeze-gc", action="store_true", help="with --train: gc.freeze() after the set-up")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device")
    base = args.root or Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    root = Path(tempfile.mkdtemp(prefix="tierckpt-bench-", dir=base))
    if args.train or args.prefault:
        try:
            r = _extra_mode(args, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        json.dump(r, sys.stdout, indent=1)
        print()
        return 0
    try:
        state = build_state(int(args.size_gib * GIB), args.device)
        nbytes = state_bytes(state)
        machine = f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
        if args.device == "cuda":
            machine += f", {torch.cuda.get_device_name()}"
        r: dict[str, Any] = {"device": args.device, "bytes": nbytes, "tensors": count_tensors(state)}
        r["machine"], r["repeats"], r["keep"] = machine, args.repeats, args.keep
        if not args.skip_torch_save:
            r["torch_save"] = bench_torch_save(state, root, args.device, min(args.repeats, 2))
        if not args.skip_dcp:
            r["dcp"] = bench_dcp(state, root, args.device, min(args.repeats, 2))
        with scratch(root, "floor") as d:
            floor = (CpuFloor if args.device == "cpu" else GpuFloor)(nbytes, d)
            try:
                writes = [floor.write() for _ in range(args.repeats)]
                reads = [floor.read() for _ in range(args.repeats)]
                r["floor"] = {"write_s": median(writes), "read_s": median(reads)}
                baseline = None if args.skip_torch_save or args.device != "cpu" else torch_save_once(state, d)
                r["tierckpt"] = bench_tierckpt(
                    state, root, args.device, args.repeats, args.keep, floor, baseline
                )
            finally:
                floor.close()
        r["checks"] = verdicts(r, args.device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        json.dump(r, sys.stdout, indent=2)
        print()
    else:
        print_report(r)
    return 0


def _extra_mode(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    if args.device == "cuda":
        machine += f", {torch.cuda.get_device_name()}"
    if args.prefault:
        return {
            "machine": machine,
            "prefault": bench_prefault(root, args.size_gib, args.device, args.repeats),
        }
    sys.path.insert(0, str(Path(__file__).parent))
    from client_train import ModelSpec, bench_training

    everies = tuple(int(x) for x in args.every.split(","))
    steps = dict(zip(everies, (int(x) for x in args.steps.split(",")), strict=True))
    dcp_steps = dict(zip(everies, (int(x) for x in args.dcp_steps.split(",")), strict=True))
    budget = float(args.budget) if "." in args.budget else int(args.budget)
    spec = ModelSpec(layers=args.layers)
    if args.device == "cpu":  # a toy size: the CPU mode only checks that the loop runs
        spec = ModelSpec(width=64, layers=args.layers, heads=4, vocab=256, seq=32, batch=2)
    r = bench_training(
        root,
        spec,
        args.device,
        everies=everies,
        steps=steps,
        dcp_steps=dcp_steps,
        modes=tuple(args.modes.split(",")),
        budget=budget,
        check=args.check,
        freeze_gc=args.freeze_gc,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    r["machine"] = machine
    return r


if __name__ == "__main__":
    sys.exit(main())
