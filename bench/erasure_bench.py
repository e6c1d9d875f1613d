"""Benchmark erasure coding of a step (``tierckpt_replicator.replication.erasure``) against replication.

For each code (k, m): ``encode_step`` of a committed step (its files read and checked, k + m fragment
files written) and ``decode_step`` (the files rebuilt and checked) from the k data fragments (a copy)
and with m data fragments lost (parity used): GB/s of the step's bytes, wall-clock and per CPU-second
of this process, best of ``--repeat``; and the memory it takes to survive m lost nodes: the fragments'
bytes over the step's, against 1 + m full copies with replication.

``--compare`` also times the codec libraries alone on in-memory stripes of k x 256 KiB (what the
module feeds them) and on whole 256 MiB buffers in one call: PyECLib's backends and, when installed,
zfec and reed-solomon-leopard (not dependencies of the project: ``pip install zfec
reed-solomon-leopard`` to include them).

Run from the repository root: ``.venv/bin/python bench/erasure_bench.py [--size-mib 256] [--compare]
[--json]``. As root the step lives in a tmpfs mounted for the run (``--huge`` picks its ``huge=``
option: ``within_size``, as the chart mounts the node ramdisk, or ``never``); otherwise in a
temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tierckpt.protocol.format import read_manifest
from tierckpt_demo.step_writer import write_step
from tierckpt_demo.tmpfs import can_mount, mount_tmpfs, unmount
from tierckpt_replicator.replication.erasure import (
    PIECE,
    decode_step,
    encode_step,
    fragment_name,
    read_erasure_manifest,
)

MiB = 1 << 20
CODES = ((2, 1), (4, 2))


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def best(
    fn: Callable[[], Any], repeat: int, before: Callable[[], None] = lambda: None
) -> tuple[float, float]:
    """(wall, CPU) seconds of the fastest of ``repeat`` calls of ``fn`` (``before`` runs untimed)."""
    runs = []
    for _ in range(repeat):
        before()
        w0, c0 = time.perf_counter(), cpu_seconds()
        fn()
        runs.append((time.perf_counter() - w0, cpu_seconds() - c0))
    return min(runs)


@contextlib.contextmanager
def workdir(huge: str) -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="tierckpt-ec-bench-"))
    mounted = False
    try:
        if can_mount():
            mount_tmpfs(base, "4g", huge=huge)
            mounted = True
        yield base
    finally:
        if mounted:
            unmount(base)
        shutil.rmtree(base, ignore_errors=True)


def step_codes(base: Path, size: int, repeat: int) -> list[dict[str, Any]]:
    step = write_step(base, "bench_ec", 0, 1, sizes=(size,), block=secrets.token_bytes(8 * MiB))
    total = read_manifest(step).total_bytes
    out = []
    for k, m in CODES:
        frags, rebuilt = base / f"frags-{k}-{m}", base / f"out-{k}-{m}"

        def clean_frags(frags: Path = frags) -> None:
            shutil.rmtree(frags, ignore_errors=True)

        enc = best(lambda frags=frags, k=k, m=m: encode_step(step, frags, k, m), repeat, clean_frags)
        em = read_erasure_manifest(frags)  # the last run's
        rebuilt.mkdir()
        all_data = {i: frags / fragment_name(i) for i in range(k)}
        degraded = {i: frags / fragment_name(i) for i in range(m, k + m)}  # data fragments 0..m-1 lost
        dec = best(lambda em=em, r=rebuilt, d=all_data: decode_step(em, d, r), repeat)
        deg = best(lambda em=em, r=rebuilt, d=degraded: decode_step(em, d, r), repeat)
        stored = sum(f.size for f in em.fragments)
        out.append(
            {
                "k": k,
                "m": m,
                "encode_gbps": total / enc[0] / 1e9,
                "encode_gb_per_cpu_s": total / enc[1] / 1e9,
                "decode_data_gbps": total / dec[0] / 1e9,
                "decode_data_gb_per_cpu_s": total / dec[1] / 1e9,
                "decode_degraded_gbps": total / deg[0] / 1e9,
                "decode_degraded_gb_per_cpu_s": total / deg[1] / 1e9,
                "memory_over_step": stored / total,
                "replication_memory_over_step": 1 + m,
                "memory_saved_vs_replication": 1 - stored / total / (1 + m),
            }
        )
        shutil.rmtree(frags)
        shutil.rmtree(rebuilt)
    return out


# ------------------------------------------------------------------------------------------ libraries


def _pyeclib(kind: str) -> Callable[[int, int], tuple[Callable[[bytes], Any], Callable[[Any], Any]]] | None:
    try:
        from pyeclib.ec_iface import ECDriver
    except ImportError:
        return None

    def make(k: int, m: int) -> tuple[Callable[[bytes], Any], Callable[[Any], Any]]:
        d = ECDriver(k=k, m=m, ec_type=kind, chksum_type="none")
        return d.encode, lambda pieces: d.decode(pieces[m:])  # the first m (data) pieces lost

    return make


def _zfec() -> Callable[[int, int], tuple[Callable[[bytes], Any], Callable[[Any], Any]]] | None:
    try:
        import zfec
    except ImportError:
        return None

    def make(k: int, m: int) -> tuple[Callable[[bytes], Any], Callable[[Any], Any]]:
        enc, dec = zfec.Encoder(k, k + m), zfec.Decoder(k, k + m)

        def encode(data: bytes) -> list[bytes]:
            n = len(data) // k
            shares = [data[i * n : (i + 1) * n] for i in range(k)]
            return shares + list(enc.encode(shares, list(range(k, k + m))))

        def decode(pieces: list[bytes]) -> Any:
            # copies: zfec 1.6.0.0's decode writes into the parity blocks it is given
            return dec.decode([bytes(bytearray(p)) for p in pieces[m:]], list(range(m, k + m)))

        return encode, decode

    return make


def _leopard() -> Callable[[int, int], tuple[Callable[[bytes], Any], Callable[[Any], Any]]] | None:
    try:
        import reed_solomon_leopard as rl
    except ImportError:
        return None

    def make(k: int, m: int) -> tuple[Callable[[bytes], Any], Callable[[Any], Any]]:
        def encode(data: bytes) -> list[bytes]:
            n = len(data) // k
            shares = [data[i * n : (i + 1) * n] for i in range(k)]
            return shares + list(rl.encode(shares, m))

        def decode(pieces: list[bytes]) -> Any:
            return rl.decode(k, m, {i: pieces[i] for i in range(m, k)}, {j: pieces[k + j] for j in range(m)})

        return encode, decode

    return make


LIBRARIES = {
    "pyeclib isa_l_rs_cauchy (ours)": _pyeclib("isa_l_rs_cauchy"),
    "pyeclib isa_l_rs_vand": _pyeclib("isa_l_rs_vand"),
    "pyeclib liberasurecode_rs_vand": _pyeclib("liberasurecode_rs_vand"),
    "zfec": _zfec(),
    "reed-solomon-leopard": _leopard(),
}


def compare_libraries(size: int, repeat: int) -> list[dict[str, Any]]:
    data = secrets.token_bytes(64 * MiB)
    out = []
    for name, make in LIBRARIES.items():
        if make is None:
            continue
        for k, m in CODES:
            encode, decode = make(k, m)
            row: dict[str, Any] = {"library": name, "k": k, "m": m}
            for label, stripe in (("stripes", k * PIECE), ("whole", size)):
                chunks = [data[o : o + stripe] for o in range(0, min(len(data), stripe * 64), stripe)]
                if label == "whole":
                    chunks = [(data * (-(-size // len(data))))[:size]]
                n = max(1, size // stripe)
                coded = [encode(chunks[i % len(chunks)]) for i in range(min(n, 8))]

                def run_encode(chunks: list[bytes] = chunks, n: int = n, encode: Any = encode) -> None:
                    for i in range(n):
                        encode(chunks[i % len(chunks)])

                def run_decode(coded: list[Any] = coded, n: int = n, decode: Any = decode) -> None:
                    for i in range(n):
                        decode(coded[i % len(coded)])

                e, d = best(run_encode, repeat), best(run_decode, repeat)
                nbytes = n * len(chunks[0])
                row[f"{label}_encode_gbps"], row[f"{label}_encode_gb_per_cpu_s"] = (
                    nbytes / e[0] / 1e9,
                    nbytes / e[1] / 1e9,
                )
                row[f"{label}_decode_gbps"], row[f"{label}_decode_gb_per_cpu_s"] = (
                    nbytes / d[0] / 1e9,
                    nbytes / d[1] / 1e9,
                )
                del coded
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256, help="bytes of the step (MiB) [256]")
    p.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best counts [3]")
    p.add_argument(
        "--huge", choices=("within_size", "never"), default="within_size", help="tmpfs huge= [within_size]"
    )
    p.add_argument("--compare", action="store_true", help="also time the codec libraries alone")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = p.parse_args(argv)
    size = args.size_mib * MiB
    result: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        "size_bytes": size,
        "piece_bytes": PIECE,
    }
    with workdir(args.huge) as base:
        result["tmpfs"] = can_mount() and f"huge={args.huge}"
        result["codes"] = step_codes(base, size, args.repeat)
    if args.compare:
        result["libraries"] = compare_libraries(size, args.repeat)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    m = result["machine"]
    print(
        f"machine: {m['cpus']} cpus, kernel {m['kernel']}, python {m['python']}; step {args.size_mib} MiB "
        f"in {'a tmpfs, ' + result['tmpfs'] if result['tmpfs'] else 'a temporary directory'}; "
        f"best of {args.repeat}"
    )
    print("code   encode        decode (data frags)  decode (m lost)      memory to survive m losses")
    for c in result["codes"]:
        print(
            f"{c['k']}+{c['m']}    {c['encode_gbps']:5.2f} GB/s ({c['encode_gb_per_cpu_s']:5.2f}/cpu-s)  "
            f"{c['decode_data_gbps']:5.2f} ({c['decode_data_gb_per_cpu_s']:5.2f})        "
            f"{c['decode_degraded_gbps']:5.2f} ({c['decode_degraded_gb_per_cpu_s']:5.2f})        "
            f"{c['memory_over_step']:.3f}x vs {c['replication_memory_over_step']}x replicated "
            f"({c['memory_saved_vs_replication']:.0%} less)"
        )
    for r in result.get("libraries", []):
        print(
            f"{r['library']:32s} {r['k']}+{r['m']}  stripes: enc {r['stripes_encode_gbps']:5.2f} GB/s "
            f"({r['stripes_encode_gb_per_cpu_s']:5.2f}/cpu-s) dec {r['stripes_decode_gbps']:5.2f} "
            f"({r['stripes_decode_gb_per_cpu_s']:5.2f})   whole: enc {r['whole_encode_gbps']:5.2f} "
            f"dec {r['whole_decode_gbps']:5.2f} GB/s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
