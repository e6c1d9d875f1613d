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
import dataclasses
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


@dataclasses.dataclass
class _Prepared:
    """What the background thread prepared: the slot's file, its registered pieces, and the phases."""

    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    file: MappedFile | None = None
    addresses: list[int] = dataclasses.field(default_factory=list)


def _background(
    path: Path,
    nbytes: int,
    pieces: int,
    register: bool,
    duty: float,
    out: _Prepared,
    drain: str,
    src: torch.Tensor | None,
) -> None:
    start = time.perf_counter()
    out.file = MappedFile.create(path, nbytes)
    out.phases["fault_s"] = time.perf_counter() - start
    if src is not None:
        _drain(out, src, drain)
    if register:
        start = time.perf_counter()
        piece = -(-nbytes // pieces)
        piece += -piece % (2 << 20)
        for offset in range(0, nbytes, piece):
            n = min(piece, nbytes - offset)
            t = time.perf_counter()
            if not cuda.register(out.file.address + offset, n, device=0):
                out.phases["refused"] = out.phases.get("refused", 0) + 1
            out.addresses.append(out.file.address + offset)
            if duty < 1:  # paced: idle (1/duty - 1) times as long as the piece took
                took = time.perf_counter() - t
                out.phases["busy_s"] = out.phases.get("busy_s", 0.0) + took
                time.sleep(took * (1 / duty - 1))
        out.phases["register_s"] = time.perf_counter() - start


def _drain(out: _Prepared, src: torch.Tensor, how: str) -> None:
    """Drain ``src`` (a device buffer) into the faulted, unregistered mapping: ``pageable`` (CUDA copies
    straight into pageable memory, 256 MiB at a time, on a side stream) or ``bounce`` (into three pinned
    64 MiB bounce buffers, each emptied into the mapping by a CPU copy while the next DMA runs)."""
    assert out.file is not None
    dst = out.file.buffer
    n = src.numel()
    stream = torch.cuda.Stream()
    start = time.perf_counter()
    with torch.cuda.stream(stream):
        if how == "pageable":
            for o in range(0, n, 256 << 20):
                dst[o : o + (256 << 20)].copy_(src[o : o + (256 << 20)], non_blocking=True)
            stream.synchronize()
        else:
            chunk = 64 << 20
            bounce = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
            pending: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor]] = []
            for k, o in enumerate(range(0, n, chunk)):
                m = min(chunk, n - o)
                if len(pending) == 3:  # empty the oldest buffer before refilling it
                    event, host, staged = pending.pop(0)
                    event.synchronize()
                    host.copy_(staged)
                bounce[k % 3][:m].copy_(src[o : o + m], non_blocking=True)
                e = torch.cuda.Event()
                e.record(stream)
                pending.append((e, dst[o : o + m], bounce[k % 3][:m]))
            for event, host, staged in pending:
                event.synchronize()
                host.copy_(staged)
    seconds = time.perf_counter() - start
    out.phases[f"{how}_drain_s"] = seconds
    out.phases[f"{how}_drain_gbps"] = n / seconds / 1e9


def _copy_rate(f: MappedFile, nbytes: int, pieces: int) -> dict[str, object]:
    """GB/s of one device-to-host copy of up to 2 GiB into the mapping, inside one registered piece;
    and whether CUDA takes a copy that spans two registrations (it may refuse it: invalid argument)."""
    piece = -(-nbytes // pieces)
    piece += -piece % (2 << 20)
    n = min(2 << 30, piece // 2)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = f.buffer[piece // 4 : piece // 4 + n]
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    out: dict[str, object] = {"d2h_gbps_in_piece": round(n / (time.perf_counter() - start) / 1e9, 2)}
    if pieces > 1:
        across = f.buffer[piece - n // 2 : piece + n // 2]
        try:
            start = time.perf_counter()
            across.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            out["d2h_gbps_across_pieces"] = round(n / (time.perf_counter() - start) / 1e9, 2)
        except RuntimeError as e:
            out["d2h_across_pieces_error"] = str(e).splitlines()[0]
    return out


def _variant(name: str, args: argparse.Namespace, a: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    nbytes = int(args.gib * (1 << 30))
    path = Path(args.root) / f"stall-{name}.bin"
    quiet = [_step(a, b, args.matmuls) for _ in range(args.steps)]
    prepared = _Prepared()
    kind, *rest = name.split("-")
    pieces = int(rest[0]) if rest else 1
    duty = int(rest[1]) / 100 if len(rest) > 1 else 1.0
    src = None
    if kind in ("pageable", "bounce"):
        src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
    worker = threading.Thread(
        target=_background,
        args=(path, nbytes, pieces, kind in ("register", "malloc", "paced"), duty, prepared, kind, src),
    )
    busy: list[float] = []
    copies: dict[str, object] = {}
    malloc_s = None
    started = time.perf_counter()
    if kind != "none":
        worker.start()
    for i in range(args.steps * 10):
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
    phases = prepared.phases
    if prepared.file is not None and kind in ("register", "malloc", "paced"):
        copies = _copy_rate(prepared.file, nbytes, pieces)
    for address in prepared.addresses:
        cuda.unregister(address)
    if src is not None and prepared.file is not None:
        probe = torch.randint(0, n := src.numel(), (16,))
        phases["drain_exact"] = float(
            all(int(prepared.file.buffer[i]) == int(src[i]) for i in probe.tolist())
        )
        del n
    del src
    if prepared.file is not None:
        prepared.file.close()
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
        **copies,
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
        help="comma-separated: none, fault, register-<pieces>, malloc-<pieces>, paced-<pieces>-<duty %%>,"
        " pageable, bounce (pieces registered with idle time between them: busy <duty> %% of the time)",
    )
    args = p.parse_args()
    torch.cuda.init()  # type: ignore[no-untyped-call]
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.01
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.01
    for _ in range(5):
        _step(a, b, args.matmuls)
    for name in args.variants.split(","):
        print(json.dumps(_variant(name, args, a, b)), flush=True)


if __name__ == "__main__":
    main()
