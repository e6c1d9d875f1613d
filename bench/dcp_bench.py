"""DCP on the ramdisk: ``RamdiskWriter``/``RamdiskReader`` against DCP's ``FileSystemWriter``/``Reader`` on
the same tmpfs, and against the native ``Checkpointer`` for the same bytes.

Two modes:

* one process (default): the same state (8 large tensors plus many 16 KiB ones) through
  ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` with each writer, and through ``Checkpointer``;
  ``--device cuda`` keeps the state on the GPU;
* ``--fsdp``, under ``torchrun``: an FSDP2 model with Adam state sharded over the ranks (NCCL with
  ``--device cuda``, a gloo group for the saves), each method timed on every rank, the slowest rank
  reported. ``bench/device_dcp.sh`` runs it on 2 GPUs.

Measured per method, best of the repeats after untimed warm-up saves (steady state: ``RamdiskWriter`` and
``Checkpointer`` write into recycled, pre-faulted and pinned files, and from its second save on
``RamdiskWriter`` stages ``async_save`` straight into them; ``FileSystemWriter`` keeps its pinned staging
copy with ``cache_staged_state_dict=True`` where CUDA is (it cannot pin without it), and always writes new
files):

* ``save``: ``dcp.save`` (blocking = durable);
* ``async_blocked`` / ``async_durable``: ``dcp.async_save`` until it returns / until its future is done;
  for ``Checkpointer``: ``save`` until it returns / until its handle is committed;
* ``load``: ``dcp.load`` into the live state (``Checkpointer.load`` in place);
* ``floor``: one copy of the same bytes into pre-faulted (pinned, for CUDA) host memory.

The headline ratio is ``async_blocked`` of ``RamdiskWriter`` over ``Checkpointer``'s blocking save for the
same bytes (target: at most 1.2).

    python bench/dcp_bench.py                          # 256 MiB on the CPU
    python bench/dcp_bench.py --mib 4096 --device cuda --json
    torchrun --nproc-per-node 2 bench/dcp_bench.py --fsdp --device cuda --mib 4096 --json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import json
import os
import platform
import pstats
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from tierckpt import Checkpointer
from tierckpt.dcp import RamdiskReader, RamdiskWriter

WARMUP = 3
METHODS = ("filesystem", "ramdisk", "native")


# ------------------------------------------------------------------------------------- states


def plain_state(total_mib: int, small: int, device: str) -> dict[str, Any]:
    """``small`` 16 KiB tensors plus 8 large ones making up the rest of ``total_mib``, nested like a
    trainer's state (DCP's ``async_save`` spends about 30 us per top-level key in its own logging)."""
    small_bytes = 16 << 10
    large = max(1, ((total_mib << 20) - small * small_bytes) // 8 // 4)
    model: dict[str, Any] = {f"large.{i}": torch.randn(large, device=device) for i in range(8)}
    model.update({f"small.{i}": torch.randn(small_bytes // 4, device=device) for i in range(small)})
    return {"model": model, "meta": {"step": 1, "note": "bench"}}


def fsdp_state(total_mib: int, device: str) -> tuple[dict[str, Any], torch.nn.Module]:
    """An FSDP2 MLP whose weights plus Adam's two moments make about ``total_mib`` MiB, all ranks together."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hidden = 2048
    layers = max(1, round((total_mib << 20) / 3 / 4 / (hidden * hidden + hidden)))
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(hidden, hidden) for _ in range(layers))).to(device)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, hidden, device=device)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}, model


def local_tensors(value: Any) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return [value._local_tensor]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in local_tensors(v)]
    if isinstance(value, list):
        return [t for v in value for t in local_tensors(v)]
    return []


def floor(state: dict[str, Any]) -> float:
    src = local_tensors(state)
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in src]
    best = float("inf")
    for _ in range(4):  # the first pass faults the pages
        sync(state)
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, src)
        sync(state)
        best = min(best, time.perf_counter() - t0)
    return best


