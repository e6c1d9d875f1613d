"""Replica groups across real nodes: bytes per step with and without dedup, and the whole-job restore
from the bucket with fan-out against without.

For each layout and node count, a ``tierckpt_demo.cluster.LocalCluster`` (network namespaces, a tmpfs
per node, real replicators, fake-gcs-server behind the counting proxy) and ``--per-node`` gloo training
processes per node saving one step through the real ``Checkpointer(replica_group=...)``:

* ``hsdp``: a 2 x (world/2) ``("replicate", "shard")`` mesh; a DTensor ``(Replicate(), Shard(0))``
  of ``--mib`` MiB per rank: groups {i, i + world/2}, whose members run on different nodes;
* ``ddp``: every rank the same ``--mib`` MiB state, one group of all ranks (members share nodes).

Measured: per step, over all nodes, the bytes the clients wrote to the ramdisks, sent to peers and
uploaded to the bucket, each next to what it would be without dedup (the replicators'
``JobStatus.step_bytes``); then every node is lost and restarted, and the time until every rank is
staged from the bucket is taken with fan-out (``--restore-fanout-wait 300``) and without it
(``--restore-fanout-wait 0``: every node reads its ranks' data objects itself), alternating
``--rounds`` times, with the data-object downloads the bucket served each time.

Run as root from the repository root: ``.venv/bin/python bench/replica_groups_bench.py [--nodes 4 8]
[--json]``. Needs about ``3 x nodes x per-node x mib`` MiB of RAM for the ramdisks and the bucket.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
import threading
import time
import uuid
import warnings
from typing import Any
from urllib.parse import unquote

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from tierckpt import Checkpointer, replica_group_from_mesh
from tierckpt.protocol.control import RestoreState, read_restore_status
from tierckpt_demo.cluster import LocalCluster, Node

FAST = (
    "--poll-interval",
    "1",
    "--reconcile-interval",
    "5",
    "--inventory-timeout",
    "2",
    "--backup-interval",
    "0",
    "--backup-poll-interval",
    "2",
    "--reserve-bytes",
    str(1 << 20),
    "--log-level",
    "INFO",
)
_DATA = re.compile(r"/steps/[0-9]{12,}/rank-[0-9]{5,}/data-[^?/]+")


def _rank(rank: int, world: int, init: str, roots: list[str], per_node: int, layout: str, mib: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rows = mib * (1 << 20) // 4 // 1024
    group: Any
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        g = torch.Generator().manual_seed(5)
        full = torch.randn(rows * (world // 2), 1024, generator=g)
        weight = distribute_tensor(full, mesh, [Replicate(), Shard(0)]).to_local()
        group = replica_group_from_mesh(mesh, "replicate")
    else:
        weight = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(5))
        group = list(range(world))
    state = {"model": {"weight": weight}, "step": 1}
    with Checkpointer(root=roots[rank // per_node], job="bench", keep=2, replica_group=group) as ck:
        ck.save(1, state, blocking=True)
    dist.barrier()
    dist.destroy_process_group()


def save(cluster: LocalCluster, per_node: int, layout: str, mib: int) -> None:
    world = cluster.size * per_node
    init = os.path.join(tempfile.gettempdir(), f"tierckpt-bench-pg-{uuid.uuid4().hex}")
    roots = [str(n.root) for n in cluster.nodes]
    try:
        tmp.start_processes(
            _rank,
            args=(world, init, roots, per_node, layout, mib),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
    finally:
        if os.path.exists(init):
            os.unlink(init)


def statuses(cluster: LocalCluster, job: str) -> list[Any]:
    out = []
    for n in cluster.nodes:
        st = cluster.api.status(n.endpoint, node=n.name)
        out.append(next(j for j in st.jobs if j.job == job))
    return out


def wait_replicated(cluster: LocalCluster, job: str, per_node: int) -> None:
    def done() -> bool:
        for st in statuses(cluster, job):
            if len(st.replicated_to) < per_node or not all(st.replicated_to.values()):
                return False
        return True

    cluster.wait_for(done, timeout=300, interval=0.5, what="every rank replicated")


def backup(cluster: LocalCluster, job: str) -> None:
    errors: list[BaseException] = []

    def post(node: Node) -> None:
        try:
            cluster.api.backup(node.endpoint, job, timeout=300)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=post, args=(n,)) for n in cluster.nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def restore(cluster: LocalCluster, job: str, per_node: int, generation: int, fanout: bool) -> dict[str, Any]:
    wait = "300" if fanout else "0"
    args = list(cluster.replicator_args)
    i = args.index("--restore-fanout-wait")
    args[i + 1] = wait
    cluster.replicator_args = tuple(args)
    for node in cluster.nodes:
        node.kill_replicator()
        node.wipe_ramdisk()
    for node in cluster.nodes:
        node.start_replicator(wait=False)
    for node in cluster.nodes:
        node.wait_ready()
    since = time.time()
    started = time.monotonic()
    cluster.assign(job, generation=generation)

    def all_ready() -> bool:
        for node in cluster.nodes:
            for rank in cluster.ranks_of(node):
                try:
                    st = read_restore_status(node.root, job, rank)
                except Exception:
                    return False
                if st is None or st.state != RestoreState.READY:
                    if st is not None and st.state == RestoreState.FAILED:
                        raise RuntimeError(f"{node.name} rank {rank}: {st.message}")
                    return False
        return True

    cluster.wait_for(all_ready, timeout=600, interval=0.05, what="every rank restored")
    seconds = time.monotonic() - started
    assert cluster.gcs_proxy is not None
    data_gets = sum(
        1
        for h in cluster.gcs_proxy.hits
        if h.method == "GET" and h.at >= since and "alt=media" in h.target and _DATA.search(unquote(h.target))
    )
    return {"fanout": fanout, "seconds": round(seconds, 2), "data_object_downloads": data_gets}


def run(nodes: int, per_node: int, layout: str, mib: int, rounds: int) -> dict[str, Any]:
    size = f"{max(64, 4 * per_node * mib + 32)}m"
    with LocalCluster(
        nodes=nodes,
        job="static",
        k=1,
        procs_per_node=per_node,
        gcs=True,
        count_gcs_reads=True,
        ramdisk_size=size,
        replicator_args=(*FAST, "--restore-fanout-wait", "300"),
    ) as cluster:
        job = "bench"
        cluster.assign(job)
        save(cluster, per_node, layout, mib)
        wait_replicated(cluster, job, per_node)
        backup(cluster, job)
        acc = [st.step_bytes for st in statuses(cluster, job)]
        total = {
            k: sum(getattr(a, k) for a in acc if a is not None)
            for k in (
                "written",
                "written_logical",
                "replicated",
                "replicated_logical",
                "uploaded",
                "uploaded_logical",
            )
        }
        restores = []
        generation = 2
        for _ in range(rounds):
            for fanout in (True, False):
                restores.append(restore(cluster, job, per_node, generation, fanout))
                generation += 1
        with_f = [r["seconds"] for r in restores if r["fanout"]]
        without = [r["seconds"] for r in restores if not r["fanout"]]
        return {
            "layout": layout,
            "nodes": nodes,
            "ranks": nodes * per_node,
            "mib_per_rank": mib,
            "bytes_per_step": total,
            "restores": restores,
            "restore_seconds_fanout": statistics.median(with_f),
            "restore_seconds_without": statistics.median(without),
        }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--per-node", type=int, default=2)
    ap.add_argument("--mib", type=int, default=16, help="MiB of tensor state per rank")
    ap.add_argument("--layouts", nargs="+", default=["hsdp", "ddp"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results = [run(n, a.per_node, layout, a.mib, a.rounds) for n in a.nodes for layout in a.layouts]
    if a.json:
        print(json.dumps(results, indent=2))
        return
    mib = 1 << 20
    for r in results:
        b = r["bytes_per_step"]
        print(
            f"{r['layout']:5} {r['nodes']} nodes x {r['ranks'] // r['nodes']} ranks, "
            f"{r['mib_per_rank']} MiB/rank: "
            f"written {b['written'] / mib:.0f}/{b['written_logical'] / mib:.0f} MiB, "
            f"replicated {b['replicated'] / mib:.1f}/{b['replicated_logical'] / mib:.0f} MiB, "
            f"uploaded {b['uploaded'] / mib:.0f}/{b['uploaded_logical'] / mib:.0f} MiB (with/without dedup); "
            f"restore {r['restore_seconds_fanout']:.1f} s with fan-out, "
            f"{r['restore_seconds_without']:.1f} s without; "
            f"data objects read {[x['data_object_downloads'] for x in r['restores']]}"
        )


if __name__ == "__main__":
    main()
