"""The bucket protocol at thousands of nodes: requests per backup step, per idle poll and per restore,
counted per node, against the budgets of docs/benchmarks.md.

The scale rig (tests/backup/scale_rig.py): ``--nodes`` lightweight nodes (real ``BackupService``s, many
in this process, on small synthetic steps in /dev/shm) of ``--ranks-per-node`` ranks each, every node the
primary of its ranks and the holder of its ring predecessor's replicas, ``peers.json`` as the operator
sends a big job. Two steps are backed up (the second retires the first), the nodes poll while idle, and
the whole job restores the second step from the bucket (``--restore``), compared byte for byte.

``--store fake-gcs`` runs against fake-gcs-server through google-cloud-storage (the rig counts the
requests with the model the CI test checks against the proxy's count); ``--store memory`` on the rig's
in-memory bucket. The CI runs 1,024 and 10,240 ranks (tests/backup/test_bucket_scale.py); this runs the
larger ones: ``--nodes 4096 --store fake-gcs --restore`` (32,768 ranks), ``--nodes 12800`` (102,400).

Run from the repository root: ``.venv/bin/python bench/bucket_scale_bench.py --nodes 4096``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), *(str(REPO / d) for d in ("client", "replicator", "demo"))]

from tests.backup.scale_rig import MemoryBucket, Phase, ScaleRig, budget  # noqa: E402
from tierckpt_replicator.backup.gcs import GcsSettings, GcsStore, RetryPolicy  # noqa: E402
from tierckpt_replicator.backup.store import ObjectStore  # noqa: E402


@contextlib.contextmanager
def store(kind: str) -> Iterator[ObjectStore]:
    if kind == "memory":
        yield MemoryBucket()
        return
    from tierckpt_demo.fakegcs import FakeGcsServer

    with FakeGcsServer() as gcs:
        gcs.create_bucket("scale-bench")
        s = GcsStore(
            GcsSettings(
                bucket="scale-bench",
                endpoint=gcs.url,
                pool_size=128,
                read_timeout=120.0,
                retry=RetryPolicy(initial=0.5, maximum=8.0, deadline=600.0),
            )
        )
        s.put_bytes("warm-up", b"")
        yield s


def row(p: Phase) -> dict[str, Any]:
    return {
        "phase": p.name,
        "seconds": round(p.seconds, 1),
        "requests": p.total,
        **{f"{k}s": v for k, v in p.by_kind.items()},
        "node_max": p.node_max,
        "node_deletes_max": p.node_deletes_max,
        "completion_stats_max": p.completion_stats_max,
        "by_object": dict(sorted(p.by_object.items())),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    base = Path(tempfile.mkdtemp(prefix="bucket-scale-", dir=shm))
    out: dict[str, Any] = {
        "nodes": args.nodes,
        "ranks_per_node": args.ranks_per_node,
        "ranks": args.nodes * args.ranks_per_node,
        "files": args.files,
        "store": args.store,
        "machine": f"{platform.node()} {os.cpu_count()} CPUs",
        "load_before": os.getloadavg()[0],
    }
    try:
        with store(args.store) as bucket:
            rig = ScaleRig(
                base / "nodes",
                lambda node: bucket,
                nodes=args.nodes,
                ranks_per_node=args.ranks_per_node,
                files=args.files,
                concurrency=args.concurrency,
            )
            out["budget"] = budget(rig)
            try:
                for step in (10, 20):
                    started = time.monotonic()
                    rig.write_step(step)
                    print(f"  step {step} written in {time.monotonic() - started:.1f}s", flush=True)
                    phase = await rig.back_up(step)
                    print(f"  {phase.name}: {phase.total} requests in {phase.seconds:.1f}s", flush=True)
                    assert await rig.services[rig.names[-1]].complete_steps(rig.job) == (step,)
                await rig.idle(2)
                if args.restore:
                    rig.drop_step(10)
                    phase = await rig.restore(20, base / "restored")
                    print(f"  {phase.name}: {phase.total} requests in {phase.seconds:.1f}s", flush=True)
                    out["restored_ranks_compared"] = rig.check_restored(20, base / "restored")
                out["phases"] = [row(p) for p in rig.phases]
            finally:
                await rig.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out["load_after"] = os.getloadavg()[0]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=4096)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--files", type=int, default=1, help="data files a rank (F)")
    p.add_argument("--store", choices=("memory", "fake-gcs"), default="memory")
    p.add_argument("--restore", action="store_true", help="also restore the whole job from the bucket")
    p.add_argument("--concurrency", type=int, default=32, help="node passes at once")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    out = asyncio.run(run(args))
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