def sync(state: dict[str, Any]) -> None:
    if any(t.is_cuda for t in local_tensors(state)):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------- methods


class Method:
    """One way to checkpoint the state; ``save``/``async_save``/``load`` time themselves."""

    def __init__(self, name: str, root: Path, state: dict[str, Any], group: Any) -> None:
        self.name, self.root, self.state, self.group = name, root, state, group
        self.no_dist = not dist.is_initialized()
        self.writer = RamdiskWriter(root, "bench", keep=2) if name == "ramdisk" else None
        self.native = Checkpointer(root, "bench-native", keep=2) if name == "native" else None
        self.last = 0
        self.in_place = False

    def _fs(self, step: int) -> tuple[str, FileSystemWriter]:
        shutil.rmtree(self.root / "fs" / f"step-{step - 2}", ignore_errors=True)  # keep two, like the others
        path = str(self.root / "fs" / f"step-{step}")
        return path, FileSystemWriter(path, cache_staged_state_dict=torch.cuda.is_available())

    def _args(self, step: int) -> dict[str, Any]:
        out: dict[str, Any] = {"no_dist": True} if self.no_dist else {"process_group": self.group}
        if self.writer is not None:
            return {**out, "checkpoint_id": step, "storage_writer": self.writer}
        path, writer = self._fs(step)
        return {**out, "checkpoint_id": path, "storage_writer": writer}

    def save(self, step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        if self.native is not None:
            self.native.save(step, self.state).wait()
        else:
            dcp.save(self.state, **self._args(step))
        self.last = step
        took = time.perf_counter() - t0
        return took, took

    def async_save(self, step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        if self.native is not None:
            handle = self.native.save(step, self.state)
            blocked = time.perf_counter() - t0
            handle.wait()
        else:
            fut = dcp.async_save(self.state, **self._args(step))
            blocked = time.perf_counter() - t0
            getattr(fut, "upload_completion", fut).result()
            self.in_place = bool(self.writer is not None and self.writer.staged_in_place)
        self.last = step
        return blocked, time.perf_counter() - t0

    def load(self) -> float:
        t0 = time.perf_counter()
        if self.native is not None:
            self.native.load(self.state, step=self.last)
        else:
            args: dict[str, Any] = {"no_dist": True} if self.no_dist else {"process_group": None}
            if self.writer is not None:
                reader: Any = RamdiskReader(self.root, "bench", fetch=False)
                profile = os.environ.get("DCP_BENCH_PROFILE_LOAD") and os.environ.get("RANK", "0") == "0"
                profiler = cProfile.Profile() if profile else None
                if profiler is not None:
                    profiler.enable()
                dcp.load(self.state, checkpoint_id=self.last, storage_reader=reader, **args)
                if profiler is not None:
                    profiler.disable()
                    sync(self.state)
                    pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(45)
            else:
                path = str(self.root / "fs" / f"step-{self.last}")
                dcp.load(self.state, checkpoint_id=path, storage_reader=FileSystemReader(path), **args)
        sync(self.state)
        return time.perf_counter() - t0

    def close(self) -> None:
        for closer in (self.writer, self.native):
            if closer is not None:
                closer.close()


def slowest(value: float) -> float:
    """The slowest rank's value (the job waits for it)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def timed(fn: Callable[[int], tuple[float, float]], repeats: int, first: int) -> tuple[float, float]:
    """Best (blocked, done) over ``repeats`` after ``WARMUP`` untimed calls, slowest rank each time."""
    best = (float("inf"), float("inf"))
    for i in range(WARMUP + repeats):
        if dist.is_initialized():
            dist.barrier()
        blocked, done = fn(first + i)
        blocked, done = slowest(blocked), slowest(done)
        if i >= WARMUP:
            best = (min(best[0], blocked), min(best[1], done))
    return best


def measure(method: Method, repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    out["save_s"] = timed(method.save, repeats, 100)[0]
    out["async_blocked_s"], out["async_durable_s"] = timed(method.async_save, repeats, 200)
    loads = []
    for _ in range(repeats):
        if dist.is_initialized():
            dist.barrier()
        loads.append(slowest(method.load()))
    out["load_s"] = min(loads)
    if method.writer is not None:
        out["staged_in_place"] = float(method.in_place)
    return out


# ------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=256, help="state size in MiB, all ranks (default 256)")
    parser.add_argument(
        "--small", type=int, default=1024, help="number of small (16 KiB) tensors (one process)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per measurement (best of)")
    parser.add_argument("--dir", default="/dev/shm", help="tmpfs directory to write under (default /dev/shm)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the state lives")
    parser.add_argument("--fsdp", action="store_true", help="an FSDP2 model over torchrun's ranks")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    group = None
    if args.fsdp:
        backend = "cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
        group = dist.new_group(backend="gloo")  # the saves' collectives
        state, _model = fsdp_state(args.mib, args.device)
    else:
        state = plain_state(args.mib, args.small, args.device)
    size = slowest(float(sum(t.nbytes for t in local_tensors(state))))
    gc.collect()
    gc.freeze()  # like a long-running trainer: long-lived objects stop costing full collections
    rank = dist.get_rank() if dist.is_initialized() else 0
    base = Path(args.dir, f"tierckpt-dcp-bench-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}")
    root = base / "root"
    root.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {}
    try:
        for name in METHODS:
            method = Method(name, root, state, group)
            try:
                results[name] = measure(method, args.repeats)
            finally:
                method.close()
        floor_s = slowest(floor(state))
    finally:
        if dist.is_initialized():
            dist.barrier()
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
    if rank == 0:
        report(results, size, floor_s, args)
    if dist.is_initialized():
        dist.destroy_process_group()


def report(
    results: dict[str, dict[str, float]], size: float, floor_s: float, args: argparse.Namespace
) -> None:
    fs, rd, nat = results["filesystem"], results["ramdisk"], results["native"]
    world = dist.get_world_size() if dist.is_initialized() else 1
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else ""
    out = {
        "bench": "dcp",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}"
        + (f", {gpu}" if gpu else ""),
        "mode": "fsdp" if args.fsdp else "one process",
        "device": args.device,
        "world_size": world,
        "bytes_per_rank_max": int(size),
        "repeats": args.repeats,
        "floor_s": floor_s,
        "filesystem_writer": fs,
        "ramdisk_writer": rd,
        "checkpointer": nat,
        "ramdisk_vs_filesystem": {k: fs[k] / rd[k] for k in fs if k in rd},
        "ramdisk_async_blocked_vs_native_blocked": rd["async_blocked_s"] / nat["async_blocked_s"],
        "ramdisk_async_durable_vs_native_durable": rd["async_durable_s"] / nat["async_durable_s"],
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"DCP bench ({out['mode']}, {args.device}, {world} rank(s)): {size / 2**20:.0f} MiB on the slowest "
        f"rank, best of {args.repeats}; {out['machine']}"
    )
    print(f"{'metric':<16}{'FileSystemWriter':>18}{'RamdiskWriter':>16}{'Checkpointer':>15}")
    for k in ("save_s", "async_blocked_s", "async_durable_s", "load_s"):
        print(f"{k.removesuffix('_s'):<16}{fs[k]:>16.3f} s{rd[k]:>14.3f} s{nat[k]:>13.3f} s")
    print(
        f"floor {floor_s:.3f} s; RamdiskWriter async_save blocks "
        f"{out['ramdisk_async_blocked_vs_native_blocked']:.2f}x Checkpointer.save (target <= 1.2), "
        f"durable {out['ramdisk_async_durable_vs_native_durable']:.2f}x; staged in place: "
        f"{bool(rd.get('staged_in_place'))}"
    )


if __name__ == "__main__":
    main()
