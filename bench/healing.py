"""Healing time after a node loss: seconds from the replacement's new peer plan until the job is back
at full redundancy, for a given state size per rank (``healing_seconds``; ``replicator_bench.py`` runs
it, or run this file alone).

On a ``LocalCluster`` of three nodes (a ring, one replica per rank): every node commits one step of
``size`` bytes and it is replicated; node A is lost (replicator killed, RAM disk wiped) and comes back
empty, as a replacement; the operator's new plan (generation + 1) goes to every node, and the clock
starts. Full redundancy: A staged its rank again (from its peer's replica), every rank's step has a
committed replica on a live node other than its primary's, and every node reports
``Redundancy.degraded_since`` None. Nothing is saved meanwhile.

    sudo .venv/bin/python bench/healing.py --size-mib 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

from tierckpt.protocol.control import RestoreState, RestoreStatus, read_restore_status
from tierckpt.protocol.format import rank_dir, read_commit, replica_rank_dir, step_dir
from tierckpt_demo.cluster import LocalCluster, Node
from tierckpt_demo.step_writer import write_step

_ARGS = ("--poll-interval", "1", "--reconcile-interval", "5", "--retry-max", "2", "--log-level", "WARNING")


def _committed(path: Path) -> bool:
    try:
        return read_commit(path) is not None
    except Exception:
        return False


def _replicated(cluster: LocalCluster, job: str, rank: int, step: int) -> bool:
    primary = cluster.nodes[rank]
    return any(
        n is not primary and n.running and _committed(step_dir(replica_rank_dir(n.root, job, rank), step))
        for n in cluster.nodes
    )


def _restored(node: Node, job: str, rank: int) -> bool:
    try:
        st = read_restore_status(node.root, job, rank)
    except Exception:
        return False
    return isinstance(st, RestoreStatus) and st.state == RestoreState.READY


def _healthy(cluster: LocalCluster, node: Node, job: str) -> bool:
    jobs = [j for j in cluster.api.status(node.endpoint, node=node.name).jobs if j.job == job]
    return bool(jobs) and jobs[0].redundancy is not None and jobs[0].redundancy.degraded_since is None


def healing_seconds(
    cluster: LocalCluster, size: int, *, job: str = "bench_heal", timeout: float = 600
) -> float:
    """Seconds from the replacement's plan to full redundancy (see the module docstring)."""
    a = cluster.nodes[0]
    step = 5
    cluster.assign(job)
    for node in cluster.nodes:
        write_step(
            node.root,
            job,
            node.index,
            step,
            world_size=cluster.size,
            sizes=(size,),
            block=b"\x5a" * (1 << 20),
        )
    LocalCluster.wait_for(
        lambda: all(_replicated(cluster, job, r, step) for r in range(cluster.size)),
        timeout=timeout,
        what="replicas",
    )
    a.kill_replicator()
    a.wipe_ramdisk()
    a.start_replicator()
    started = time.perf_counter()
    cluster.assign(job, generation=2)

    def healed() -> bool:
        return (
            _restored(a, job, 0)
            and _committed(step_dir(rank_dir(a.root, job, 0), step))
            and all(_replicated(cluster, job, r, step) for r in range(cluster.size))
            and all(_healthy(cluster, n, job) for n in cluster.nodes)
        )

    LocalCluster.wait_for(healed, timeout=timeout, interval=0.05, what="full redundancy")
    seconds = time.perf_counter() - started
    for node in cluster.nodes:
        cluster.api.purge(node.endpoint, job, node=node.name)
    return seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=int, default=64, help="bytes of each rank's step (MiB) [64]")
    p.add_argument("--repeat", type=int, default=3, help="node losses timed [3]")
    args = p.parse_args(argv)
    size = args.size_mib << 20
    ramdisk = f"{max(256, 8 * args.size_mib)}m"
    with LocalCluster(
        nodes=3, job="bench_heal_static", k=1, ramdisk_size=ramdisk, replicator_args=_ARGS
    ) as cluster:
        times = [healing_seconds(cluster, size, job=f"bench_heal_{i}") for i in range(args.repeat)]
    result: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cpus, "
        f"kernel {platform.release()}",
        "state_bytes_per_rank": size,
        "healing_seconds": sorted(times),
        "healing_seconds_median": sorted(times)[len(times) // 2],
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
