"""Benchmark replica groups: save once per node, and restore once + broadcast against every rank reading.

``N`` processes (one per GPU, default 2) hold the same state (a data-parallel replica group) and save it
on one node: the lowest rank writes, the others hard-link its files. Measured, each figure the median of
``--repeats`` runs, each run timed as the slowest rank's (that is when training can go on):

* save: each role's blocking time (the writer copies; a follower only fingerprints and exchanges), the
  fingerprint and exchange times, bytes written against the bytes a save without deduplication writes,
  and the ramdisk bytes held (distinct inodes);
* the device digest alone (GB/s over the whole state);
* restore, warm (the same ``Checkpointer``) and cold (a new one, as after a restart): every rank loading
  its own copy from the ramdisk (a host-to-device copy per rank, checksums on each rank) against the
  lowest rank loading and broadcasting over the group (one host-to-device copy, then NCCL), with and
  without checksum verification;
* the floors: every rank copying the state host-to-device from pinned memory at once, and one NCCL
  broadcast of the same bytes.

Run on the GPU machine: ``bash bench/device_run.sh dp`` (or ``python3 bench/dp_bench.py --size-gib 4``
with ``client`` on ``PYTHONPATH``). ``--device cpu`` runs the same on gloo (a check of the script, not a
measurement). Prints one JSON document.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from client_bench import GIB, build_state, state_bytes

from tierckpt import Checkpointer
from tierckpt.snapshot.fingerprint import device_digest

JOB = "dp-bench"


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _slowest(seconds: float) -> float:
    """The slowest rank's time (every rank calls it)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, seconds)
    return max(out)


def _timed(fn: Any, device: str) -> float:
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return _slowest(time.perf_counter() - start)


def _median(xs: list[float]) -> float:
    return round(statistics.median(xs), 5)


def _zeroed(state: Any) -> None:
    for t in _tensors(state):
        t.zero_()


def _distinct_bytes(root: Path) -> tuple[int, int]:
    """Data bytes on the ramdisk counted per file and per inode."""
    files = [os.stat(p) for p in root.rglob("step-*/data-*.bin")]
    return sum(s.st_size for s in files), sum({s.st_ino: s.st_size for s in files}.values())


def _floors(state: Any, device: str, repeats: int) -> dict[str, float]:
    """Every rank's host-to-device copy from pinned memory at once, and one broadcast of the same bytes."""
    nbytes = state_bytes(state)
    if device != "cuda":
        return {}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = [_timed(lambda: dev.copy_(host, non_blocking=True), device) for _ in range(repeats)]
    bcast = [_timed(lambda: dist.broadcast(dev, 0), device) for _ in range(repeats)]
    return {"h2d_all_ranks_s": _median(h2d), "broadcast_s": _median(bcast)}


def _digest_gbps(state: Any, device: str, repeats: int) -> float:
    # The fingerprint digests on the device what lives there (an optimizer's step counters may stay
    # on the CPU, where crc32c covers them): time the device digest over the device's tensors.
    tensors = [t for t in _tensors(state) if t.numel() and t.device.type == device]
    big = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel() * t.element_size() > 1 << 20]
    small = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel() * t.element_size() <= 1 << 20]

    def run() -> None:
        for b in big:
            device_digest(b)
        if small:
            device_digest(torch.cat(small))

    seconds = _median([_timed(run, device) for _ in range(repeats)])
    return round(sum(t.numel() * t.element_size() for t in tensors) / seconds / 1e9, 2)


