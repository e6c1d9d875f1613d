"""What preparing a host slot in the background costs the training thread: a loop of GPU steps (bf16
matmuls, a ``.item()`` per step) while another thread pre-faults a tmpfs data file and pins it with
``cudaHostRegister``, whole or in pieces, the way ``SlotPool`` prepares its spares.

Prints one JSON line per variant: the median and worst step against the steps of the same run without
background work, the steps that overlapped it, and the background phases (seconds and seconds per GiB).
A variant ``malloc`` also allocates a device buffer of the slot's size on the training thread while the
registration runs (what a device-staged first save does). On the device: ``python3
bench/register_stall_bench.py --root /mnt/tierckpt-bench --gib 11``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from tierckpt import cuda
from tierckpt.snapshot.shardfile import MappedFile


def _step(a: torch.Tensor, b: torch.Tensor, matmuls: int) -> float:
    start = time.perf_counter()
    x = a
    for _ in range(matmuls):
        x = torch.mm(x, b)
    float(x[0, 0].item())
    return time.perf_counter() - start


def _background(path: Path, nbytes: int, pieces: int, register: bool, phases: dict[str, float]) -> None:
    start = time.perf_counter()
    f = MappedFile.create(path, nbytes)
    phases["fault_s"] = time.perf_counter() - start
    if register:
        start = time.perf_counter()
        piece = -(-nbytes // pieces)
        piece += -piece % (2 << 20)
        addresses = []
        for offset in range(0, nbytes, piece):
            n = min(piece, nbytes - offset)
            ok = cuda.register(f.address + offset, n, device=0)
            phases["refused"] = phases.get("refused", 0) + (not ok)
            addresses.append(f.address + offset)
        phases["register_s"] = time.perf_counter() - start
        phases["_addresses"] = addresses  # type: ignore[assignment]
    phases["_file"] = f  # type: ignore[assignment]


def _variant(name: str, args: argparse.Namespace, a: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    nbytes = int(args.gib * (1 << 30))
    path = Path(args.root) / f"stall-{name}.bin"
    quiet = [_step(a, b, args.matmuls) for _ in range(args.steps)]
    phases: dict[str, float] = {}
    kind, _, rest = name.partition("-")
    pieces = int(rest) if rest.isdigit() else 1
    worker = threading.Thread(
        target=_background, args=(path, nbytes, pieces, kind in ("register", "malloc"), phases)
    )
    busy: list[float] = []
    malloc_s = None
    started = time.perf_counter()
    if kind != "none":
        worker.start()
    for i in range(args.steps * 4):
        if kind == "malloc" and i == 2:
            t = time.perf_counter()
            staging = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            torch.cuda.synchronize()
            malloc_s = time.perf_counter() - t
            del staging
        busy.append(_step(a, b, args.matmuls))
        if (kind == "none" or not worker.is_alive()) and i >= args.steps:
            break
    if worker.is_alive() or kind != "none":
        worker.join()
    total = time.perf_counter() - started
    for address in phases.pop("_addresses", []):  # type: ignore[attr-defined]
        cuda.unregister(address)
    f = phases.pop("_file", None)
    if f is not None:
        f.close()  # type: ignore[attr-defined]
    path.unlink(missing_ok=True)
    torch.cuda.empty_cache()
    base = statistics.median(quiet)
    gib = nbytes / (1 << 30)
    return {
        "variant": name,
        "gib": round(gib, 2),
        "quiet_median_ms": round(base * 1e3, 2),
        "median_ms": round(statistics.median(busy) * 1e3, 2),
        "worst_ms": round(max(busy) * 1e3, 2),
        "worst_vs_step": round(max(busy) / base, 2),
        "extra_ms_total": round((sum(busy) - base * len(busy)) * 1e3, 1),
        "steps": len(busy),
        "wall_s": round(total, 3),
        "malloc_s": None if malloc_s is None else round(malloc_s, 3),
        **{k: round(v, 3) for k, v in phases.items()},
        **{k.replace("_s", "_s_per_gib"): round(v / gib, 4) for k, v in phases.items() if k.endswith("_s")},
        "ramdisk": os.popen(f"findmnt -no OPTIONS --target {args.root}").read().strip(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--root", required=True, help="a tmpfs directory")
    p.add_argument("--gib", type=float, default=11.0, help="slot size")
    p.add_argument("--steps", type=int, default=20, help="quiet steps before each variant")
    p.add_argument("--matmuls", type=int, default=40, help="8192x8192 bf16 matmuls per step")
    p.add_argument(
        "--variants",
        default="none,fault,register-1,register-16,register-64,malloc-1,malloc-64",
        help="comma-separated: none, fault, register-<pieces>, malloc-<pieces>",
    )
    args = p.parse_args()
    torch.cuda.init()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.01
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.01
    for _ in range(5):
        _step(a, b, args.matmuls)
    for name in args.variants.split(","):
        print(json.dumps(_variant(name, args, a, b)), flush=True)


if __name__ == "__main__":
    main()
