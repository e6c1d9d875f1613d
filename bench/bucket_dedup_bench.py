"""Bytes to the bucket, and backup and restore times, with chunks (bucket layout 3) against whole objects
(layout 2, the previous upload) in the same run, on one fake-gcs-server started for the run.

A model of ``--layers`` linear layers of width ``--dim`` is saved by the real ``Checkpointer`` at each
of ``--steps`` steps (model and AdamW state) and every step is backed up by a ``BackupService`` with the
default settings (8 transfers) for each variant, each into its own bucket:

- ``finetune``: the layers are a frozen bf16 base with trainable fp32 low-rank adapters of rank
  ``--adapter-rank`` (AdamW on the adapters only);
- ``full``: every parameter (fp32) trains with AdamW: every byte changes at every step.

Variants: ``layout 2`` (whole objects, today's upload), ``chunks`` (layout 3, compression off: the
default) and ``chunks+zstd`` / ``chunks+grouped`` (layout 3 with the codecs). For each: bytes sent per
backup after the first (and against layout 2), the mean backup time of those, and the time to restore
the newest step of the rank into an empty directory (MB/s of the step's bytes, best of ``--repeat``).
The link is loopback to fake-gcs-server (the layout 2 first upload's MB/s is printed with the table),
or with ``--link RATE`` (root, iproute2) a veth pair to fake-gcs-server in a network namespace of its
own, shaped to ``RATE`` each way (``tc tbf``, e.g. ``2gbit``): a node's share of the bucket's
throughput, where loopback measures the CPU of this machine (fake-gcs-server, the hashing and copying of
the restore on the same cores).

Run from the repository root: ``.venv/bin/python bench/bucket_dedup_bench.py [--dim 2048 --layers 8
--adapter-rank 10 --steps 4] [--variants "layout 2,chunks"] [--link 2gbit] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from prometheus_client import CollectorRegistry

from tierckpt import Checkpointer
from tierckpt.protocol.format import rank_dir
from tierckpt_demo.fakegcs import FakeGcsServer
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore
from tierckpt_replicator.backup.metrics import BackupMetrics
from tierckpt_replicator.backup.service import BackupService
from tierckpt_replicator.backup.settings import BackupSettings

JOB = "bench"
VARIANTS: dict[str, dict[str, Any]] = {
    "layout 2": {"chunks": False},
    "chunks": {"chunks": True, "compression": "off"},
    "chunks+zstd": {"chunks": True, "compression": "zstd"},
    "chunks+grouped": {"chunks": True, "compression": "grouped"},
}


class Counting:
    """Counts the bytes every upload sends (writer leases aside)."""

    def __init__(self, inner: GcsStore) -> None:
        self.inner, self.sent = inner, 0

    def put_bytes(self, key: str, data: bytes, **kw: Any) -> Any:
        if "/writers/" not in key:
            self.sent += len(data)
        return self.inner.put_bytes(key, data, **kw)

    def upload_file(self, key: str, fd: int, **kw: Any) -> Any:
        info = self.inner.upload_file(key, fd, **kw)
        self.sent += info.size
        return info

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Adapted(torch.nn.Module):
    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(dim, dim, bias=False, dtype=torch.bfloat16).requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, dim) * 0.01)
        self.b = torch.nn.Parameter(torch.zeros(dim, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x.to(torch.bfloat16)).float() + x @ self.a.T @ self.b.T


def model_of(kind: str, layers: int, dim: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    if kind == "finetune":
        model: torch.nn.Module = torch.nn.Sequential(*(Adapted(dim, rank) for _ in range(layers)))
    else:
        model = torch.nn.Sequential(*(torch.nn.Linear(dim, dim, bias=False) for _ in range(layers)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, opt


async def run(kind: str, args: argparse.Namespace, url: str, gcs: FakeGcsServer, tmp: Path) -> dict[str, Any]:
    model, opt = model_of(kind, args.layers, args.dim, args.adapter_rank)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    root = tmp / kind
    services: dict[str, tuple[BackupService, Counting]] = {}
    variants = {n: VARIANTS[n] for n in args.variants.split(",")}
    for i, (name, overrides) in enumerate(variants.items()):
        bucket = f"{kind}-{i}"
        gcs.create_bucket(bucket)
        store = Counting(GcsStore(GcsSettings(bucket=bucket, endpoint=url)))
        settings = dataclasses.replace(
            BackupSettings(prefix="b", interval_seconds=0, keep_last=2), **overrides
        )
        svc = BackupService(
            settings, node="n", root=root, store=store, metrics=BackupMetrics(CollectorRegistry())
        )
        services[name] = (svc, store)
    sent: dict[str, list[int]] = {n: [] for n in variants}
    seconds: dict[str, list[float]] = {n: [] for n in variants}
    with Checkpointer(root=root, job=JOB, keep=2) as ck:
        for step in range(1, args.steps + 1):
            model(torch.randn(8, args.dim)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, blocking=True)
            for name, (svc, store) in services.items():
                before, t0 = store.sent, time.perf_counter()
                assert await svc.backup_now(JOB) == step
                seconds[name].append(time.perf_counter() - t0)
                sent[name].append(store.sent - before)
    step_bytes = sum(p.stat().st_size for p in (root / JOB).rglob(f"step-{args.steps:012d}/*"))
    restores: dict[str, list[float]] = {n: [] for n in variants}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeat):  # interleaved, best of: the machine is shared
        for name, (svc, _) in services.items():
            dest = tmp / f"restore-{kind}-{name.replace(' ', '_').replace('+', '_')}"
            t0 = time.perf_counter()
            await svc.fetch_rank(JOB, args.steps, 0, rank_dir(dest, JOB, 0))
            restores[name].append(time.perf_counter() - t0)
            shutil.rmtree(dest)
    loads.append(os.getloadavg()[0])
    rows = []
    for name, (svc, _) in services.items():
        restore = min(restores[name])
        later = sent[name][1:]
        rows.append(
            {
                "kind": kind,
                "variant": name,
                "step_MiB": step_bytes / 2**20,
                "first_MiB": sent[name][0] / 2**20,
                "later_MiB": sum(later) / len(later) / 2**20,
                "later_vs_layout2": sum(later) / sum(sent["layout 2"][1:]),
                "backup_s": sum(seconds[name][1:]) / len(later),
                "first_backup_s": seconds[name][0],
                "restore_s": restore,
                "restore_MBps": step_bytes / restore / 1e6,
                "restore_median_s": sorted(restores[name])[len(restores[name]) // 2],
                "load": loads,
            }
        )
        await svc.close()
    base = next(r for r in rows if r["variant"] == "layout 2")
    for r in rows:
        r["restore_vs_layout2"] = r["restore_MBps"] / base["restore_MBps"]
        r["median_vs_layout2"] = base["restore_median_s"] / r["restore_median_s"]
        r["frozen_fraction"] = 1 - trainable / total
        r["link_MBps"] = base["step_MiB"] * 2**20 / base["first_backup_s"] / 1e6
    return {"rows": rows}


@contextlib.contextmanager
def shaped_server(rate: str) -> Iterator[FakeGcsServer]:
    """fake-gcs-server in a network namespace of its own behind a veth pair shaped to ``rate`` each way."""
    tag = f"dd{os.getpid() % 100000}"
    ns, host_if, net = f"{tag}ns", f"{tag}h", f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    tbf = ("root", "tbf", "rate", rate, "burst", "4mb", "latency", "100ms")
    try:
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "addr", "add", f"{net}.1/30", "dev", host_if)
        sh("ip", "link", "set", host_if, "up")
        sh("ip", "-n", ns, "addr", "add", f"{net}.2/30", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("tc", "qdisc", "add", "dev", host_if, *tbf)  # uploads
        sh("tc", "-n", ns, "qdisc", "add", "dev", "eth0", *tbf)  # downloads (restores)
        with FakeGcsServer(host=f"{net}.2", port=4443, netns=ns) as gcs:
            yield gcs
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    server = shaped_server(args.link) if args.link else FakeGcsServer()
    with server as gcs, tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
        for kind in args.kinds.split(","):
            rows += (await run(kind, args, gcs.url, gcs, Path(tmp)))["rows"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--adapter-rank", type=int, default=10)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--kinds", default="finetune,full")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="of: " + ", ".join(VARIANTS))
    ap.add_argument("--repeat", type=int, default=3, help="restores timed (the best counts)")
    ap.add_argument("--tmp", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--link", default="", help="shape the link to fake-gcs-server to this tc rate (root)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} vCPU"
    print(f"machine: {machine}; {args.layers} layers of {args.dim}, adapters of rank {args.adapter_rank}")
    print(
        "| run | variant | step MiB | 1st backup MiB | later backups MiB | vs layout 2 | backup s | "
        "restore s | restore MB/s | vs layout 2 | median vs layout 2 | load |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        run_name = (
            f"{r['kind']} ({100 * r['frozen_fraction']:.1f}% frozen)"
            if r["kind"] == "finetune"
            else r["kind"]
        )
        print(
            f"| {run_name} | {r['variant']} | {r['step_MiB']:.1f} | {r['first_MiB']:.1f} | "
            f"{r['later_MiB']:.2f} | "
            f"{100 * r['later_vs_layout2']:.1f}% | {r['backup_s']:.2f} | {r['restore_s']:.2f} | "
            f"{r['restore_MBps']:.0f} | {r['restore_vs_layout2']:.2f}x | {r['median_vs_layout2']:.2f}x | "
            f"{r['load'][0]:.1f}-{r['load'][1]:.1f} |"
        )
    link = f"shaped to {args.link}" if args.link else "loopback"
    print(f"link ({link}; layout 2's first backup reached): {rows[0]['link_MBps']:.0f} MB/s")


if __name__ == "__main__":
    main()
