"""Measure lossless codecs for bucket uploads on real model state, before choosing one.

A small GPT-2 (transformers' ``GPT2LMHeadModel``, 6 layers, width 384, byte vocabulary: 11 M
parameters) is trained with AdamW for ``--steps`` steps on this repository's Python sources (real text,
so the weights and the moments are those of a model that learns, not of a fresh initialization). Its
state is then taken as the bucket would see it: the weights in fp32, bf16 and fp16, and AdamW's two
moments (fp32). Each codec compresses and decompresses every tensor's bytes in 4 MiB chunks (the
chunk size of bucket layout 3), one thread, and the table gives the ratio (stored / raw bytes) and the
throughput of each direction (raw MB/s, one core):

- ``zstd-1``, ``zstd-3``: plain zstd (``zstandard``);
- ``group+zstd-1``: byte grouping (byte plane ``i`` of every element together: the exponent bytes
  apart from the mantissa bytes), then zstd level 1 (``tierckpt.protocol.chunks``' codec);
- ``zipnn``: ZipNN (``zipnn`` on PyPI, Huffman over byte planes; it needs torch and numpy);
- ``xor+zstd-1``, ``xor+group+zstd-1``: the XOR of the raw bits against the same tensor
  ``--delta-steps`` training steps earlier (the previous backup), then the codec.

The upload link is measured in the same run (``--link``: 256 MiB put to a fake-gcs-server started for
the run, 8 parallel 32 MiB objects, as the uploader slices), so the table says which codec outruns it.

Run from the repository root: ``.venv/bin/python bench/bucket_codec_bench.py [--steps 60] [--json]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tierckpt.protocol.chunks import CHUNK_SIZE, group_bytes, ungroup_bytes

MiB = 1 << 20


def corpus(limit: int = 8 << 20) -> bytes:
    """This repository's Python sources, concatenated (byte tokens)."""
    root = Path(__file__).resolve().parent.parent
    out = bytearray()
    for path in sorted(root.glob("*/tierckpt*/**/*.py")):
        out += path.read_bytes()
        if len(out) >= limit:
            break
    return bytes(out)


