"""What keeping DCP's replicated items once per node costs, against DCP's once per job.

Saves two states from ``--nodes`` x ``--per-node`` gloo processes on one machine, node ``n`` being the
directory ``<dir>/node-n`` (its ramdisk) and ``$TIERCKPT_NODE_NAME=node-n``:

* ``fsdp``: an FSDP2 MLP (the demo's model, ``--params``) with Adam: the shards are each rank's own,
  only Adam's step counters and the non-tensor state (param_groups) are replicated;
* ``ddp``: the same model and Adam state as plain tensors on every rank (data parallel without sharding):
  everything is replicated.

Reports, from the committed steps: all bytes of the checkpoint on all nodes, the bytes of the copies
(what once-per-job would not store), and the metadata each node holds.

    python bench/dcp_nodes_bench.py --nodes 3 --per-node 2 --params 1M --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as tmp

from tierckpt.dcp import RamdiskWriter
from tierckpt.dcp.metadata import DcpMetadata
from tierckpt.protocol.format import DCP_METADATA_NAME, rank_dir, read_manifest, step_dir

JOB = "nodes-bench"


def _state(kind: str, params: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from tierckpt_demo.training import Net, parse_model_size

    torch.manual_seed(0)
    net = Net(parse_model_size(params))
    if kind == "fsdp":
        mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
        for layer in net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
        opt = torch.optim.Adam(net.parameters())
        msd, osd = get_state_dict(net, opt)
        return {"model": msd, "optim": osd, "extra": {"step": 1}}
    opt = torch.optim.Adam(net.parameters())
    net(torch.randn(4, 32)).sum().backward()
    opt.step()
    return {"model": net.state_dict(), "optim": opt.state_dict(), "extra": {"step": 1}}


def _rank(rank: int, world: int, init: str, base: str, per_node: int, kind: str, params: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    node = rank // per_node
    os.environ["TIERCKPT_NODE_NAME"] = f"node-{node}"
    root = Path(base, kind, f"node-{node}")
    root.mkdir(parents=True, exist_ok=True)
    dcp.save(_state(kind, params), checkpoint_id=1, storage_writer=RamdiskWriter(root, JOB))
    dist.barrier()
    dist.destroy_process_group()


def measure(base: Path, kind: str, nodes: int, per_node: int) -> dict[str, Any]:
    world = nodes * per_node
    steps = {r: step_dir(rank_dir(base / kind / f"node-{r // per_node}", JOB, r), 1) for r in range(world)}
    manifests = {r: read_manifest(p) for r, p in steps.items()}
    total = sum(m.total_bytes for m in manifests.values())
    carriers = [r for r, p in steps.items() if (p / DCP_METADATA_NAME).exists()]
    record = DcpMetadata.from_bytes((steps[carriers[0]] / DCP_METADATA_NAME).read_bytes())
    length = {(r, t.key): t.length for r, m in manifests.items() for t in m.tensors}
    copies = 0
    for e in record.entries:
        ndim = 0 if e.tensor is None else len(e.tensor.size)
        for i, ranks in e.items.copies.items():
            offset = e.items.index_offsets[i * ndim : (i + 1) * ndim]
            key = e.fqn if e.tensor is None else f"{e.fqn}@{','.join(map(str, offset))}"
            copies += sum(length[(r, key)] for r in ranks)
    metadata = (steps[carriers[0]] / DCP_METADATA_NAME).stat().st_size
    return {
        "state": kind,
        "checkpoint_bytes_all_nodes": total,
        "copy_bytes": copies,
        "once_per_job_bytes": total - copies - (len(carriers) - 1) * metadata,
        "added_vs_once_per_job": copies / max(1, total - copies),
        "metadata_bytes_per_node": metadata,
        "metadata_carriers": carriers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--per-node", type=int, default=2)
    parser.add_argument("--params", default="1M", help="model size (tierckpt_demo.training.parse_model_size)")
    parser.add_argument("--dir", default="/dev/shm")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tierckpt-nodes-bench-", dir=args.dir))
    world = args.nodes * args.per_node
    out = []
    try:
        for kind in ("fsdp", "ddp"):
            init = os.path.join(tempfile.gettempdir(), f"tierckpt-nodes-bench-{uuid.uuid4().hex}")
            tmp.start_processes(
                _rank,
                args=(world, init, str(base), args.per_node, kind, args.params),
                nprocs=world,
                start_method="spawn",
            )
            out.append(measure(base, kind, args.nodes, args.per_node))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        print(
            json.dumps(
                {"nodes": args.nodes, "per_node": args.per_node, "params": args.params, "states": out},
                indent=2,
            )
        )
        return
    print(f"{args.nodes} nodes x {args.per_node} ranks, model {args.params} + Adam")
    for r in out:
        total, copies = r["checkpoint_bytes_all_nodes"] / 2**20, r["copy_bytes"] / 2**20
        print(
            f"{r['state']:>5}: {total:8.2f} MiB on all nodes, of which copies {copies:.3f} MiB "
            f"(+{100 * r['added_vs_once_per_job']:.2f}% over once per job); metadata "
            f"{r['metadata_bytes_per_node'] / 1024:.1f} KiB per node (ranks {r['metadata_carriers']})"
        )


if __name__ == "__main__":
    main()