def _rank_main(rank: int, world: int, args: argparse.Namespace, init: str, out: str) -> None:
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "cpu:gloo,cuda:nccl",
            init_method=f"file://{init}",
            rank=rank,
            world_size=world,
            device_id=torch.device("cuda", rank),
            timeout=datetime.timedelta(seconds=600),
        )
    else:
        torch.set_num_threads(2)
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        result = _bench(rank, world, args, device)
        if rank == 0:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _bench(rank: int, world: int, args: argparse.Namespace, device: str) -> dict[str, Any]:
    root = Path(args.root)
    state = build_state(int(args.size_gib * GIB), device)
    group = list(range(world))
    r: dict[str, Any] = {
        "bytes_per_rank": state_bytes(state),
        "tensors": len(_tensors(state)),
        "ranks": world,
    }
    r["floors"] = _floors(state, device, args.repeats)
    if device == "cuda":
        r["digest_gbps"] = _digest_gbps(state, device, args.repeats)
    want = [t.clone() for t in _tensors(state)]
    saves: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    with Checkpointer(root=root, job=JOB, keep=2, replica_group=group) as ck:
        ck.prepare(state)
        for step in range(1, args.repeats + 3):
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            handle = ck.save(step, state)
            blocking = time.perf_counter() - start
            handle.wait()
            stats = ck.last_save
            rows: list[Any] = [None] * world
            dist.all_gather_object(rows, {"blocking_s": blocking, **stats})
            saves.append({"step": step, "ranks": rows})
        steady = saves[2:]
        r["save"] = {
            "writer_blocking_s": _median([s["ranks"][0]["blocking_s"] for s in steady]),
            "follower_blocking_s": _median([max(x["blocking_s"] for x in s["ranks"][1:]) for s in steady])
            if world > 1
            else None,
            "fingerprint_s": _median([max(x.get("fingerprint_s", 0) for x in s["ranks"]) for s in steady]),
            "exchange_s": _median([max(x.get("exchange_s", 0) for x in s["ranks"]) for s in steady]),
            "written_bytes": sum(x["written_bytes"] for x in saves[-1]["ranks"]),
            "logical_bytes": sum(x["logical_bytes"] for x in saves[-1]["ranks"]),
            "roles": [x["role"] for x in saves[-1]["ranks"]],
        }
        dist.barrier()
        if rank == 0:
            per_file, per_inode = _distinct_bytes(root / JOB)
            r["ramdisk"] = {"data_bytes_per_file": per_file, "data_bytes_distinct": per_inode}
        warm: dict[str, float] = {}
        for name, broadcast, verify in (
            ("own", False, True),
            ("broadcast", True, True),
            ("own_noverify", False, False),
            ("broadcast_noverify", True, False),
        ):
            times = []
            for _ in range(args.repeats):
                _zeroed(state)
                times.append(
                    _timed(lambda b=broadcast, v=verify: ck.load(state, broadcast=b, verify=v), device)
                )
            warm[name] = _median(times)
            checks[f"warm_{name}"] = _check(state, want)
        r["restore_warm_s"] = warm
    cold: dict[str, float] = {}
    for name, broadcast in (("own", False), ("broadcast", True)):
        times = []
        for _ in range(args.repeats):
            _zeroed(state)

            def restart_and_load(b: bool = broadcast) -> None:
                with Checkpointer(root=root, job=JOB, keep=2, replica_group=group) as fresh:
                    fresh.load(state, broadcast=b)

            times.append(_timed(restart_and_load, device))
        cold[name] = _median(times)
        checks[f"cold_{name}"] = _check(state, want)
    r["restore_cold_s"] = cold
    r["restore_checks"] = checks
    r["restored_ok"] = all(c["ok"] for c in checks.values())
    return r


def _check(state: Any, want: list[torch.Tensor]) -> dict[str, Any]:
    """Whether every rank restored every tensor bit-exact; else the first differing tensor per rank."""
    bad = [
        {"index": i, "shape": list(a.shape), "dtype": str(a.dtype), "device": str(a.device)}
        for i, (a, b) in enumerate(zip(_tensors(state), want, strict=True))
        if not torch.equal(a, b)
    ]
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, {"differing": len(bad), "first": bad[:1]})
    return {"ok": all(row["differing"] == 0 for row in rows), "ranks": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="state size per rank in GiB")
    p.add_argument("--ranks", type=int, default=None, help="processes (default: the GPUs, at least 2)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--root", type=Path, default=None, help="tmpfs directory (default /dev/shm)")
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        p.error("--device cuda needs at least 2 GPUs")
    world = args.ranks or (torch.cuda.device_count() if args.device == "cuda" else 2)
    base = args.root or Path("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args.root = Path(tempfile.mkdtemp(prefix="tierckpt-dp-", dir=base))
    work = Path(tempfile.mkdtemp(prefix="tierckpt-dp-run-"))
    try:
        mp.spawn(_rank_main, args=(world, args, str(work / "init"), str(work / "out.json")), nprocs=world)
        result = json.loads((work / "out.json").read_text())
    finally:
        shutil.rmtree(args.root, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    machine = f"{platform.node()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    if args.device == "cuda":
        machine += f", {world} x {torch.cuda.get_device_name()}"
    print(
        json.dumps({"machine": machine, "device": args.device, "size_gib": args.size_gib, **result}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