def train(
    steps: int, delta_steps: int
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    """Train the small GPT-2; the state after ``steps - delta_steps`` and after ``steps`` steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=256, n_positions=256, n_embd=384, n_layer=6, n_head=6)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    seq, batch = 128, 8
    snapshots = []
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(data) - seq - 1, (batch,))
        x = torch.stack([data[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step in (steps - delta_steps, steps):
            snapshots.append(state_of(model, opt))
            print(f"step {step}: loss {loss.item():.3f}", file=sys.stderr)
    return snapshots[0], snapshots[1]


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    named = dict(model.named_parameters())
    weights = {n: p.detach().clone() for n, p in named.items()}
    m1 = {n: opt.state[p]["exp_avg"].clone() for n, p in named.items()}
    m2 = {n: opt.state[p]["exp_avg_sq"].clone() for n, p in named.items()}
    return {
        "weights fp32": weights,
        "weights bf16": {n: t.to(torch.bfloat16) for n, t in weights.items()},
        "weights fp16": {n: t.to(torch.float16) for n, t in weights.items()},
        "adam exp_avg fp32": m1,
        "adam exp_avg_sq fp32": m2,
    }


def raw(tensors: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values())


def chunks(data: bytes) -> Iterator[bytes]:
    for off in range(0, len(data), CHUNK_SIZE):
        yield data[off : off + CHUNK_SIZE]


def xor(a: bytes, b: bytes) -> bytes:
    return (int.from_bytes(a, "little") ^ int.from_bytes(b, "little")).to_bytes(len(a), "little")


Codec = tuple[Callable[[bytes, int], bytes], Callable[[bytes, int, int], bytes]]


def codecs() -> dict[str, Codec]:
    import zstandard

    z1, z3, d = (
        zstandard.ZstdCompressor(level=1),
        zstandard.ZstdCompressor(level=3),
        zstandard.ZstdDecompressor(),
    )
    out: dict[str, Codec] = {
        "zstd-1": (lambda b, w: z1.compress(b), lambda c, n, w: d.decompress(c, max_output_size=n)),
        "zstd-3": (lambda b, w: z3.compress(b), lambda c, n, w: d.decompress(c, max_output_size=n)),
        "group+zstd-1": (
            lambda b, w: z1.compress(group_bytes(b, w)),
            lambda c, n, w: ungroup_bytes(d.decompress(c, max_output_size=n), w),
        ),
    }
    try:
        from zipnn import ZipNN
    except ImportError:
        return out
    zips = {
        w: ZipNN(input_format="byte", bytearray_dtype={1: "uint8", 2: "bfloat16", 4: "float32"}[w], threads=1)
        for w in (1, 2, 4)
    }
    out["zipnn"] = (lambda b, w: bytes(zips[w].compress(b)), lambda c, n, w: bytes(zips[w].decompress(c)))
    return out


def measure(name: str, data: bytes, width: int, codec: Codec, base: bytes | None) -> dict[str, Any]:
    enc, dec = codec
    stored = 0
    t_enc = t_dec = 0.0
    base_chunks = list(chunks(base)) if base is not None else None
    for i, part in enumerate(chunks(data)):
        t0 = time.perf_counter()
        src = xor(part, base_chunks[i]) if base_chunks is not None else part
        blob = enc(src, width)
        t1 = time.perf_counter()
        back = dec(blob, len(part), width)
        if base_chunks is not None:
            back = xor(back, base_chunks[i])
        t2 = time.perf_counter()
        if back != part:
            return {
                "codec": name,
                "ratio": float("nan"),
                "compress_MBps": 0.0,
                "decompress_MBps": 0.0,
                "error": "round trip differs",
            }
        stored += len(blob)
        t_enc += t1 - t0
        t_dec += t2 - t1
    return {
        "codec": name,
        "ratio": stored / len(data),
        "compress_MBps": len(data) / t_enc / 1e6,
        "decompress_MBps": len(data) / t_dec / 1e6,
    }


def link_speed(size: int = 256 * MiB, parts: int = 8) -> float:
    """MB/s of ``size`` bytes put to a fresh fake-gcs-server in ``parts`` parallel objects."""
    from tierckpt_demo.fakegcs import FakeGcsServer
    from tierckpt_replicator.backup.gcs import GcsStore
    from tierckpt_replicator.backup.settings import GcsSettings

    payload = secrets.token_bytes(size // parts)
    with FakeGcsServer() as gcs:
        gcs.create_bucket("bench")
        store = GcsStore(GcsSettings(bucket="bench", endpoint=gcs.url))
        with cf.ThreadPoolExecutor(parts) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda i: store.put_bytes(f"link/{i}", payload), range(parts)))
            return size / (time.perf_counter() - t0) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--delta-steps", type=int, default=10)
    ap.add_argument("--no-link", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--cache", default="", help="keep the trained states in this file (reused when it exists)"
    )
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    cache = Path(args.cache) if args.cache else None
    if cache is not None and cache.exists():
        before, after = torch.load(cache)
    else:
        before, after = train(args.steps, args.delta_steps)
        if cache is not None:
            torch.save((before, after), cache)
    rows = []
    for kind, tensors in after.items():
        data = raw(tensors)
        base = raw(before[kind])
        width = next(iter(tensors.values())).element_size()
        for name, codec in codecs().items():
            rows.append({"state": kind, "MiB": len(data) / MiB, **measure(name, data, width, codec, None)})
            if name in ("zstd-1", "group+zstd-1"):
                rows.append(
                    {
                        "state": kind,
                        "MiB": len(data) / MiB,
                        **measure(f"xor+{name}", data, width, codec, base),
                    }
                )
    link = None if args.no_link else link_speed()
    cpu = platform.processor() or platform.machine()
    machine = f"{cpu}, {os.cpu_count()} vCPU, Python {platform.python_version()}"
    if args.json:
        print(json.dumps({"machine": machine, "link_MBps": link, "rows": rows}, indent=1))
        return
    print(f"machine: {machine}; training steps {args.steps}, delta against {args.delta_steps} steps before")
    if link is not None:
        print(f"upload link (fake-gcs-server, 8 x 32 MiB in parallel): {link:.0f} MB/s")
    print("| state | MiB | codec | stored/raw | compress MB/s | decompress MB/s |")
    print("|---|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['state']} | {r['MiB']:.1f} | {r['codec']} | {r['ratio']:.3f} | "
            f"{r['compress_MBps']:.0f} | {r['decompress_MBps']:.0f} |"
            + (f" {r['error']}" if "error" in r else "")
        )


if __name__ == "__main__":
    main()
